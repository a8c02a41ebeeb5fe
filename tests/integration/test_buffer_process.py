"""The buffer as a real process behind real ZMQ sockets: what it acknowledges, rejects and counts, and
what it still holds after ``kill -9`` and a restart (its write-ahead log)."""

import json
import os
import signal
import time

import msgspec
import pytest
import zmq
from helpers import horizonrl_cmd, make_trajectory, run_events, start_process, stop_process, wait_until

from horizonrl.core.config import load_config
from horizonrl.core.run_dirs import read_run_key
from horizonrl.core.run_events import RunEvent
from horizonrl.launcher import prepare_run
from horizonrl.protocol import (
    ACK_ACCEPTED,
    ACK_DUPLICATE,
    ACK_REJECTED,
    Batch,
    BatchRequest,
    Control,
    EpisodeText,
    Heartbeat,
    TrajectoryAck,
    decode,
    decode_as,
    encode,
)

pytestmark = pytest.mark.slow


class Run:
    """A resolved config, the coordinator's two sockets (played by the test), and the buffer process."""

    def __init__(self, tmp_path, *overrides: str) -> None:
        self.tmp_path = tmp_path
        self.config, self.path = prepare_run(load_config(None, [
            "model.path=/unused", "envs=[{name: signpost}]", f"run.output_dir={tmp_path / 'run'}",
            "buffer.max_staleness=10", "buffer.future_hold_s=30", *overrides]))
        self.run_id = self.config.run.run_id
        net = self.config.network
        self.ctx = zmq.Context()
        self.reports = self.ctx.socket(zmq.PULL)
        self.reports.bind(net.endpoint(net.report_port))
        self.control = self.ctx.socket(zmq.PUB)
        self.control.bind(net.endpoint(net.control_port))
        self.proc = None
        self.sockets = [self.reports, self.control]

    def start_buffer(self, log_name="buffer.log"):
        self.proc = start_process(horizonrl_cmd("buffer", "--config", str(self.path)), self.tmp_path / log_name)
        return self.proc

    def socket(self, kind, port):
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.config.network.endpoint(port))
        self.sockets.append(sock)
        return sock

    def trajectory(self, group, index, **kw):
        return make_trajectory(group, index, run_id=self.run_id, **kw)

    def publish(self, weight_version, weight_epoch=0):
        # signed with the run's key, as the coordinator's is: the buffer ignores any other Control
        self.control.send(encode(Control(run_id=self.run_id, learner_step=weight_version, max_turns=6,
                                         weight_version=weight_version, weight_epoch=weight_epoch,
                                         key=read_run_key(self.config.output_dir))))

    def counters(self, predicate, timeout=30):
        def latest():
            found = None
            while self.reports.poll(100):
                message = decode(self.reports.recv())
                if isinstance(message, Heartbeat):
                    found = message.counters
            return found if found is not None and predicate(found) else None
        return wait_until(latest, timeout, "buffer counters")

    def close(self):
        for sock in self.sockets:
            sock.close(linger=0)
        self.ctx.term()


def acks(dealer, count, timeout_s=30):
    """The next ``count`` acknowledgements, in order: [(trajectory id, status, reason)]."""
    got = []
    deadline = time.monotonic() + timeout_s
    while len(got) < count:
        assert dealer.poll(max(1, int((deadline - time.monotonic()) * 1000))), f"acks so far: {got}"
        ack = decode_as(dealer.recv(), TrajectoryAck)
        got += list(zip(ack.trajectory_ids, ack.statuses, ack.reasons))
    return got


def request(dealer, run, request_id, learner_version, num_groups, timeout_s=60):
    """As the learner asks: with the run's key (the buffer takes no request without it)."""
    dealer.send(encode(BatchRequest(run_id=run.run_id, request_id=request_id, learner_version=learner_version,
                                    num_groups=num_groups, key=read_run_key(run.config.output_dir))))
    assert dealer.poll(timeout_s * 1000), f"no batch within {timeout_s} s"
    return decode_as(dealer.recv(), Batch)


