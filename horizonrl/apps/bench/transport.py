"""Part 5 — transport: trajectories/s and MB/s into the buffer, ZMQ+msgpack against pickle over mp.Queue,
and through the real buffer process with its write-ahead log on vs off (``buffer_intake.py``).

P producer processes (the actors' side) send trajectories of N tokens to one consumer (the
buffer's side, this process), for N in 1k / 8k / 32k tokens and P in 1 / 4. A run moves a
fixed number of messages per size, split evenly over the producers (so a 4-producer run
takes about as long as a 1-producer one), each producer sending a fixed count:

- ``zmq+msgpack`` — the project's path: a real :class:`~horizonrl.protocol.Trajectory`,
  :func:`~horizonrl.protocol.encode` per message, a PUSH socket per producer into one PULL
  socket on tcp loopback (``make_socket`` with the actor's and the buffer's high-water marks),
  and the buffer's own decode, ``decode_as(data, Trajectory, MAX_TRAJECTORY_BYTES)``.
- ``mpq pickle lists`` — the naive baseline: the same content as a plain dict whose token
  ids, loss mask and logprobs are Python lists, put on a ``multiprocessing.Queue`` (pickled
  by its feeder thread, unpickled by ``get``; a local queue, not a socket).
- ``mpq pickle numpy`` — a fairer baseline: the same dict with numpy arrays instead of lists.

The consumer touches every message (its length and last token id) and checks the first
message of every run against what the producer was asked to build. Rates are measured at the
consumer from the first to the last receive: (messages − 1) / that time. A short run can
overstate that rate when the consumer starts late and finds a backlog in the sockets'
buffers, so ``traj_per_s_from_cmd`` also shows messages / (last receive − the moment the
consumer told the producers to start), which errs the other way. MB/s counts the
*payload*, the same for every transport: 9 bytes per token (int32 id, uint8 mask, float32
logprob); the bytes each transport actually moves per message are in ``wire_KB``.

Each repeat runs the three transports back to back (order alternating); ratios per repeat:
zmq+msgpack ÷ each baseline, per (size, producers).

Run alone: ``python -m horizonrl.apps.bench.transport [--quick] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
import time
import traceback
from pathlib import Path
from typing import Any

from horizonrl.apps.bench import buffer_intake
from horizonrl.apps.bench.synthetic_trajectories import synthetic_trajectory
from horizonrl.apps.bench.report import (
    alternate,
    make_result,
    paired_ratio,
    print_table,
    progress,
    summarize,
    write_results,
)

PART = "transport"
HOST = "127.0.0.1"
ZMQ, MPQ_LISTS, MPQ_NUMPY = "zmq+msgpack", "mpq pickle lists", "mpq pickle numpy"
TRANSPORTS = (ZMQ, MPQ_LISTS, MPQ_NUMPY)
PAYLOAD_BYTES_PER_TOKEN = 4 + 1 + 4  # int32 token id, uint8 loss mask, float32 logprob
SIZES = (1024, 8192, 32768)
PRODUCERS = (1, 4)
# Messages per run (split over the producers), per size: enough that a run of the fastest
# transport lasts ~0.1 s on a loaded 2-core machine and holds several times what the sockets'
# high-water marks can buffer. Pickled lists are ~10x slower, so their runs send a quarter.
COUNTS_QUICK = {1024: 2000, 8192: 600, 32768: 160}
COUNTS_FULL = {1024: 4800, 8192: 1600, 32768: 480}
LISTS_SHARE = 4


def make_trajectory(num_tokens: int, producer: int, index: int):
    """A deterministic trajectory of ``num_tokens`` tokens; only its id depends on ``producer`` and ``index``."""
    return synthetic_trajectory(num_tokens, f"p{producer}-m{index}")


def as_plain_dict(trajectory, arrays: str) -> dict[str, Any]:
    """The trajectory as a naive system would send it: a dict with ``arrays`` = "lists" or "numpy"."""
    import msgspec

    from horizonrl.protocol.arrays import LOGPROB_DTYPE, MASK_DTYPE, TOKEN_DTYPE, unpack

    plain = msgspec.structs.asdict(trajectory)
    for field, dtype in (("token_ids", TOKEN_DTYPE), ("loss_mask", MASK_DTYPE), ("logprobs", LOGPROB_DTYPE)):
        values = unpack(plain[field], dtype).copy()
        plain[field] = values.tolist() if arrays == "lists" else values
    return plain


def run(quick: bool, out_dir: Path | None = None, *, sizes: tuple[int, ...] = SIZES,
        producers: tuple[int, ...] = PRODUCERS, repeats: int | None = None, counts: dict[int, int] | None = None,
        transports: tuple[str, ...] = TRANSPORTS, timeout_s: float = 60.0, intake: bool = True) -> dict:
    """Measure every (size, producers, transport); returns the part's result (see :mod:`horizonrl.apps.bench.report`).

    ``counts`` maps a size to messages per run (each of P producers sends count // P; runs of
    pickled lists and the warm-up run send a quarter of that). ``timeout_s`` bounds every wait for a message, a producer
    or a process. ``intake`` adds the real buffer process, write-ahead log on vs off (``buffer_intake.py``).
    """
    repeats = repeats or (3 if quick else 5)
    counts = {size: (counts or {}).get(size) or _default_count(size, quick) for size in sizes}
    if ZMQ not in transports:
        raise ValueError(f"transports must include {ZMQ!r}, the candidate the ratios are taken against")
    settings = {"quick": quick, "sizes_tokens": list(sizes), "producers": list(producers), "repeats": repeats,
                "messages_per_run": counts, "messages_per_run_pickle_lists": {
                    size: count // LISTS_SHARE for size, count in counts.items()}, "transports": list(transports),
                "payload_bytes_per_token": PAYLOAD_BYTES_PER_TOKEN, **_socket_settings()}
    progress(PART, f"sizes {list(sizes)} tokens, producers {list(producers)}, {repeats} repeats")

    # measurements[(size, producers, transport)] = one dict per repeat
    measurements: dict[tuple[int, int, str], list[dict]] = {}
    with _Harness(max(producers), timeout_s) as harness:
        for size in sizes:
            for num_producers in producers:
                for repeat in range(-1, repeats):  # repeat -1 warms every path up and is not reported
                    for transport in alternate(max(repeat, 0), transports):
                        share = (LISTS_SHARE if transport == MPQ_LISTS else 1) * (4 if repeat < 0 else 1)
                        per_producer = max(2, counts[size] // share // num_producers)
                        measured = harness.measure(transport, size, num_producers, per_producer)
                        if repeat >= 0:
                            measurements.setdefault((size, num_producers, transport), []).append(measured)
                progress(PART, f"{size} tokens × {num_producers} producer(s) done")

    rows, ratios = [], {}
    for size in sizes:
        for num_producers in producers:
            group = {t: measurements[(size, num_producers, t)] for t in transports}
            rows += [_row(size, num_producers, t, group[t]) for t in transports]
            for baseline in transports[1:]:
                ratios[f"{_kt(size)} × {num_producers}p: zmq / {baseline.removeprefix('mpq ')} traj/s"] = paired_ratio(
                    [m["traj_per_s"] for m in group[ZMQ]], [m["traj_per_s"] for m in group[baseline]])
    if intake:
        intake_rows, intake_ratios, intake_settings = buffer_intake.measure(quick, repeats,
                                                                            timeout_s=max(timeout_s, 120))
        rows += intake_rows
        ratios.update(intake_ratios)
        settings.update(intake_settings)
    result = make_result(PART, rows, ratios, settings,
                         chart={"metric": "MB_per_s", "ylabel": "payload MB/s at the consumer", "log": True})
    if out_dir is not None:  # a folder of its own, so parts sharing one out_dir do not overwrite each other
        paths = write_results([result], Path(out_dir) / PART)
        progress(PART, f"wrote {paths['json']} and {paths['chart']}")
    return result


def _row(size: int, num_producers: int, transport: str, repeats: list[dict]) -> dict:
    return {
        "label": f"{_kt(size)} tok × {num_producers}p / {transport}",
        "traj_per_s": summarize([m["traj_per_s"] for m in repeats]),
        "MB_per_s": summarize([m["traj_per_s"] * size * PAYLOAD_BYTES_PER_TOKEN / 1e6 for m in repeats]),
        "traj_per_s_from_cmd": summarize([m["traj_per_s_from_cmd"] for m in repeats]),
        "wire_KB": repeats[0]["wire_bytes"] / 1e3,
        "received": f"{repeats[0]['received']}/{repeats[0]['sent']}",
        "all_received": all(m["received"] == m["sent"] for m in repeats),
        "first_equal": all(m["first_equal"] for m in repeats),
    }


def _default_count(size: int, quick: bool) -> int:
    table = COUNTS_QUICK if quick else COUNTS_FULL
    if size in table:
        return table[size]
    return max(4, table[1024] * 1024 // size)  # other sizes: about the payload of a 1k run


def _kt(size: int) -> str:
    return f"{size // 1024}k" if size % 1024 == 0 else str(size)


def _socket_settings() -> dict:
    from horizonrl.core.config import BufferConfig, RolloutConfig

    rollout = RolloutConfig()
    return {"push_hwm": max(4, rollout.n), "pull_hwm": BufferConfig().capacity_groups * rollout.n,
            "mp_queue_maxsize": BufferConfig().capacity_groups * rollout.n}


# ------------------------------------------------------------------------------ the consumer


class _Harness:
    """The consumer's side: one PULL socket and one mp.Queue, and the producer processes feeding both.

    Producers are started once and told per run what to send (starting a process per run
    would cost more than most runs); each says hello on both channels before the first run.
    """

    def __init__(self, num_producers: int, timeout_s: float) -> None:
        self.num_producers = num_producers
        self.timeout_s = timeout_s

    def __enter__(self) -> "_Harness":
        import zmq

        from horizonrl.protocol.transport import free_port, make_socket, tcp_endpoint

        settings = _socket_settings()
        self.zmq_context = zmq.Context()
        self.pull = make_socket(self.zmq_context, zmq.PULL, hwm=settings["pull_hwm"])
        self.pull.setsockopt(zmq.RCVTIMEO, int(self.timeout_s * 1000))
        endpoint = tcp_endpoint(HOST, free_port(HOST))
        self.pull.bind(endpoint)
        ctx = mp.get_context("spawn")
        self.data: mp.Queue = ctx.Queue(maxsize=settings["mp_queue_maxsize"])
        self.status: mp.Queue = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(self.num_producers)]
        self.procs = [ctx.Process(target=_producer_main, name=f"bench-transport-producer-{i}", daemon=True,
                                  args=(i, endpoint, settings["push_hwm"], self.data, self.commands[i], self.status,
                                        self.timeout_s)) for i in range(self.num_producers)]
        try:
            progress(PART, f"starting {self.num_producers} producer processes")
            for proc in self.procs:
                proc.start()
            hellos: dict[str, set[int]] = {ZMQ: set(), MPQ_LISTS: set()}
            deadline = time.monotonic() + self.timeout_s
            while any(len(seen) < self.num_producers for seen in hellos.values()):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"transport producers did not say hello within {self.timeout_s:.0f} s")
                hellos[ZMQ].update(self._zmq_hellos())
                hellos[MPQ_LISTS].update(self._mpq_hellos())
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _zmq_hellos(self) -> set[int]:
        seen = set()
        while self.pull.poll(50):
            seen.add(int(self._zmq_receive().trajectory_id.split("-")[0].removeprefix("hello")))
        self._check_producers()
        return seen

    def _mpq_hellos(self) -> set[int]:
        seen = set()
        try:
            while True:
                seen.add(int(self.data.get(timeout=0.05)["trajectory_id"].removeprefix("hello")))
        except queue.Empty:
            return seen

    def _zmq_receive(self):
        import zmq

        from horizonrl.buffer.server import MAX_TRAJECTORY_BYTES
        from horizonrl.protocol import Trajectory, decode_as

        try:
            return decode_as(self.pull.recv(), Trajectory, MAX_TRAJECTORY_BYTES)
        except zmq.Again:
            self._check_producers()
            raise TimeoutError(f"no trajectory on the PULL socket within {self.timeout_s:.0f} s") from None

    def _mpq_receive(self) -> dict:
        try:
            return self.data.get(timeout=self.timeout_s)
        except queue.Empty:
            self._check_producers()
            raise TimeoutError(f"no trajectory on the mp.Queue within {self.timeout_s:.0f} s") from None

    def _check_producers(self) -> None:
        try:
            while True:
                status = self.status.get_nowait()
                if status[0] == "error":
                    raise RuntimeError(f"transport producer {status[1]} failed:\n{status[2]}")
        except queue.Empty:
            pass
        dead = [p for p in self.procs if p.exitcode is not None]
        if dead:
            raise RuntimeError(f"{dead[0].name} (pid {dead[0].pid}) exited with {dead[0].exitcode}")

    def measure(self, transport: str, size: int, num_producers: int, count: int) -> dict:
        """One run: ``num_producers`` producers send ``count`` trajectories each; rates at this end."""
        from horizonrl.protocol import encode
        from horizonrl.protocol.arrays import TOKEN_DTYPE, unpack

        expected_total = num_producers * count
        if expected_total < 2:
            raise ValueError("a run needs at least 2 messages to measure a rate")
        commanded_at = time.perf_counter()
        for i in range(num_producers):
            self.commands[i].put((transport, size, count))
        receive = self._zmq_receive if transport == ZMQ else self._mpq_receive
        first_equal = None
        touched = 0
        first_at = last_at = 0.0
        for n in range(expected_total):
            message = receive()
            last_at = time.perf_counter()
            if n == 0:
                first_at = last_at
            # Touch it as the buffer would: how long it is and its last token.
            if transport == ZMQ:
                touched += message.num_tokens + int(unpack(message.token_ids, TOKEN_DTYPE)[-1])
            else:
                touched += len(message["token_ids"]) + int(message["token_ids"][-1])
            if n == 0:
                first_equal = _equals_expected(transport, message, size)
        sample = make_trajectory(size, 0, 0)
        wire = len(encode(sample)) if transport == ZMQ else _pickled_size(
            as_plain_dict(sample, "lists" if transport == MPQ_LISTS else "numpy"))
        return {"traj_per_s": (expected_total - 1) / (last_at - first_at),
                "traj_per_s_from_cmd": expected_total / (last_at - commanded_at), "received": expected_total,
                "sent": self._sent(num_producers), "first_equal": first_equal, "wire_bytes": wire,
                "touched": touched}

    def _sent(self, num_producers: int) -> int:
        """Wait for every producer's report of how many it sent in this run."""
        sent, reported = 0, 0
        deadline = time.monotonic() + self.timeout_s
        while reported < num_producers:
            try:
                status = self.status.get(timeout=1.0)
            except queue.Empty:
                self._check_producers()
                if time.monotonic() > deadline:
                    raise TimeoutError("a transport producer did not report the end of its run") from None
                continue
            if status[0] == "error":
                raise RuntimeError(f"transport producer {status[1]} failed:\n{status[2]}")
            sent += status[2]
            reported += 1
        return sent

    def __exit__(self, *exc) -> None:
        for commands in getattr(self, "commands", []):
            commands.put(None)
        for proc in getattr(self, "procs", []):
            if proc.pid is not None:
                proc.join(timeout=5)
        for proc in getattr(self, "procs", []):  # ended by pid: SIGTERM, then SIGKILL
            if proc.pid is not None and proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
                if proc.is_alive():
                    proc.kill()
                    proc.join(timeout=5)
        for q in [getattr(self, "data", None), getattr(self, "status", None), *getattr(self, "commands", [])]:
            if q is not None:
                q.cancel_join_thread()  # never block exit on a queue's unsent leftovers
                q.close()
        if hasattr(self, "pull"):
            self.pull.close(linger=0)
            self.zmq_context.term()


