"""A restarted coordinator continues where the one before it was: what nobody re-sends comes back from
``<output_dir>/coordinator_state.json`` (core/coordinator_state.py), the learner's end from its event
when its closing report went down with it, and a new launch starts clean. In-process, no run: the
whole-run kill -9 of the coordinator is in tests/faults/test_supervision.py."""

from __future__ import annotations

import json
import time

import pytest
import zmq

from horizonrl.coordinator import Coordinator
from horizonrl.core.config import TrainConfig
from horizonrl.core.coordinator_state import load_snapshot, state_path
from horizonrl.core.run_dirs import ensure_run_key
from horizonrl.core.run_events import EventLog, RunEvent, read_events
from horizonrl.core.runtime import StopFlag
from horizonrl.launcher import resolve_ports, start_launch
from horizonrl.protocol.counters import ActorCounters
from horizonrl.protocol import (EVENT_DIED, EVENT_RESTARTED, Control, Heartbeat, HeldOutEval, LearnerReport,
                                ProcessEvent, Registration, decode_as, encode)

RUN_ID = "restart"


@pytest.fixture
def config(tmp_path) -> TrainConfig:
    ensure_run_key(tmp_path)
    return resolve_ports(TrainConfig.model_validate({
        "run": {"output_dir": str(tmp_path), "run_id": RUN_ID}, "model": {"path": "unused"},
        "envs": [{"name": "signpost", "settings": {"length": 2}}], "network": {"host": "127.0.0.1"},
        "learner": {"total_steps": 10}, "eval": {"every": 2, "stop_after_plateau": 3},
        "algorithm": {"rounds_ctrl": {"type": "scaling_inter_stepwise", "rounds": [2, 4], "steps_scaling_inter": 3}}}))


def feed_a_run(c: Coordinator) -> None:
    key = c.run_key
    for message in [
        Registration(run_id=RUN_ID, name="learner-0", pid=50, key=key,
                     endpoints={"weights": "tcp://127.0.0.1:4000", "weights_epoch": "1"}),
        LearnerReport(run_id=RUN_ID, step=2, weight_version=2, weight_epoch=1, startup=True, key=key),
        Heartbeat(run_id=RUN_ID, role="actor", index=0, pid=60, counters={"episodes": 7.0, "episodes_in_progress": 2.0}),
        ProcessEvent(run_id=RUN_ID, name="actor-1", role="actor", event=EVENT_DIED, exit_code=-9, at=time.time(),
                     key=key),
        LearnerReport(run_id=RUN_ID, step=4, weight_version=4, weight_epoch=1, metrics={"loss/policy": 0.3}, key=key),
        HeldOutEval(run_id=RUN_ID, learner_step=4, weight_versions=(4, 4), wall_s=1.0, key=key,
                    results={"signpost": {"success_rate": 0.5, "episodes_valid": 8.0}}),
    ]:
        c.take(encode(message))
    c.take(b"\x00junk")


