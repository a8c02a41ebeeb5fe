"""The rules of supervision, without processes: the launcher's restart policy, and how the coordinator
counts deaths, lost episodes and recoveries across a process's incarnations."""

from __future__ import annotations

import json
import time

import pytest
from helpers import ManualClock

from horizonrl.coordinator import Coordinator
from horizonrl.core.config import TrainConfig
from horizonrl.core.runtime import StopFlag
from horizonrl.launcher import RestartPolicy, resolve_ports
from horizonrl.protocol import EVENT_DIED, EVENT_RESTARTED, Heartbeat, LearnerReport, ProcessEvent
from horizonrl.protocol.counters import ActorCounters, ActorGauges


def test_restarts_back_off_double_and_stop_at_the_limit_within_the_window():
    clock = ManualClock()
    policy = RestartPolicy(limit=3, window_s=100, backoff_s=1, max_backoff_s=3, clock=clock)
    assert [policy.next_delay("actor-0") for _ in range(3)] == [1, 2, 3]  # doubled, capped at 3
    assert policy.next_delay("actor-0") is None  # a 4th within the window: give up
    assert policy.next_delay("actor-1") == 1  # counted per process
    clock.now = 101  # the first three left the window
    assert policy.next_delay("actor-0") == 1 and policy.recent("actor-0") == 1


def test_no_restarts_when_the_limit_is_zero():
    assert RestartPolicy(limit=0, window_s=10, backoff_s=1, max_backoff_s=1).next_delay("buffer") is None


@pytest.fixture
def coordinator(tmp_path):
    config = resolve_ports(TrainConfig.model_validate({
        "run": {"output_dir": str(tmp_path), "run_id": "test-run"}, "model": {"path": "unused"},
        "envs": [{"name": "signpost"}], "buffer": {"capacity_groups": 4}, "learner": {"groups_per_step": 4},
        "network": {"host": "127.0.0.1"}}))
    c = Coordinator(config, StopFlag())
    yield c
    c.close()


def beat(role: str, pid: int, index: int = 0, **counters: float) -> Heartbeat:
    return Heartbeat(run_id="test-run", role=role, index=index, pid=pid, counters=counters)


def faults(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "faults.jsonl").read_text().splitlines()]


def test_counters_add_up_over_incarnations_but_levels_are_the_current_ones(coordinator):
    coordinator.on_heartbeat(beat("actor", 10, episodes=5.0, episodes_in_progress=3.0))
    coordinator.on_heartbeat(beat("buffer", 20, ready_groups=4.0))
    assert coordinator.rollout_paused  # the buffer holds capacity_groups
    coordinator.on_heartbeat(beat("actor", 11, episodes=2.0, episodes_in_progress=1.0))  # a restarted actor
    coordinator.on_heartbeat(beat("buffer", 21, ready_groups=0.0))  # a restarted buffer, empty
    assert coordinator.health.total(ActorCounters).episodes == 7  # cumulative: both incarnations
    assert coordinator.health.gauges(ActorGauges).episodes_in_progress == 1  # a level: the current one
    assert not coordinator.rollout_paused  # the dead buffer's last depth is not the buffer's state
    assert coordinator.ledger.faults["episodes_lost"] == 3  # what the dead actor was playing


def test_the_rollout_pauses_once_the_groups_made_and_being_made_fill_the_staleness_window(tmp_path):
    """max_staleness η = 2, B = 4 groups per step: P = ready + running ≥ 8 pauses, though the buffer (capacity 16)
    has room: a ninth group could only be trained 3 versions stale."""
    config = resolve_ports(TrainConfig.model_validate({
        "run": {"output_dir": str(tmp_path), "run_id": "test-run"}, "model": {"path": "unused"},
        "envs": [{"name": "signpost"}], "buffer": {"capacity_groups": 16, "max_staleness": 2},
        "learner": {"groups_per_step": 4}, "network": {"host": "127.0.0.1"}}))
    c = Coordinator(config, StopFlag())
    try:
        c.on_heartbeat(beat("buffer", 20, ready_groups=4.0))
        c.on_heartbeat(beat("actor", 10, groups_running=3.0))
        assert not c.rollout_paused  # P = 7
        c.on_heartbeat(beat("actor", 11, index=1, groups_running=1.0))
        assert c.rollout_paused  # P = 8 over both actors
        c.on_heartbeat(beat("buffer", 20, ready_groups=0.0))  # the learner took a batch
        assert not c.rollout_paused
        # Step 1 is done; the engines still hold version 0 (L = 1): a group started now is as old as version 0
        # and waits for P ahead of it, so only P < (2 − 1)·4 = 4 keeps it within 2 versions.
        c.on_learner_report(LearnerReport(run_id="test-run", step=1, weight_version=1))
        c.on_heartbeat(beat("buffer", 20, ready_groups=3.0))
        c.on_heartbeat(beat("actor", 10, groups_running=1.0))
        c.on_heartbeat(beat("actor", 11, index=1, groups_running=0.0, weight_version=1.0))
        assert c.rollout_paused  # P = 4, the oldest engine 1 version behind
        c.on_heartbeat(beat("actor", 10, groups_running=1.0, weight_version=1.0))  # it has the new weights
        assert not c.rollout_paused  # P = 4 < 8
        # An engine frozen at version 1 while the learner reaches 5 (L = 4 > η): without a floor every actor
        # would pause and the learner starve; the bound never falls below one batch (B = 4 groups) ahead.
        c.on_learner_report(LearnerReport(run_id="test-run", step=5, weight_version=5))
        c.on_heartbeat(beat("actor", 11, index=1, groups_running=1.0, weight_version=5.0))
        c.on_heartbeat(beat("buffer", 20, ready_groups=1.0))
        assert not c.rollout_paused  # P = 1 + 1 + 1 = 3 < 4
        c.on_heartbeat(beat("buffer", 20, ready_groups=2.0))
        assert c.rollout_paused  # P = 4: one batch is ahead
    finally:
        c.close()


