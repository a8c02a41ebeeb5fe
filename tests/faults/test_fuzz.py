"""Over 10,000 malformed, inconsistent or hostile messages to every listening socket: no process dies, and
every message is counted once, by kind.

The kinds (horizonrl/apps/hostile.py): random bytes, truncated msgpack, the wrong shape, a lying length, another
run's messages, a kind the socket does not take, invalid UTF-8 in every string of every kind, reports that
are well-formed and wrong (unknown processes and environments, NaN, steps past the run, a final report or a
supervision event without the run's key), trajectories that are inconsistent, longer than the run's
context, or from weights past the run's last step, and bad batch requests.

Two tests. The first drives the coordinator and the buffer in-process through their real sockets — fast,
and exact: every message lands in the counter of what it is. The second sends the same kinds to a running
training (whole processes: launcher, coordinator, buffer, learner, an actor with its engine) and checks
that nothing dies, the learner keeps stepping, and the counts add up; then kills the launcher alone, and
every process it started stops itself.

Messages over a socket's size limit (ZMQ MAXMSGSIZE) are refused by the transport — the connection is
dropped before the message is read — so they are sent separately and only survival is checked for them;
a trajectory over the run's context but under that limit reaches the door, and is counted there.
"""

from __future__ import annotations

import glob
import os
import random
import signal
import socket
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest
import zmq
from helpers import (horizonrl_cmd, newest_step, run_events, start_process, still_running, stop_process,
                     wait_for_step, wait_until)

from horizonrl.buffer.accounting import account
from horizonrl.buffer.server import BufferServer
from horizonrl.coordinator import Coordinator
from horizonrl.core.config import TrainConfig, load_config
from horizonrl.core.run_dirs import ensure_run_key
from horizonrl.core.run_events import RunEvent
from horizonrl.core.runtime import StopFlag
from horizonrl.apps.hostile import flipped, intake_storm, report_storm, request_storm
from horizonrl.launcher import resolve_ports

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "signpost_test.yaml"
RUN_ID = "fuzz"
RAW_TCP = 200  # connections with random bytes to each TCPStore (whole-run test)


