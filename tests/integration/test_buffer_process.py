"""The buffer as a real process behind real ZMQ sockets, fed bad input among good."""

import time

import msgspec
import pytest
import zmq
from helpers import horizonrl_cmd, make_trajectory, start_process, stop_process, wait_until

from horizonrl.config import load_config
from horizonrl.launcher import prepare_run
from horizonrl.protocol import Batch, BatchRequest, Heartbeat, decode, decode_as, encode

pytestmark = pytest.mark.slow


def test_bad_messages_are_counted_and_nothing_stored_is_lost(tmp_path):
    config, path = prepare_run(load_config(None, ["model.path=/unused", "envs=[{name: signpost}]",
                                                  f"run.output_dir={tmp_path}", "buffer.max_staleness=10"]))
    net = config.network
    ctx = zmq.Context()
    reports = ctx.socket(zmq.PULL)
    reports.bind(net.endpoint(net.report_port))
    proc = start_process(horizonrl_cmd("buffer", "--config", str(path)), tmp_path / "buffer.log")
    push = ctx.socket(zmq.PUSH)
    push.connect(net.endpoint(net.trajectory_port))
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(net.endpoint(net.batch_port))
    try:
        good = [make_trajectory("g1", i, reward=float(i % 2)) for i in range(4)]
        push.send(encode(good[0]))
        push.send(encode(good[1]))
        push.send(b"\x00garbage")  # malformed
        push.send(msgspec.msgpack.encode({"type": "trajectory", "v": 999, "x": 1}))  # wrong version
        push.send(b"\x91" + b"\x00" * (65 * 1024 * 1024))  # oversized (limit 64 MiB)
        push.send(encode(BatchRequest(request_id=0, learner_version=0, num_groups=1)))  # wrong type here
        push.send(encode(good[2]))
        push.send(encode(good[3]))
        dealer.send(b"not a request")  # malformed request on the batch socket
        dealer.send(encode(BatchRequest(request_id=7, learner_version=0, num_groups=1)))
        assert dealer.poll(60_000), "no batch within 60 s"
        batch = decode_as(dealer.recv(), Batch)
        assert batch.request_id == 7
        assert batch.groups == [good]  # the stored group survived the bad input, intact

        def counters():
            while reports.poll(100):
                msg = decode(reports.recv())
                if isinstance(msg, Heartbeat) and msg.counters.get("bad_messages", 0) >= 5:
                    return msg.counters
            return None

        stats = wait_until(counters, 30, "a heartbeat counting the bad messages")
        assert stats["bad_messages"] == 5 and stats["received"] == 4 and stats["served_groups"] == 1
        assert proc.poll() is None  # still alive
    finally:
        rc = stop_process(proc)
        for s in (push, dealer, reports):
            s.close(linger=0)
        ctx.term()
    assert rc == 0, (tmp_path / "buffer.log").read_text()[-3000:]
    assert "rejected malformed message" in (tmp_path / "buffer.log").read_text()
