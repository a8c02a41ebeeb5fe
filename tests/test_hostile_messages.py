"""No message stops the coordinator, and none is taken for what it is not.

The codec raises only ProtocolError for any bytes (invalid UTF-8 in every string of every kind, random
corruption, a kind over its size limit); the coordinator, fed well-formed messages of its run that are
wrong (an unknown process, environment or role, a NaN, a step past the run, a final report or a
supervision event without the run's key), rejects each, counts it by kind and reason, and changes
nothing else. The whole-run and socket-level fuzzing is tests/faults/test_fuzz.py.
"""

from __future__ import annotations

import json
import random

import pytest

from horizonrl.coordinator import Coordinator
from horizonrl.core.config import TrainConfig
from horizonrl.core.run_dirs import ensure_run_key
from horizonrl.core.runtime import StopFlag
from horizonrl.apps.hostile import flipped, invalid_utf8_messages, sample_messages, string_paths, wrong_reports
from horizonrl.launcher import resolve_ports
from horizonrl.protocol import (EVENT_DIED, EpisodeSample, Heartbeat, HeldOutEval, LearnerReport, OversizedMessage,
                                ProcessEvent, ProtocolError, Registration, decode, encode)

RUN_ID = "hostile"
TOTAL_STEPS = 20
NUM_ACTORS = 2


def test_invalid_utf8_in_any_string_of_any_kind_is_a_protocol_error():
    kinds = {type(m).__name__ for m in sample_messages(RUN_ID)}
    assert len(kinds) == 16  # every kind on the wire
    strings = sum(len(string_paths(m)) for m in sample_messages(RUN_ID))
    cases = list(invalid_utf8_messages(RUN_ID))
    assert len(cases) == strings + len(kinds) >= 90  # every string field, dict key and list item, and every type tag
    for data in cases:
        with pytest.raises(ProtocolError):
            decode(data)


def test_randomly_corrupted_messages_of_every_kind_decode_or_raise_only_protocol_error():
    rng = random.Random(7)
    encoded = [encode(m) for m in sample_messages(RUN_ID)]
    outcomes = {"decoded": 0, "ProtocolError": 0}
    for n in range(3000):
        try:
            decode(flipped(rng, encoded[n % len(encoded)], flips=rng.randint(1, 4)))
            outcomes["decoded"] += 1
        except ProtocolError:
            outcomes["ProtocolError"] += 1
    assert sum(outcomes.values()) == 3000 and outcomes["ProtocolError"] > 1000, outcomes


def test_every_kind_has_a_size_limit_of_its_own():
    beat = Heartbeat(run_id=RUN_ID, role="actor", index=0, pid=1, counters={f"c{i:06d}": 1.0 for i in range(30_000)})
    with pytest.raises(OversizedMessage, match="Heartbeat of .* its kind's limit"):
        decode(encode(beat))  # under the report socket's 16 MB, far over what a heartbeat is


@pytest.fixture
def coordinator(tmp_path):
    config = resolve_ports(TrainConfig.model_validate({
        "run": {"output_dir": str(tmp_path), "run_id": RUN_ID}, "model": {"path": "unused"},
        "envs": [{"name": "signpost", "settings": {"length": 2}}], "network": {"host": "127.0.0.1"},
        "rollout": {"num_actors": NUM_ACTORS}, "learner": {"total_steps": TOTAL_STEPS}}))
    ensure_run_key(tmp_path)
    c = Coordinator(config, StopFlag())
    yield c
    c.close()


def test_wrong_reports_are_rejected_counted_by_kind_and_reason_and_change_nothing(coordinator, tmp_path):
    key = coordinator.run_key
    cases = wrong_reports(RUN_ID, key, total_steps=TOTAL_STEPS, num_actors=NUM_ACTORS)
    expected: dict[str, int] = {}
    for data, counter in cases:
        coordinator.take(data)
        expected[counter] = expected.get(counter, 0) + 1
    assert dict(coordinator.intake.rejected) == expected
    assert coordinator.messages_read == len(cases) and not coordinator.accepted and not coordinator.intake.bad_messages
    # nothing of it reached the run's state
    assert coordinator.learner_step == 0 and not coordinator.finished and not coordinator.done
    assert not coordinator.health.last_seen and not coordinator.ledger.faults and not coordinator.endpoints
    assert not (tmp_path / "episodes.jsonl").exists() and not (tmp_path / "faults.jsonl").exists()
    scalars = coordinator.intake.scalars(coordinator.restarts)
    assert scalars["coordinator/rejected"] == len(cases)
    assert scalars["coordinator/rejected_learner_report_unauthenticated"] == 2