def test_a_restarted_coordinator_reads_back_what_nobody_resends(config):
    first = Coordinator.for_run(config, StopFlag())
    try:
        feed_a_run(first)
        first.save_state()  # as it does every STATE_SAVE_PERIOD_S (every change of its state is saved at once)
        before = (first.learner_step, first.progress.weight_version, first.progress.weight_epoch, first.progress.max_turns, dict(first.endpoints),
                  dict(first.ledger.faults), first.held_out.eval_step, set(first.held_out.evaluated_steps), first.held_out.plateau.best,
                  first.health.total(ActorCounters).episodes, first.messages_read, dict(first.accepted))
        assert before[0] == 4 and before[3] == 4  # past the schedule's first interval
    finally:
        first.close()  # as if killed: nothing more is written after the state of its last change
    second = Coordinator.for_run(config, StopFlag())
    try:
        after = (second.learner_step, second.progress.weight_version, second.progress.weight_epoch, second.progress.max_turns,
                 dict(second.endpoints), dict(second.ledger.faults), second.held_out.eval_step, set(second.held_out.evaluated_steps),
                 second.held_out.plateau.best, second.health.total(ActorCounters).episodes, second.messages_read,
                 dict(second.accepted))
        assert after == before
        assert second.restarts == 1 and second.intake.bad_messages["ProtocolError"] == 1
        assert "actor-1" in second.ledger.recovering  # its recovery is still timed from its death
        control = second.control()
        assert (control.learner_step, control.weight_epoch, control.endpoints["weights"]) == (4, 1,
                                                                                               "tcp://127.0.0.1:4000")
        assert not control.stop
        [restored] = read_events(config.output_dir, RunEvent.COORDINATOR_RESTORED)
        assert restored["step"] == 4 and restored["restarts"] == 1
        # The launcher tells the replacement about its predecessor: it has recovered by reading at all.
        key = second.run_key
        second.take(encode(ProcessEvent(run_id=RUN_ID, name="coordinator", role="coordinator", event=EVENT_DIED,
                                        exit_code=-9, at=time.time() - 3, key=key)))
        second.take(encode(ProcessEvent(run_id=RUN_ID, name="coordinator", role="coordinator", event=EVENT_RESTARTED,
                                        restarts=1, delay_s=1.0, at=time.time(), key=key)))
        assert second.ledger.faults["coordinator_died"] == 1 and second.ledger.faults["coordinator_recovered"] == 1
        assert second.ledger.recovery_s["coordinator"] >= 3
        lines = [json.loads(line) for line in (config.output_dir / "faults.jsonl").read_text().splitlines()]
        assert [line["event"] for line in lines if line["name"] == "coordinator"] == ["died", "restarted", "recovered"]
        # The subscribers see the same Control as before the restart.
        sub = second.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(config.network.endpoint(config.network.control_port))
        deadline = time.monotonic() + 20
        while not sub.poll(100):
            second.publish()
            assert time.monotonic() < deadline, "no Control from the restarted coordinator"
        assert decode_as(sub.recv(), Control).endpoints["weights"] == "tcp://127.0.0.1:4000"
        sub.close()
    finally:
        second.close()


def test_the_learners_end_missed_while_no_coordinator_listened_is_read_from_its_event(config):
    first = Coordinator.for_run(config, StopFlag())
    try:
        first.take(encode(LearnerReport(run_id=RUN_ID, step=9, weight_version=9, key=first.run_key)))
    finally:
        first.close()
    # The learner's last step and closing report went out while no coordinator was up; its event stayed.
    EventLog(config.output_dir, "learner-0").emit(RunEvent.LEARNER_DONE, step=10, stopped_early=False,
                                                  checkpoint="ckpt")
    second = Coordinator.for_run(config, StopFlag())
    try:
        assert not second.finished
        second._learner_done_on_disk()
        assert second.finished and second.learner_step == 10
        assert read_events(config.output_dir, RunEvent.LEARNER_DONE_FROM_DISK)[0]["step"] == 10
    finally:
        second.close()


def test_an_end_from_a_launch_before_is_not_this_launchs(config):
    EventLog(config.output_dir, "learner-0").emit(RunEvent.LEARNER_DONE, step=10, stopped_early=True, checkpoint="")
    time.sleep(0.01)
    start_launch(config.output_dir)
    first = Coordinator.for_run(config, StopFlag())
    first.close()
    second = Coordinator.for_run(config, StopFlag())
    try:
        second._learner_done_on_disk()
        assert not second.finished
    finally:
        second.close()


def test_a_new_launch_starts_from_its_checkpoint_not_from_the_last_coordinator(config):
    first = Coordinator.for_run(config, StopFlag())
    try:
        feed_a_run(first)
    finally:
        first.close()
    assert load_snapshot(config.output_dir, RUN_ID).learner_step == 4
    start_launch(config.output_dir)  # what `horizonrl train` does before it starts anything
    assert not state_path(config.output_dir).exists()
    fresh = Coordinator.for_run(config, StopFlag())
    try:
        assert fresh.restarts == 0 and fresh.learner_step == 0 and not fresh.endpoints
    finally:
        fresh.close()
