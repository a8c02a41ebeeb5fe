"""Part of ``transport``: trajectories/s through the real buffer process, write-ahead log on vs off.

P producer threads (the actors' side, each its own DEALER socket) send N trajectories of S tokens
each to a real ``horizonrl buffer`` process and wait for every acknowledgement; the rate is
trajectories / (last acknowledgement − first send). With the log on, an acknowledgement means the
trajectory is on disk (``buffer.wal_fsync``: ``batch`` is one fsync per drained batch, the default;
``always`` one per record); off, it means the buffer holds it in memory. Every run gets a fresh
output directory; the buffer's capacity is large enough that no backpressure applies.
"""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path

from horizonrl.apps.bench.report import alternate, paired_ratio, progress, summarize
from horizonrl.apps.bench.synthetic_trajectories import synthetic_trajectory

PART = "transport"
MODES = {"log off": ["buffer.wal=false"], "log on (fsync batch)": ["buffer.wal_fsync=batch"],
         "log on (fsync always)": ["buffer.wal_fsync=always"]}
BASELINE = "log off"


def _trajectories(size: int, producer: int, count: int, run_id: str) -> list[bytes]:
    import msgspec

    from horizonrl.protocol import encode

    base = synthetic_trajectory(size, "")
    # version 0 (the starting model): the buffer knows it without a learner announcing anything
    base = msgspec.structs.replace(base, run_id=run_id, group_size=2, turn_versions=[0] * len(base.turn_versions))
    return [encode(msgspec.structs.replace(base, trajectory_id=f"p{producer}-{i}", group_id=f"p{producer}-g{i // 2}",
                                           reward=float(i % 2)))
            for i in range(count)]


def _measure_once(mode: str, size: int, producers: int, per_producer: int, timeout_s: float) -> dict:
    import zmq

    from horizonrl.core.config import load_config
    from horizonrl.launcher import prepare_run
    from horizonrl.protocol import TrajectoryAck, decode_as

    with tempfile.TemporaryDirectory(prefix="horizonrl-intake-") as tmp:
        config, path = prepare_run(load_config(None, [
            "model.path=/unused", "envs=[{name: signpost}]", f"run.output_dir={tmp}/run",
            "buffer.capacity_groups=1000000", "buffer.max_staleness=1000", *MODES[mode]]))
        payloads = [_trajectories(size, p, per_producer, config.run.run_id) for p in range(producers)]
        buffer = _start_buffer(path, Path(tmp))
        ctx = zmq.Context()
        try:
            endpoint = config.network.endpoint(config.network.trajectory_port)
            _wait_ready(ctx, endpoint, config.run.run_id, size, timeout_s)
            times: list[tuple[float, float]] = []
            errors: list[str] = []

            def produce(index: int) -> None:
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, 0)
                sock.connect(endpoint)
                try:
                    start = time.perf_counter()
                    for data in payloads[index]:
                        sock.send(data)
                    acked = 0
                    while acked < per_producer:
                        if not sock.poll(int(timeout_s * 1000)):
                            errors.append(f"producer {index}: {acked}/{per_producer} acknowledged")
                            return
                        acked += len(decode_as(sock.recv(), TrajectoryAck).trajectory_ids)
                    times.append((start, time.perf_counter()))
                finally:
                    sock.close(linger=0)

            threads = [threading.Thread(target=produce, args=(p,)) for p in range(producers)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if errors:
                raise RuntimeError("; ".join(errors))
        finally:
            ctx.term()
            buffer.terminate()
            buffer.wait(30)
    elapsed = max(end for _, end in times) - min(start for start, _ in times)
    return {"traj_per_s": producers * per_producer / elapsed}


def _start_buffer(config_path: Path, tmp: Path):
    import subprocess
    from horizonrl.core.programs import role_command

    return subprocess.Popen(role_command("buffer", str(config_path)),
                            stdout=open(tmp / "buffer.log", "wb"), stderr=subprocess.STDOUT)


def _wait_ready(ctx, endpoint: str, run_id: str, size: int, timeout_s: float) -> None:
    """One trajectory in and acknowledged: the buffer is up (and its first append has happened)."""
    import zmq

    from horizonrl.protocol import TrajectoryAck, decode_as

    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send(_trajectories(size, 999, 1, run_id)[0])
        if not sock.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"the buffer at {endpoint} did not acknowledge within {timeout_s:.0f} s")
        decode_as(sock.recv(), TrajectoryAck)
    finally:
        sock.close(linger=0)


def measure(quick: bool, repeats: int, timeout_s: float = 120.0,
            per_producer: int | None = None) -> tuple[list[dict], dict[str, dict], dict]:
    """Rows and ratios (each mode against the log off, paired per repeat) for the transport part."""
    size, producers = 1024, 4
    per_producer = per_producer or (300 if quick else 2500)
    repeats = min(repeats, 2) if quick else repeats
    progress(PART, f"buffer intake: {producers} producers x {per_producer} trajectories of {size} tokens, "
                   f"{repeats} repeats, modes {list(MODES)}")
    measured: dict[str, list[float]] = {mode: [] for mode in MODES}
    for repeat in range(-1, repeats):  # repeat -1 warms up and is not reported
        for mode in alternate(max(repeat, 0), list(MODES)):
            rate = _measure_once(mode, size, producers, per_producer if repeat >= 0 else per_producer // 4,
                                 timeout_s)["traj_per_s"]
            if repeat >= 0:
                measured[mode].append(rate)
        if repeat >= 0:
            progress(PART, f"buffer intake: repeat {repeat + 1}/{repeats} done")
    rows = [{"label": f"buffer intake 1k tok × {producers}p / {mode}", "traj_per_s": summarize(rates),
             "MB_per_s": summarize([r * size * 9 / 1e6 for r in rates])} for mode, rates in measured.items()]
    ratios = {f"buffer intake: {mode} / {BASELINE} traj/s": paired_ratio(measured[mode], measured[BASELINE])
              for mode in MODES if mode != BASELINE}
    settings = {"intake_tokens": size, "intake_producers": producers, "intake_trajectories_per_producer": per_producer}
    return rows, ratios, settings