def _equals_expected(transport: str, message, size: int) -> bool:
    producer, index = (int(part[1:]) for part in _trajectory_id(transport, message).split("-"))
    expected = make_trajectory(size, producer, index)
    if transport == ZMQ:
        return message == expected
    plain = as_plain_dict(expected, "lists" if transport == MPQ_LISTS else "numpy")
    if transport == MPQ_LISTS:
        return message == plain
    import numpy as np

    return message.keys() == plain.keys() and all(
        np.array_equal(message[k], v) if isinstance(v, np.ndarray) else message[k] == v for k, v in plain.items())


def _trajectory_id(transport: str, message) -> str:
    return message.trajectory_id if transport == ZMQ else message["trajectory_id"]


def _pickled_size(obj) -> int:
    from multiprocessing.reduction import ForkingPickler

    return len(ForkingPickler.dumps(obj))  # what mp.Queue's feeder thread writes


# ------------------------------------------------------------------------------ the producers


def _producer_main(index: int, endpoint: str, push_hwm: int, data: mp.Queue, commands: mp.Queue,
                   status: mp.Queue, timeout_s: float) -> None:
    """One actor's side: on each command, send ``count`` trajectories of one size over one transport."""
    import msgspec
    import zmq

    from horizonrl.protocol import encode
    from horizonrl.protocol.transport import make_socket

    context = zmq.Context()
    push = make_socket(context, zmq.PUSH, hwm=push_hwm)
    push.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    push.connect(endpoint)
    plain_cache: dict[tuple[int, str], dict] = {}
    try:
        hello = synthetic_trajectory(16, f"hello{index}")
        push.send(encode(hello))
        data.put(as_plain_dict(hello, "lists"), timeout=timeout_s)
        while True:
            try:
                command = commands.get(timeout=1.0)  # the consumer sends None at the end
            except queue.Empty:
                if not mp.parent_process().is_alive():  # the consumer died without saying so
                    break
                continue
            if command is None:
                break
            transport, size, count = command
            base = make_trajectory(size, index, 0)
            if transport == ZMQ:
                for i in range(count):
                    push.send(encode(msgspec.structs.replace(base, trajectory_id=f"p{index}-m{i}")))
            else:
                arrays = "lists" if transport == MPQ_LISTS else "numpy"
                if (size, arrays) not in plain_cache:  # built once, as the Trajectory is (synthetic_trajectory's cache)
                    plain_cache[size, arrays] = as_plain_dict(base, arrays)
                plain = plain_cache[size, arrays]
                for i in range(count):
                    data.put({**plain, "trajectory_id": f"p{index}-m{i}"}, timeout=timeout_s)
            status.put(("done", index, count))
    except BaseException:
        status.put(("error", index, traceback.format_exc()))
        raise
    finally:
        push.close(linger=0)
        context.term()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {getattr(__spec__, 'name', __name__)}",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer messages, 3 repeats (full: 5 repeats)")
    parser.add_argument("--out", type=Path, default=None, help="write results.json and chart.png into OUT/transport/")
    parser.add_argument("--sizes", default=None,
                        help="comma-separated trajectory sizes in tokens (default 1024,8192,32768)")
    parser.add_argument("--producers", default=None, help="comma-separated producer counts (default 1,4)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--count", type=int, default=None, help="messages per run (split over the producers), "
                        "for every size")
    parser.add_argument("--timeout-s", type=float, default=60.0)
    args = parser.parse_args(argv)
    sizes = tuple(int(s) for s in args.sizes.split(",")) if args.sizes else SIZES
    start = time.perf_counter()
    result = run(args.quick, args.out, sizes=sizes,
                 producers=tuple(int(p) for p in args.producers.split(",")) if args.producers else PRODUCERS,
                 repeats=args.repeats, counts={s: args.count for s in sizes} if args.count else None,
                 timeout_s=args.timeout_s)
    print_table(result)
    print(f"({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
