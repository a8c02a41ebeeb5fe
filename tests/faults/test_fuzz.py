"""Over 10,000 malformed or inconsistent messages to every listening socket of a running training:
no process dies, every message is counted, and the learner keeps stepping.

The sockets: the buffer's trajectory intake and batch sockets (ZMQ ROUTER), the coordinator's report
socket (ZMQ PULL), and the two torch TCPStores (the weight hub's and the learner's own process
group's: raw TCP). The coordinator's control socket is a PUB: it reads nothing.

Messages over a socket's size limit (ZMQ MAXMSGSIZE) are refused by the transport — the connection is
dropped before the message is read — so they are sent separately and only survival is checked for
them; everything else must show up in the receiving process's counters, exactly.
"""

from __future__ import annotations

import glob
import random
import re
import socket
import struct
import time
from pathlib import Path

import msgspec
import pytest
import zmq
from helpers import horizonrl_cmd, make_trajectory, start_process, stop_process, wait_until

from horizonrl.core.config import load_config
from horizonrl.protocol import BatchRequest, Control, EpisodeSample, Heartbeat, LearnerReport, encode
from horizonrl.protocol.arrays import LOGPROB_DTYPE, TOKEN_DTYPE, pack

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "signpost_test.yaml"
PER_SOCKET = 3400  # x 3 ZMQ sockets > 10,000
STEP = re.compile(r"^step (\d+)/\d+", re.M)
RAW_TCP = 200  # connections with random bytes to each TCPStore


def junk(rng: random.Random, run_id: str, n: int) -> bytes:
    """One of: random bytes, truncated msgpack, msgpack of the wrong shape, a huge declared length,
    a well-formed message of another run, or one of the wrong type for the socket."""
    valid = encode(make_trajectory(f"junk{n}", 0, run_id=run_id))
    kind = n % 6
    if kind == 0:
        return rng.randbytes(rng.randint(0, 2000))
    if kind == 1:
        return valid[: rng.randint(0, len(valid) - 1)]
    if kind == 2:
        return msgspec.msgpack.encode(rng.choice([{"type": "trajectory", "v": 2, "run_id": 7},
                                                   [1, 2, 3], {"type": rng.choice(["nope", "batch"]), "v": 2},
                                                   "a string", None, 1.5]))
    if kind == 3:  # msgpack bin32 that claims 2 GB and holds 10 bytes
        return b"\xc6" + struct.pack(">I", 2**31) + rng.randbytes(10)
    if kind == 4:
        return encode(make_trajectory(f"junk{n}", 0, run_id="another-run"))
    return encode(Control(run_id=run_id, learner_step=0, max_turns=1, weight_version=0))  # not for this socket


def inconsistent_trajectory(rng: random.Random, run_id: str, n: int) -> bytes:
    """Schema-valid, of this run, and wrong inside: arrays of different lengths, NaN, out-of-vocab ids."""
    t = make_trajectory(f"bad{n}", 0, run_id=run_id, group_size=2)
    kind = n % 4
    if kind == 0:
        t = msgspec.structs.replace(t, logprobs=t.logprobs[:-4])
    elif kind == 1:
        t = msgspec.structs.replace(t, reward=float("nan"))
    elif kind == 2:
        t = msgspec.structs.replace(t, token_ids=pack([0] * 11 + [10**6], TOKEN_DTYPE))
    else:
        t = msgspec.structs.replace(t, logprobs=pack([0] * 6 + [float("nan")] * 6, LOGPROB_DTYPE))
    return encode(t)


def bad_request(rng: random.Random, run_id: str, n: int) -> bytes:
    """Never a valid request (one would take a batch from the real learner)."""
    if n % 3 == 0:
        return encode(BatchRequest(run_id="another-run", request_id=n, learner_version=0, num_groups=1))
    if n % 3 == 1:
        return encode(BatchRequest(run_id=run_id, request_id=n, learner_version=0, num_groups=0))
    return junk(rng, run_id, n)


def bad_report(rng: random.Random, run_id: str, n: int) -> bytes:
    if n % 4 == 0:
        return encode(Heartbeat(run_id="another-run", role="actor", index=0, pid=1))
    if n % 4 == 1:
        return encode(LearnerReport(run_id="another-run", step=10**6, weight_version=10**6))
    if n % 4 == 2:
        return encode(EpisodeSample(run_id="another-run", env="x", task_id=0, actor_id=0, weight_version=0, max_turns=1,
                                    reward=0, success=False, score=0, num_turns=0, stop_reason="done"))
    return junk(rng, run_id, n)


