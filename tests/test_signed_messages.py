"""The run's key never travels (protocol/codec.py): a keyed message goes with its MAC in place of the key, so a
reader of it — a subscriber of Control, or a process squatting a dead coordinator's port — cannot sign another;
and every receiver of Control takes only one signed with the run's key."""

from __future__ import annotations

import threading
import time

import msgspec
import pytest
import zmq

from horizonrl.buffer.server import BufferServer
from horizonrl.core.config import TrainConfig
from horizonrl.core.run_dirs import ensure_run_key
from horizonrl.core.runtime import StopFlag
from horizonrl.launcher import resolve_ports
from horizonrl.learner.channels import ControlWatch
from horizonrl.protocol import (Control, Heartbeat, LearnerReport, ProcessEvent, Registration, WeightJoin, decode,
                                encode, signed_by)

RUN_ID = "signed"
KEY = "00112233445566778899aabbccddeeff"


@pytest.mark.parametrize("message", [
    LearnerReport(run_id=RUN_ID, step=3, weight_version=3, metrics={"loss/policy": float("nan")}, final=True, key=KEY),
    Control(run_id=RUN_ID, learner_step=1, max_turns=2, weight_version=1, end_training=True, key=KEY),
    Heartbeat(run_id=RUN_ID, role="buffer", index=0, pid=5, counters={"ready_groups": 3.0}, key=KEY),
    Registration(run_id=RUN_ID, name="buffer", pid=5, endpoints={"batches": "tcp://127.0.0.1:9"}, key=KEY),
    ProcessEvent(run_id=RUN_ID, name="actor-0", role="actor", event="died", key=KEY),
    WeightJoin(run_id=RUN_ID, actor=0, pid=5, key=KEY),
])
def test_a_keyed_message_carries_its_mac_never_the_key_and_no_field_can_change_under_it(message):
    data = encode(message)
    assert KEY.encode() not in data
    received = decode(data)
    assert received.key.startswith("mac:") and signed_by(received, KEY)
    assert not signed_by(received, "ff" * 16)  # another run's key
    assert not signed_by(msgspec.structs.replace(received, run_id=RUN_ID + "x"), KEY)  # a field changed under it
    assert encode(received) == data  # a signed message passes on as it is
    assert signed_by(msgspec.structs.replace(received, key=""), "")  # a run without a key checks nothing


@pytest.fixture
def config(tmp_path) -> TrainConfig:
    ensure_run_key(tmp_path)
    return resolve_ports(TrainConfig.model_validate({
        "run": {"output_dir": str(tmp_path), "run_id": RUN_ID}, "model": {"path": "unused", "vocab_size": 128},
        "envs": [{"name": "signpost"}], "network": {"host": "127.0.0.1"},
        "learner": {"total_steps": 10, "groups_per_step": 1}, "buffer": {"capacity_groups": 4}}))


def publish_until(pub: zmq.Socket, messages: list[bytes], done, timeout_s: float = 10) -> None:
    """PUB has no handshake: publish again until the subscriber has seen what it needed."""
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        for data in messages:
            pub.send(data)
        time.sleep(0.05)


def test_the_buffer_takes_only_the_coordinators_signed_control(config):
    from horizonrl.core.run_dirs import read_run_key

    key = read_run_key(config.output_dir)
    context = zmq.Context()
    pub = context.socket(zmq.PUB)
    pub.bind(config.network.endpoint(config.network.control_port))  # where a squatter would stand
    server = BufferServer(config, StopFlag())
    forged = encode(Control(run_id=RUN_ID, learner_step=9, max_turns=2, weight_version=9))
    signed = encode(Control(run_id=RUN_ID, learner_step=2, max_turns=2, weight_version=2, key=key))
    try:
        def heard() -> bool:
            server._read_control()
            return server.bad_messages["control_unauthenticated"] > 0 and 0 in server._known

        publish_until(pub, [forged, signed], heard)
        assert heard() and server._known == {0: 2}  # the forged version 9 was never heard
    finally:
        server.close()
        pub.close(linger=0)
        context.term()


def test_the_learners_control_watch_ignores_a_forged_end_of_training(config):
    from horizonrl.core.run_dirs import read_run_key

    key = read_run_key(config.output_dir)
    context = zmq.Context()
    pub = context.socket(zmq.PUB)
    endpoint = config.network.endpoint(config.network.control_port)
    pub.bind(endpoint)
    end_training = threading.Event()
    watch = ControlWatch(context, endpoint, RUN_ID, end_training, key=key)
    watch.start()
    try:
        forged = encode(Control(run_id=RUN_ID, learner_step=1, max_turns=2, weight_version=1, end_training=True,
                                endpoints={"batches": "tcp://127.0.0.1:1"}))
        signed = encode(Control(run_id=RUN_ID, learner_step=1, max_turns=2, weight_version=1,
                                endpoints={"batches": "tcp://127.0.0.1:2"}, key=key))
        publish_until(pub, [forged, signed], lambda: bool(watch.endpoints))
        publish_until(pub, [forged], lambda: False, timeout_s=0.5)
        assert watch.endpoints == {"batches": "tcp://127.0.0.1:2"} and not end_training.is_set()
    finally:
        watch.stop()
        pub.close(linger=0)
        context.term()


def test_a_message_built_with_ints_where_floats_are_typed_is_signed_as_it_is_received():
    beat = Heartbeat(run_id=RUN_ID, role="actor", index=0, pid=5, counters={"episodes": 3}, key=KEY)  # 3, not 3.0
    assert signed_by(decode(encode(beat)), KEY)


def test_a_colocated_engines_signed_registration_of_its_pid_is_a_registration_the_coordinator_takes():
    from horizonrl.protocol.report_checks import RunShape, report_problem
    from horizonrl.protocol.registry import registration

    shape = RunShape(num_actors=1, learner_ranks=1, env_names=frozenset({"signpost"}), total_steps=10, max_turns=4,
                     env_servers=1)
    message = decode(registration(RUN_ID, "actor-0", {"colocated_engine": "4242"}, KEY))
    assert signed_by(message, KEY) and report_problem(message, shape) is None
    assert report_problem(msgspec.structs.replace(message, endpoints={"colocated_engine": "x"}), shape)[0] == \
        "bad_value"