class InProcessRun:
    """A coordinator and a buffer of one config, in this process, with client sockets to their listening ones."""

    def __init__(self, tmp_path: Path) -> None:
        ensure_run_key(tmp_path)
        self.config = resolve_ports(TrainConfig.model_validate({
            "run": {"output_dir": str(tmp_path), "run_id": RUN_ID}, "model": {"path": "unused", "vocab_size": 128},
            "envs": [{"name": "signpost"}], "network": {"host": "127.0.0.1"},
            "rollout": {"num_actors": 2, "n": 2, "max_context_tokens": 64, "max_tokens_per_turn": 8},
            "learner": {"total_steps": 20, "groups_per_step": 1}, "buffer": {"capacity_groups": 1024}}))
        self.coordinator = Coordinator(self.config, StopFlag())
        self.buffer = BufferServer(self.config, StopFlag())
        self.ctx = zmq.Context()
        net = self.config.network
        self.sockets = {name: self._connect(kind, port) for name, kind, port in (
            ("report", zmq.PUSH, net.report_port), ("intake", zmq.DEALER, net.trajectory_port),
            ("requests", zmq.DEALER, net.batch_port))}
        # The buffer registered its endpoints with the coordinator as it started: that one is the run's own.
        self.serve_until(lambda: self.coordinator.accepted["registration"] == 1)
        self.coordinator.accepted.clear()
        self.coordinator.messages_read = 0

    def _connect(self, kind: int, port: int) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.config.network.endpoint(port))
        return sock

    def serve(self) -> None:
        """What the two processes' loops do with what came in, once."""
        self.coordinator._read_reports()
        self.buffer._drain_trajectories()
        while self.buffer.router.poll(0):
            self.buffer._read_request()
        self.buffer._flush()

    def send(self, where: str, data: bytes) -> None:
        while True:
            try:
                self.sockets[where].send(data, zmq.NOBLOCK)
                return
            except zmq.Again:  # the receiver's queue is full: let it read, as its process would meanwhile
                self.serve()

    def serve_until(self, done, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            assert time.monotonic() < deadline, "the receivers did not read every message"
            self.serve()
            time.sleep(0.01)

    def close(self) -> None:
        for sock in self.sockets.values():
            sock.close()
        self.ctx.term()
        self.coordinator.close()
        self.buffer.close()


def outcomes_of_coordinator(c: Coordinator) -> Counter:
    out = Counter({f"bad:{k}": v for k, v in c.bad_messages.items()})
    out.update({f"rejected:{k}": v for k, v in c.rejected.items()})
    out.update({f"accepted:{k}": v for k, v in c.accepted.items()})
    return +out


def outcomes_of_buffer(b: BufferServer) -> Counter:
    out = Counter({f"bad:{k}": v for k, v in b.bad_messages.items()})
    out.update({f"rejected:{k}": v for k, v in b.groups.rejected.items()})
    out["accepted"] = b.acks["accepted"]
    return +out


def test_ten_thousand_hostile_messages_in_process_each_counted_by_kind_and_nothing_dies(tmp_path):
    rng = random.Random(43)
    run = InProcessRun(tmp_path)
    try:
        storms = {"report": report_storm(rng, RUN_ID, run.coordinator.run_key, 4400, total_steps=20, num_actors=2,
                                         real_run=False),
                  "intake": intake_storm(rng, RUN_ID, 3600, context_tokens=64, real_run=False),
                  "requests": request_storm(rng, RUN_ID, run.coordinator.run_key, 2100, total_steps=20)}
        assert sum(map(len, storms.values())) >= 10_000
        start = time.monotonic()
        for i in range(max(map(len, storms.values()))):
            for where, messages in storms.items():
                if i < len(messages):
                    run.send(where, messages[i][0])
        run.serve_until(lambda: run.coordinator.messages_read == len(storms["report"])
                        and run.buffer.messages_read["intake"] == len(storms["intake"])
                        and run.buffer.messages_read["requests"] == len(storms["requests"]))
        took = time.monotonic() - start
        # Every message in the counter of what it is: by kind and reason, exactly.
        assert outcomes_of_coordinator(run.coordinator) == Counter(outcome for _, outcome in storms["report"])
        assert outcomes_of_buffer(run.buffer) == Counter(o for _, o in storms["intake"] + storms["requests"])
        assert run.coordinator.learner_step == 0 and not run.coordinator.finished  # no forged report got in
        assert run.coordinator.endpoints == run.buffer.endpoints  # nor a forged registration

        # Randomly corrupted copies of everything above: whatever each becomes, it is counted once, and nothing dies.
        # (not the requests: a corrupted one may become a valid request, which no counter counts)
        corrupted = {where: [flipped(rng, data) for data, _ in storms[where][:400] if data]
                     for where in ("report", "intake")}
        for where, messages in corrupted.items():
            for data in messages:
                run.send(where, data)
        run.serve_until(lambda: run.coordinator.messages_read == len(storms["report"]) + len(corrupted["report"])
                        and run.buffer.messages_read["intake"] == len(storms["intake"]) + len(corrupted["intake"]))
        assert sum(outcomes_of_coordinator(run.coordinator).values()) == run.coordinator.messages_read
        counted = outcomes_of_buffer(run.buffer)
        counted["duplicate"] = run.buffer.acks["duplicate"]
        assert sum(counted.values()) + len(run.buffer._early) == (run.buffer.messages_read["intake"]
                                                                  + run.buffer.messages_read["requests"])
        rejected = dict(run.buffer.groups.rejected)
        run.buffer._flush()
    finally:
        run.close()
    # The buffer's log holds every refusal: the accounting lists them as the buffer counted them.
    assert account(tmp_path)["rejected_at_the_door"] == rejected
    total = sum(map(len, storms.values())) + sum(map(len, corrupted.values()))
    print(f"fuzz in-process: {total} messages in {took:.1f} s (the first {sum(map(len, storms.values()))}); "
          f"coordinator {dict(outcomes_of_coordinator(run.coordinator))}; buffer refusals {rejected}")


def latest_scalars(run_dir: Path) -> dict[str, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(glob.glob(str(run_dir / "tensorboard" / "events.*"))[0])
    acc.Reload()
    return {tag: acc.Scalars(tag)[-1].value for tag in acc.Tags()["scalars"]}


@pytest.mark.slow
def test_malformed_messages_to_every_socket_of_a_run_are_counted_and_the_run_ends_with_its_launcher(tiny_model,
                                                                                                  tmp_path):
    run_dir = tmp_path / "run"
    log = tmp_path / "run.log"
    proc = start_process(horizonrl_cmd("train", str(CONFIG), f"model.path={tiny_model}", f"run.output_dir={run_dir}",
                                       "rollout.num_actors=1", "rollout.n=4", "learner.groups_per_step=2",
                                       "buffer.capacity_groups=64", "learner.total_steps=200"), log)
    rng = random.Random(1234)
    ctx = zmq.Context()
    sockets = []
    try:
        wait_for_step(run_dir, 2, 400)
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

        storms = {"report": report_storm(rng, run_id, (run_dir / "run_key").read_text().strip(), 3600,
                                         total_steps=config.learner.total_steps, num_actors=1, real_run=True),
                  "intake": intake_storm(rng, run_id, 3400, context_tokens=config.rollout.max_context_tokens,
                                         real_run=True),
                  "requests": request_storm(rng, run_id, (run_dir / "run_key").read_text().strip(), 3000,
                                            total_steps=config.learner.total_steps)}
        for where, sock in (("report", connect(zmq.PUSH, net.report_port)),
                            ("intake", connect(zmq.DEALER, net.trajectory_port)),
                            ("requests", connect(zmq.DEALER, net.batch_port))):
            for data, _ in storms[where]:
                sock.send(data)
        for port in (net.weight_port, net.dist_port):  # the torch TCPStores
            for _ in range(RAW_TCP):
                with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
                    raw.sendall(rng.randbytes(rng.randint(1, 512)))
        oversized = connect(zmq.DEALER, net.trajectory_port)
        oversized.send(b"\x00" * (65 * 1024 * 1024))  # over the intake's MAXMSGSIZE
        total = sum(map(len, storms.values())) + 2 * RAW_TCP
        assert total >= 10_000
        fuzzed_at_step = newest_step(run_dir)
        expected_buffer = len(storms["intake"]) + len(storms["requests"])

        def counted_and_stepping():
            now = latest_scalars(run_dir)
            counted = sum(now.get(t, 0.0) - before.get(t, 0.0) for t in now
                          if t.startswith(("buffer/bad_messages_", "buffer/rejected_")) and t != "buffer/rejected_total")
            reports = sum(now.get(t, 0.0) - before.get(t, 0.0) for t in ("coordinator/bad_messages",
                                                                          "coordinator/rejected"))
            return now if counted >= expected_buffer and reports >= len(storms["report"]) and \
                newest_step(run_dir) >= fuzzed_at_step + 3 else None

        # training goes on while everything is read and counted; then its launcher dies
        after = wait_until(counted_and_stepping, 400, "every message counted, and 3 more learner steps", interval=2.0)
        assert proc.poll() is None, "a process of the run died: " + log.read_text(errors="replace")[-5000:]

        # Then the launcher dies, alone (SIGKILL to its pid, not its group): it stops nobody. Every process it
        # started sits in a group of its own, and must notice and stop itself, its engine included (this test
        # once left the buffer and the actor running for 12 minutes after a killed launcher).
        started = psutil.Process(proc.pid).children(recursive=True)
        killed_at = time.time()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        wait_until(lambda: not any(still_running(p) for p in started), 240,
                   "every process of the run to stop after its launcher was killed", interval=0.5)
        stopped_at = time.time()
    finally:
        for s in sockets:
            s.close(linger=0)
        ctx.term()
        stop_process(proc)

    def delta(tag: str) -> float:
        return after.get(tag, 0.0) - before.get(tag, 0.0)

    # the buffer: every intake message read, and each one classified by kind
    expected = Counter(outcome for _, outcome in storms["intake"] + storms["requests"])
    for outcome, count in expected.items():
        verdict, name = outcome.split(":")
        assert delta(f"buffer/{'bad_messages' if verdict == 'bad' else 'rejected'}_{name}") == count, outcome
    assert (delta("buffer/messages_read_intake") == sum(delta(t) for t in after if t.startswith(
        ("buffer/bad_messages_intake", "buffer/rejected_")) and t != "buffer/rejected_total")
        + delta("buffer/acks_accepted") + delta("buffer/acks_duplicate") + delta("buffer/early_held"))
    # the coordinator: every storm report counted by kind, and not one message of the run's own processes refused
    for outcome, count in Counter(o for _, o in storms["report"]).items():
        verdict, name = outcome.split(":")
        assert delta(f"coordinator/{'bad_messages' if verdict == 'bad' else 'rejected'}_{name}") == count, outcome
    # each of the run's processes said why it stopped; the learner finished with a checkpoint
    roles = {e["role"] for e in run_events(run_dir, RunEvent.LAUNCHER_GONE, since=killed_at)}
    assert roles == {"coordinator", "buffer", "learner-0", "actor-0"}, roles
    assert run_events(run_dir, RunEvent.LEARNER_DONE, since=killed_at)
    print(f"fuzz: {total} messages; the buffer counted {expected_buffer:.0f} bad or refused, the coordinator "
          f"{len(storms['report'])} by kind; no process died, the learner kept stepping; "
          f"the launcher killed, its processes were gone {stopped_at - killed_at:.0f} s later")
