"""The faults ``horizonrl chaos`` fires (chaos_faults.py), each against stand-ins in this process tree: a
killed coordinator, a frozen and continued engine, a storm the run's processes count message for message,
a disk filled and freed (and refused where it would fill a big disk). The whole-run faults themselves are in
tests/faults/."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time

import psutil
import pytest
from helpers import ManualClock

from horizonrl.buffer.server import BufferServer
from horizonrl.apps.chaos_faults import ENGINE_NAME, FILL_FILE, FillDisk, FreezeEngine, KillProcess, MessageStorm
from horizonrl.coordinator import Coordinator
from horizonrl.core.config import TrainConfig, dump_config
from horizonrl.core.run_dirs import ensure_run_key
from horizonrl.core.runtime import StopFlag
from horizonrl.launcher import resolve_ports

ENGINE = (f"import ctypes, time; ctypes.CDLL(None).prctl(15, b'{ENGINE_NAME}', 0, 0, 0); print('up', flush=True); "
          "time.sleep(120)")
ACTOR = ("import subprocess, sys, time; engine = subprocess.Popen([sys.executable, '-c', sys.argv[1]]); "
         "time.sleep(120)")


@pytest.fixture
def stand_ins():
    started = []

    def start(*args):
        proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.DEVNULL)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        for child in psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []:
            child.kill()
        proc.kill()
        proc.wait()


def stopped(proc: psutil.Process, wait_for: bool = True) -> bool:
    """Whether ``proc`` is stopped, once a signal sent to it has had time to land (either way)."""
    deadline = time.monotonic() + 10
    while (proc.status() == psutil.STATUS_STOPPED) != wait_for and time.monotonic() < deadline:
        time.sleep(0.05)
    return proc.status() == psutil.STATUS_STOPPED


def test_kill_finds_the_coordinator_by_its_command_line(stand_ins):
    coordinator = stand_ins("-c", "import time; time.sleep(120)", "horizonrl", "coordinator", "--config", "x.yaml")
    stand_ins("-c", "import time; time.sleep(120)", "horizonrl", "buffer", "--config", "x.yaml")
    outcome = KillProcess("coordinator").fire(os.getpid(), random.Random(0))
    assert outcome["pid"] == coordinator.pid and coordinator.wait(timeout=10) == -9


def test_an_engine_is_frozen_then_continued_when_its_time_is_up(stand_ins):
    actor = stand_ins("-c", ACTOR, ENGINE, "horizonrl", "actor", "--config", "x.yaml")
    deadline = time.monotonic() + 60
    while not [p for p in psutil.Process(actor.pid).children() if p.name().startswith(ENGINE_NAME)]:
        assert time.monotonic() < deadline, "the stand-in engine did not start"
        time.sleep(0.1)
    clock = ManualClock()
    freeze = FreezeEngine(30, clock=clock)
    outcome = freeze.fire(os.getpid(), random.Random(0))
    engine = psutil.Process(outcome["pid"])
    assert engine.ppid() == actor.pid and stopped(engine)
    clock.now = 29
    freeze.tick()
    assert stopped(engine)
    clock.now = 30
    freeze.tick()
    assert not stopped(engine, wait_for=False) and not freeze.frozen


def test_a_disk_is_filled_then_freed_and_a_big_one_is_refused(tmp_path, monkeypatch):
    clock = ManualClock()
    fill = FillDisk(5, tmp_path, max_bytes=8 * 2**20, clock=clock)
    with pytest.raises(ValueError, match="put run.output_dir on a small file system"):
        fill.check()  # this machine's disk has far more than 8 MiB free
    monkeypatch.setattr(FillDisk, "free_bytes", lambda self: 4 * 2**20)  # as if it were a small file system
    fill.fire(0, random.Random(0))
    assert (tmp_path / FILL_FILE).stat().st_size == 8 * 2**20  # all it may write (a small disk fails first)
    clock.now = 5
    fill.tick()
    assert not (tmp_path / FILL_FILE).exists()


def test_a_storm_is_counted_by_the_runs_processes_message_for_message(tmp_path):
    ensure_run_key(tmp_path)
    config = resolve_ports(TrainConfig.model_validate({
        "run": {"output_dir": str(tmp_path), "run_id": "storm"}, "model": {"path": "unused", "vocab_size": 128},
        "envs": [{"name": "signpost"}], "network": {"host": "127.0.0.1"},
        "rollout": {"num_actors": 1, "n": 2, "max_context_tokens": 64, "max_tokens_per_turn": 8},
        "learner": {"total_steps": 20, "groups_per_step": 1}}))
    (tmp_path / "config.yaml").write_text(dump_config(config))
    coordinator, buffer = Coordinator(config, StopFlag()), BufferServer(config, StopFlag())
    try:
        storm = MessageStorm(120, tmp_path)
        storm.fire(0, random.Random(1))
        deadline = time.monotonic() + 60
        while coordinator.messages_read < 121 or sum(buffer.messages_read.values()) < 240:  # + the buffer's registration
            assert time.monotonic() < deadline, "the storm did not arrive"
            coordinator._read_reports()
            buffer._drain_trajectories()
            while buffer.router.poll(0):
                buffer._read_request()
            time.sleep(0.01)
        buffer._heartbeat()  # the buffer's counts reach the coordinator's state with its heartbeats
        while coordinator.accepted["heartbeat"] < 1:
            assert time.monotonic() < deadline, "no heartbeat"
            coordinator._read_reports()
        coordinator.save_state()
        counted = storm.counted()
    finally:
        coordinator.close()
        buffer.close()
    assert storm.sent == {"report": 120, "intake": 120, "requests": 120}
    assert counted["coordinator_bad"] + counted["coordinator_rejected"] == 120  # nothing of it was taken
    assert counted["buffer_bad"] + counted["buffer_rejected"] == 240 and coordinator.learner_step == 0


def _run_config(tmp_path, run_id: str) -> TrainConfig:
    ensure_run_key(tmp_path)
    config = resolve_ports(TrainConfig.model_validate({
        "run": {"output_dir": str(tmp_path), "run_id": run_id}, "model": {"path": "unused"},
        "envs": [{"name": "signpost"}], "network": {"host": "127.0.0.1"}, "learner": {"total_steps": 20}}))
    (tmp_path / "config.yaml").write_text(dump_config(config))
    return config


@pytest.mark.parametrize("held", [False, True])
def test_a_squatter_binds_a_killed_coordinators_ports_unless_the_launcher_holds_them(stand_ins, tmp_path, held):
    import zmq

    from horizonrl.apps.chaos_faults import SquatCoordinator
    from horizonrl.protocol import decode, signed_by
    from horizonrl.protocol.transport import hold_port

    config = _run_config(tmp_path, "squat")
    net = config.network
    holding = [hold_port("127.0.0.1", p) for p in (net.control_port, net.report_port)] if held else []
    stand_ins("-c", "import time; time.sleep(120)", "horizonrl", "coordinator", "--config", "x.yaml")
    squat = SquatCoordinator(30, tmp_path)
    context = zmq.Context()
    try:
        outcome = squat.fire(os.getpid(), random.Random(0))
        assert outcome["ports_squatted"] == (0 if held else 2)
        if held:
            return
        sub, push = context.socket(zmq.SUB), context.socket(zmq.PUSH)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(net.endpoint(net.control_port))
        push.connect(net.endpoint(net.report_port))
        push.send(b"a learner's report")
        deadline = time.monotonic() + 10
        while (squat.swallowed < 1 or not sub.poll(0)) and time.monotonic() < deadline:
            squat.tick()
            time.sleep(0.05)
        forged = decode(sub.recv())
        assert squat.swallowed == 1 and forged.end_training and not signed_by(forged, "0" * 32)
        sub.close(0)
        push.close(0)
    finally:
        squat.end()
        context.term()
        for sock in holding:
            sock.close()


def test_fake_joins_without_the_key_are_refused_by_the_hub_and_counted(tmp_path):
    import torch

    from horizonrl.apps.chaos_faults import FakeJoin
    from horizonrl.core.run_dirs import read_run_key
    from horizonrl.learner.weight_broadcast import WeightHub

    config = _run_config(tmp_path, "joins")
    hub = WeightHub("127.0.0.1", 0, backend="gloo", timeout_s=60, run_id="joins", run_key=read_run_key(tmp_path))
    hub.pack(0, [("w", torch.zeros(4))])
    hub.start()
    joins = FakeJoin(3, tmp_path)
    try:
        (tmp_path / "config.yaml").write_text(dump_config(config.model_copy(update={"network": config.network.model_copy(
            update={"weight_port": hub.port})})))
        assert "3 keyless joins" in joins.fire(os.getpid(), random.Random(0))["did"]
        deadline = time.monotonic() + 30
        while hub.counters["unauthenticated_joins"] < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert hub.counters["unauthenticated_joins"] == 3 and not hub.members
    finally:
        joins.end()
        hub.close()


def test_a_coordinator_out_of_restarts_counts_as_given_up_though_it_cannot_count_its_own_end(tmp_path):
    """The launcher's give-up is read from its own events: the coordinator, which writes faults.jsonl, is the one
    that died (the first 10-minute squat run ended at its 6th kill and the summary said 'gave up 0')."""
    from horizonrl.apps.chaos import summarize
    from horizonrl.core.run_events import EventLog, RunEvent

    EventLog(tmp_path, "launcher").emit(RunEvent.PROCESS_GAVE_UP, name="coordinator", exit_code=-9)
    summary = summarize(tmp_path, [], elapsed_s=10.0, rc=1, finished=True)
    assert summary["gave_up"] == 1 and not (tmp_path / "faults.jsonl").exists()