def test_a_death_a_restart_and_the_recovery_are_written_with_the_time_between(coordinator, tmp_path):
    coordinator.on_heartbeat(beat("actor", 10, index=1))
    died_at = time.time() - 5
    coordinator.on_process_event(ProcessEvent(run_id="test-run", name="actor-1", role="actor", event=EVENT_DIED,
                                              exit_code=-9, at=died_at))
    coordinator.on_process_event(ProcessEvent(run_id="test-run", name="actor-1", role="actor", event=EVENT_RESTARTED,
                                              restarts=1, delay_s=1.0, at=died_at + 1))
    coordinator.on_heartbeat(beat("actor", 11, index=1))  # back, its engine still starting
    assert [f["event"] for f in faults(tmp_path)] == ["died", "restarted"]
    coordinator.on_heartbeat(beat("actor", 11, index=1, weight_joins=1.0))  # joined the weight hub: ready
    recovered = faults(tmp_path)[-1]
    assert recovered["event"] == "recovered" and recovered["name"] == "actor-1"
    assert 5 <= recovered["recovery_s"] < 60
    assert coordinator.ledger.faults["actor_died"] == 1 and coordinator.ledger.faults["actor_recovered"] == 1


def test_time_to_recover_counts_from_the_last_death(coordinator, tmp_path):
    """Killed again while it was still starting: the first death never recovered; the time counts
    from the second."""
    coordinator.on_heartbeat(beat("actor", 10))
    now = time.time()
    for at in (now - 100, now - 3):
        coordinator.on_process_event(ProcessEvent(run_id="test-run", name="actor-0", role="actor", event=EVENT_DIED,
                                                  exit_code=-9, at=at))
    coordinator.on_heartbeat(beat("actor", 12, weight_joins=1.0))
    recovered = faults(tmp_path)[-1]
    assert recovered["event"] == "recovered" and 3 <= recovered["recovery_s"] < 60


def test_a_restarted_learner_has_recovered_at_its_first_step(coordinator, tmp_path):
    coordinator.on_learner_report(LearnerReport(run_id="test-run", step=4, weight_version=4, weight_epoch=0))
    coordinator.on_process_event(ProcessEvent(run_id="test-run", name="learner-1", role="learner", event=EVENT_DIED,
                                              exit_code=1, at=time.time()))
    coordinator.on_learner_report(LearnerReport(run_id="test-run", step=4, weight_version=4, weight_epoch=1,
                                                startup=True))
    assert "recovered" not in [f["event"] for f in faults(tmp_path)]  # started, no step yet
    coordinator.on_learner_report(LearnerReport(run_id="test-run", step=5, weight_version=5, weight_epoch=1))
    assert faults(tmp_path)[-1]["event"] == "recovered" and faults(tmp_path)[-1]["name"] == "learner"


def test_a_learner_stopped_before_its_first_step_ends_the_run_without_an_error(coordinator):
    """Its closing report is at step 0 (a stop during start-up): there is no step to chart, and the turn
    schedule, which counts steps from 1, must not be asked about step 0."""
    coordinator.on_learner_report(LearnerReport(run_id="test-run", step=0, weight_version=0, startup=True))
    coordinator.on_learner_report(LearnerReport(run_id="test-run", step=0, weight_version=0, final=True))
    assert coordinator.finished and coordinator.control().stop