def test_the_same_reports_with_the_runs_key_and_sane_values_are_taken(coordinator, tmp_path):
    key = coordinator.run_key
    good = [
        Heartbeat(run_id=RUN_ID, role="actor", index=1, pid=10, counters={"episodes": 3.0}, key=key),
        ProcessEvent(run_id=RUN_ID, name="actor-1", role="actor", event=EVENT_DIED, exit_code=-9, key=key),
        LearnerReport(run_id=RUN_ID, step=1, weight_version=1, metrics={"loss/policy": float("nan")}, key=key),
        HeldOutEval(run_id=RUN_ID, learner_step=0, weight_versions=(0, 1), wall_s=2.0,
                    results={"signpost": {"success_rate": 0.25, "episodes_valid": 8.0}}, key=key),
        EpisodeSample(run_id=RUN_ID, env="signpost", task_id=3, actor_id=0, weight_version=1, max_turns=2, reward=1.0,
                      success=True, score=1.0, num_turns=2, stop_reason="done",
                      transcript=[("observation", "a"), ("reply", "b"), ("observation", "c"), ("reply", "d")]),
        Registration(run_id=RUN_ID, name="buffer", pid=11, endpoints={"batches": "tcp://127.0.0.1:5555"}, key=key),
    ]
    for message in good:
        coordinator.take(encode(message))
    assert not coordinator.intake.rejected and sum(coordinator.accepted.values()) == len(good)
    assert coordinator.learner_step == 1 and coordinator.ledger.faults["actor_died"] == 1
    assert coordinator.endpoints == {"batches": "tcp://127.0.0.1:5555"} and 0 in coordinator.held_out.evaluated_steps
    assert len((tmp_path / "episodes.jsonl").read_text().splitlines()) == 1
    assert [json.loads(line)["name"] for line in (tmp_path / "faults.jsonl").read_text().splitlines()] == ["actor-1"]


def test_learner_reports_never_take_the_run_back(coordinator):
    key = coordinator.run_key

    def report(step, epoch=0, **kw):
        coordinator.take(encode(LearnerReport(run_id=RUN_ID, step=step, weight_version=step, weight_epoch=epoch,
                                              key=key, **kw)))

    report(5)
    report(3)  # a late word: refused
    assert coordinator.learner_step == 5 and coordinator.intake.rejected["learner_report_run_state_backwards"] == 1
    report(4, epoch=1, startup=True)  # a restarted learner resumed from its checkpoint of step 4: taken
    assert (coordinator.learner_step, coordinator.progress.weight_epoch) == (4, 1)
    report(6, epoch=0)  # the dead incarnation's report, arriving late: refused
    assert coordinator.learner_step == 4 and coordinator.intake.rejected["learner_report_run_state_backwards"] == 2
    report(5, epoch=1)
    report(5, epoch=1, final=True)  # the closing report repeats the last step
    assert coordinator.finished and coordinator.learner_step == 5


def test_a_run_without_a_key_takes_unkeyed_reports(tmp_path):
    """Run directories from before keys (and configs written by hand) keep working: nothing is checked."""
    config = resolve_ports(TrainConfig.model_validate({
        "run": {"output_dir": str(tmp_path), "run_id": RUN_ID}, "model": {"path": "unused"},
        "envs": [{"name": "signpost"}], "network": {"host": "127.0.0.1"}}))
    coordinator = Coordinator(config, StopFlag())
    try:
        coordinator.take(encode(LearnerReport(run_id=RUN_ID, step=1, weight_version=1)))
        assert coordinator.learner_step == 1 and coordinator.accepted["learner_report"] == 1
    finally:
        coordinator.close()


def test_a_buffer_heartbeat_from_a_pid_that_did_not_register_last_is_ignored_and_counted(coordinator):
    """A forged (or stale) buffer heartbeat claiming a full buffer would pause the rollout: only the incarnation
    that registered last is the buffer."""
    key = coordinator.run_key
    coordinator.take(encode(Registration(run_id=RUN_ID, name="buffer", pid=11,
                                         endpoints={"batches": "tcp://127.0.0.1:5555"}, key=key)))
    coordinator.take(encode(Heartbeat(run_id=RUN_ID, role="buffer", index=0, pid=11,
                                      counters={"ready_groups": 1.0}, key=key)))
    for _ in range(20):
        coordinator.take(encode(Heartbeat(run_id=RUN_ID, role="buffer", index=0, pid=31337,
                                          counters={"ready_groups": 1e6}, key=key)))
    assert not coordinator.rollout_paused and coordinator.health.current_pid[("buffer", 0)] == 11
    assert coordinator.intake.rejected["heartbeat_not_registered"] == 20
    coordinator.take(encode(Heartbeat(run_id=RUN_ID, role="buffer", index=0, pid=31337,
                                      counters={"ready_groups": 1e6})))  # and without the key: not even that far
    assert coordinator.intake.rejected["heartbeat_unauthenticated"] == 1
