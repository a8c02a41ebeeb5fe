"""A coordinator restart nobody can pre-empt (coordinator/process.py, protocol/transport.py): the local launcher
holds the coordinator's two listening sockets for the whole run and hands them to every incarnation, so no other
process can bind the ports meanwhile; where no launcher holds them, a taken port is tried again with back-off
inside the process, not by spending restarts; and the learner sends its newest report again until the
coordinator's Control shows it (a coordinator restored from an older state catches up)."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import zmq

from horizonrl.coordinator import Coordinator
from horizonrl.coordinator.process import bind_coordinator_port
from horizonrl.core.config import TrainConfig
from horizonrl.core.run_dirs import ensure_run_key, read_run_key
from horizonrl.core.run_events import read_events
from horizonrl.core.runtime import StopFlag
from horizonrl.launcher import resolve_ports
from horizonrl.learner import channels
from horizonrl.learner.channels import ReportSender
from horizonrl.protocol import Control, LearnerReport, decode, encode
from horizonrl.protocol.transport import held_ports_env, hold_port

RUN_ID = "ports"

INCARNATION = """
import sys, zmq
from horizonrl.protocol.transport import bind_held
port = int(sys.argv[1])
context = zmq.Context()
pull = context.socket(zmq.PULL)
print("held" if bind_held(pull, f"tcp://127.0.0.1:{port}", port) else "plain", flush=True)
print(pull.recv().decode() if pull.poll(20000) else "nothing", flush=True)
pull.close(0)
context.term()
"""


def test_every_coordinator_incarnation_binds_the_port_the_launcher_holds_and_no_one_else_can(tmp_path):
    held = hold_port("127.0.0.1", 0)
    port = held.getsockname()[1]
    context = zmq.Context()
    push = context.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")  # a client, connected before any coordinator runs
    try:
        for n in range(2):  # the first coordinator, then its restart
            squatter = socket.socket()
            with pytest.raises(OSError) as taken:
                squatter.bind(("127.0.0.1", port))  # between incarnations too
            squatter.close()
            assert taken.value.errno == errno.EADDRINUSE
            child = subprocess.Popen([sys.executable, "-c", INCARNATION, str(port)], stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, **held_ports_env({port: held})}, pass_fds=(held.fileno(),))
            assert child.stdout.readline().strip() == "held"
            push.send(f"report {n}".encode())
            assert child.stdout.readline().strip() == f"report {n}"  # what the client sent reached this one
            assert child.wait(20) == 0
    finally:
        push.close(0)
        context.term()
        held.close()


@pytest.fixture
def config(tmp_path) -> TrainConfig:
    ensure_run_key(tmp_path)
    return resolve_ports(TrainConfig.model_validate({
        "run": {"output_dir": str(tmp_path), "run_id": RUN_ID}, "model": {"path": "unused"},
        "envs": [{"name": "signpost"}], "network": {"host": "127.0.0.1"}, "learner": {"total_steps": 20}}))


def test_a_port_held_by_another_process_is_tried_again_in_the_process_not_by_restarting_it(config):
    from horizonrl.core.run_events import EventLog

    port = config.network.report_port
    squatter = socket.socket()
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    squatter.bind(("127.0.0.1", port))
    squatter.listen(1)
    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    threading.Timer(1.5, squatter.close).start()  # the squatter leaves
    start = time.monotonic()
    try:
        bind_coordinator_port(pull, f"tcp://127.0.0.1:{port}", port, StopFlag(), EventLog(config.output_dir,
                                                                                          "coordinator"), limit_s=30)
        assert 1.0 < time.monotonic() - start < 15
    finally:
        pull.close(0)
    blocked = socket.socket()
    blocked.bind(("127.0.0.1", 0))
    blocked.listen(1)
    other = context.socket(zmq.PULL)
    try:
        with pytest.raises(RuntimeError, match="still taken"):
            bind_coordinator_port(other, f"tcp://127.0.0.1:{blocked.getsockname()[1]}", blocked.getsockname()[1],
                                  StopFlag(), EventLog(config.output_dir, "coordinator"), limit_s=1.0)
    finally:
        other.close(0)
        blocked.close()
        context.term()
    assert len(read_events(config.output_dir, "port_taken")) == 2


def test_the_learner_sends_its_newest_report_again_until_the_coordinators_control_shows_it(config, monkeypatch):
    monkeypatch.setattr(channels, "REPORT_ACK_WAIT_S", 0.0)
    key = read_run_key(config.output_dir)
    coordinator = Coordinator(config, StopFlag())  # restored from a state of step 10, say: the learner is at 13
    context = zmq.Context()
    sender = ReportSender(context, config.network.endpoint(config.network.report_port), key=key)
    try:
        for step in (10, 11, 12, 13):
            sender.send(LearnerReport(run_id=RUN_ID, step=step, weight_version=step, metrics={"loss/policy": 0.1}))
        coordinator.progress.learner_step = coordinator.progress.weight_version = 10  # the reports went to no one
        control = decode(encode(coordinator.control()))
        assert isinstance(control, Control) and control.learner_step == 10
        resend = sender.unacknowledged(control)
        assert resend is not None
        coordinator.take(resend)  # as the heartbeat thread sends it
        assert coordinator.learner_step == 13 and coordinator.control().weight_version == 13
        assert sender.unacknowledged(decode(encode(coordinator.control()))) is None  # acknowledged: no more resends
        assert sender.resent == 1 and not coordinator.intake.rejected
    finally:
        sender.socket.close(0)
        context.term()
        coordinator.close()