def test_every_message_is_acknowledged_rejected_or_counted(tmp_path):
    run = Run(tmp_path)
    net = run.config.network
    proc = run.start_buffer()
    actor = run.socket(zmq.DEALER, net.trajectory_port)
    learner = run.socket(zmq.DEALER, net.batch_port)
    try:
        good = [run.trajectory("g1", i, reward=float(i % 2)) for i in range(4)]
        good[0] = msgspec.structs.replace(good[0], text=EpisodeText(  # sampled for recording (and resent below)
            first_observation="You see a sign.", replies=["Action: left"], actions=["left"], observations=["Done."]))
        for t in good[:2]:
            actor.send(encode(t))
        actor.send(b"\x00garbage")  # malformed
        actor.send(msgspec.msgpack.encode({"type": "trajectory", "v": 999, "x": 1}))  # wrong schema version
        actor.send(encode(make_trajectory("g9", 0, run_id="another-run")))  # another run's
        actor.send(encode(msgspec.structs.replace(run.trajectory("g2", 0), loss_mask=b"\x01")))  # inconsistent
        actor.send(encode(good[0]))  # a resend
        actor.send(encode(run.trajectory("g3", 0, group_size=2, version=3)))  # weights nobody announced yet
        assert acks(actor, 4) == [("g1-0", ACK_ACCEPTED, ""), ("g1-1", ACK_ACCEPTED, ""),
                                  ("g2-0", ACK_REJECTED, "array_lengths"), ("g1-0", ACK_DUPLICATE, "")]
        assert not actor.poll(1000)  # g3-0 waits: its weights were never announced
        run.publish(weight_version=3)  # the learner announced version 3: the held trajectory is let in
        assert acks(actor, 1) == [("g3-0", ACK_ACCEPTED, "")]
        for t in good[2:]:
            actor.send(encode(t))
        assert [i for i, _, _ in acks(actor, 2)] == ["g1-2", "g1-3"]
        oversized = run.socket(zmq.DEALER, net.trajectory_port)
        oversized.send(b"\x91" + b"\x00" * (65 * 1024 * 1024))  # over MAXMSGSIZE: dropped by the transport
        learner.send(b"not a request")  # malformed request on the batch socket
        batch = request(learner, run, 7, 0, 1)
        assert batch.request_id == 7 and batch.groups == [good]  # the stored group survived the bad input
        stats = run.counters(lambda c: c.get("bad_messages", 0) >= 4 and c.get("served_groups", 0) >= 1)
        assert stats["bad_messages_intake_malformed"] == 2 and stats["bad_messages_intake_other_run"] == 1
        assert stats["bad_messages_request_malformed"] == 1 and stats["rejected_array_lengths"] == 1
        assert stats["received"] == 5 and stats["acks_duplicate"] == 1 and stats["served_groups"] == 1
        assert proc.poll() is None  # still alive
    finally:
        rc = stop_process(proc)
        run.close()
    assert rc == 0, (tmp_path / "buffer.log").read_text()[-3000:]
    # The one trajectory that carried its text was recorded once (not again for its resend), and the
    # batch that held it was recorded as trained at step 1; read with the standard library only.
    lines = [json.loads(line) for f in sorted((tmp_path / "run" / "episodes").glob("episodes-*.jsonl"))
             for line in f.read_text().splitlines()]
    assert [(r["kind"], r.get("trajectory_id")) for r in lines] == [("episode", "g1-0"), ("trained", None)]
    assert lines[0]["turns"] == [{"reply": "Action: left", "action": "left", "observation": "Done.", "reward": 0.0,
                                  "version": 0, "epoch": 0, "sample": 0, "summary": False}]
    assert lines[1]["learner_step"] == 1 and lines[1]["group_ids"] == ["g1"]


def test_after_kill_9_the_buffer_holds_what_it_acknowledged(tmp_path):
    run = Run(tmp_path, "buffer.wal_fsync=batch")
    net = run.config.network
    run.start_buffer("first.log")
    actor = run.socket(zmq.DEALER, net.trajectory_port)
    learner = run.socket(zmq.DEALER, net.batch_port)
    groups = {g: [run.trajectory(g, i, reward=float(i), group_size=2) for i in range(2)] for g in ("a", "b")}
    partial = run.trajectory("c", 0, reward=1.0, group_size=2)
    for t in [*groups["a"], *groups["b"], partial]:
        actor.send(encode(t))
    assert all(status == ACK_ACCEPTED for _, status, _ in acks(actor, 5))
    served = request(learner, run, 1, 0, 1)  # batch 1 for step 1 ...
    assert served.groups == [groups["a"]]
    os.kill(run.proc.pid, signal.SIGKILL)  # ... and the buffer dies before the learner trains on it
    run.proc.wait(10)
    stop_process(run.proc)

    proc = run.start_buffer("second.log")
    try:
        # the learner, having no answer it could train, asks for step 1 again: batch 1 comes back
        learner2 = run.socket(zmq.DEALER, net.batch_port)
        again = request(learner2, run, 2, 0, 2)
        assert again.groups == [groups["a"], groups["b"]]
        actor.send(encode(groups["a"][0]))  # an actor resending what the first incarnation accepted
        actor.send(encode(run.trajectory("c", 1, reward=0.0, group_size=2)))  # completes "c"
        assert acks(actor, 2) == [("a-0", ACK_DUPLICATE, ""), ("c-1", ACK_ACCEPTED, "")]
        stats = run.counters(lambda c: c.get("received") == 6)
        assert stats["rolled_back_batches"] == 1 and stats["in_flight_trajectories"] == 4
        assert stats["held_trajectories"] == 2 and stats["recovered_records"] >= 6
    finally:
        rc = stop_process(proc)
        run.close()
    assert rc == 0, (tmp_path / "second.log").read_text()[-3000:]
    assert [e["records"] >= 6 for e in run_events(run.config.output_dir, RunEvent.BUFFER_RECOVERED)] == [True]