def latest_scalars(run_dir: Path) -> dict[str, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(glob.glob(str(run_dir / "tensorboard" / "events.*"))[0])
    acc.Reload()
    return {tag: acc.Scalars(tag)[-1].value for tag in acc.Tags()["scalars"]}


def test_malformed_messages_to_every_socket_are_counted_and_training_goes_on(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    log = tmp_path / "run.log"
    proc = start_process(horizonrl_cmd("train", str(CONFIG), f"model.path={tiny_model}", f"run.output_dir={run_dir}",
                                       "rollout.num_actors=1", "rollout.n=4", "learner.groups_per_step=2",
                                       "buffer.capacity_groups=64", "learner.total_steps=200"), log)
    rng = random.Random(1234)
    ctx = zmq.Context()
    sockets = []
    try:
        wait_until(lambda: "step 2/200" in log.read_text(errors="replace"), 400, "learner step 2")
        config = load_config(run_dir / "config.yaml")
        net, run_id = config.network, config.run.run_id
        before = latest_scalars(run_dir)

        def connect(kind, port):
            s = ctx.socket(kind)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 0)
            s.connect(net.endpoint(port))
            sockets.append(s)
            return s

        intake = connect(zmq.DEALER, net.trajectory_port)
        requests = connect(zmq.DEALER, net.batch_port)
        reports = connect(zmq.PUSH, net.report_port)
        sent = {"intake_junk": 0, "intake_inconsistent": 0}
        for n in range(PER_SOCKET):
            if n % 2:
                intake.send(inconsistent_trajectory(rng, run_id, n))
                sent["intake_inconsistent"] += 1
            else:
                intake.send(junk(rng, run_id, n))
                sent["intake_junk"] += 1
            requests.send(bad_request(rng, run_id, n))
            reports.send(bad_report(rng, run_id, n))
        for port in (net.weight_port, net.dist_port):  # the torch TCPStores
            for _ in range(RAW_TCP):
                with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
                    raw.sendall(rng.randbytes(rng.randint(1, 512)))
        oversized = connect(zmq.DEALER, net.trajectory_port)
        oversized.send(b"\x00" * (65 * 1024 * 1024))  # over the intake's MAXMSGSIZE
        total = 3 * PER_SOCKET + 2 * RAW_TCP
        assert total >= 10_000

        expected_buffer = PER_SOCKET + PER_SOCKET  # intake junk + inconsistent, and the bad requests
        fuzzed_at_step = max(int(x) for x in STEP.findall(log.read_text(errors="replace")))

        def counted_and_stepping():
            now = latest_scalars(run_dir)
            counted = sum(now.get(t, 0.0) - before.get(t, 0.0) for t in now
                          if t.startswith(("buffer/bad_messages_", "buffer/rejected_")) and t != "buffer/rejected_total")
            steps = [int(x) for x in STEP.findall(log.read_text(errors="replace"))]
            return now if counted >= expected_buffer and max(steps) >= fuzzed_at_step + 3 else None

        # training goes on while everything is read and counted; then a clean stop
        after = wait_until(counted_and_stepping, 400, "the buffer counting every message, and 3 more learner steps",
                           interval=2.0)
        assert proc.poll() is None, "a process of the run died: " + log.read_text(errors="replace")[-5000:]
    finally:
        for s in sockets:
            s.close(linger=0)
        ctx.term()
        stop_process(proc)

    def delta(tag: str) -> float:
        return after.get(tag, 0.0) - before.get(tag, 0.0)

    # the buffer: every intake message read, and each one classified
    assert delta("buffer/messages_read_intake") >= PER_SOCKET  # the actor's real trajectories come on top
    bad_intake = delta("buffer/bad_messages_intake_malformed") + delta("buffer/bad_messages_intake_other_run")
    rejected = sum(delta(t) for t in after if t.startswith("buffer/rejected_") and t != "buffer/rejected_total")
    assert bad_intake == sent["intake_junk"], (bad_intake, sent)
    assert rejected == sent["intake_inconsistent"], (rejected, sent)
    assert (delta("buffer/messages_read_intake") == bad_intake + rejected + delta("buffer/acks_accepted")
            + delta("buffer/acks_duplicate") + delta("buffer/early_held"))
    bad_requests = delta("buffer/bad_messages_request_malformed") + delta("buffer/bad_messages_request_other_run")
    assert bad_requests == PER_SOCKET
    # the coordinator: every bad report counted
    assert delta("coordinator/bad_messages") == PER_SOCKET
    print(f"fuzz: {total} messages; buffer counted {bad_intake:.0f} malformed and {rejected:.0f} rejected "
          f"trajectories and {bad_requests:.0f} bad requests; the coordinator {delta('coordinator/bad_messages'):.0f} "
          "bad reports; no process died, the learner kept stepping")
