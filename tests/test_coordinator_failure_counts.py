"""Every kind of episode failure, and every way the agent's episodes end, reaches TensorBoard with its count.

The actors count failures by kind (``failures_<kind>``) and endings by reason (``stop_<reason>``) in
their heartbeats; the coordinator adds them over every actor and every incarnation of each (a
restarted actor counts from 0 again) and writes ``rollout/failures/<kind>`` and ``rollout/stop/<reason>``
at each learner step. The episodes a dead actor was playing are ``rollout/failures/actor_lost``.
"""

from __future__ import annotations

import glob

from horizonrl.coordinator import Coordinator
from horizonrl.core.config import TrainConfig
from horizonrl.core.runtime import StopFlag
from horizonrl.launcher import resolve_ports
from horizonrl.protocol import FAILURE_KINDS, Heartbeat, LearnerReport


def _scalars(run_dir) -> dict[str, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(glob.glob(str(run_dir / "tensorboard" / "events.*"))[0])
    acc.Reload()
    return {tag: acc.Scalars(tag)[-1].value for tag in acc.Tags()["scalars"]}


def test_failures_by_kind_and_endings_by_reason_are_summed_over_actors_and_incarnations(tmp_path):
    config = resolve_ports(TrainConfig.model_validate({
        "run": {"output_dir": str(tmp_path), "run_id": "counts"}, "model": {"path": "unused"},
        "envs": [{"name": "signpost"}], "network": {"host": "127.0.0.1"}}))
    coordinator = Coordinator(config, StopFlag())

    def beat(index, pid, **counters):
        coordinator.on_heartbeat(Heartbeat(run_id="counts", role="actor", index=index, pid=pid,
                                           counters={k: float(v) for k, v in counters.items()}))

    try:
        # actor 0, first incarnation: dies while playing 3 episodes
        beat(0, 100, failures_environment=2, failures_engine=1, stop_done=5, episodes_in_progress=3,
             completed_turns=20, invalid_actions=4)
        # actor 0 again (a new pid): its counters start from 0
        beat(0, 101, failures_engine=4, failures_timeout=1, stop_done=1, stop_max_turns=2, episodes_in_progress=1,
             completed_turns=10, invalid_actions=1)
        beat(1, 200, failures_environment=1, failures_prompt_too_long=6, stop_context_limit=3, stop_max_turns=1,
             completed_turns=10, invalid_actions=3)
        coordinator.on_learner_report(LearnerReport(run_id="counts", step=1, weight_version=1, metrics={"loss/policy": 0.5}))
    finally:
        coordinator.close()
    scalars = _scalars(tmp_path)
    assert {kind for kind in FAILURE_KINDS if kind} == {"environment", "engine", "prompt_too_long", "timeout", "actor_lost"}
    assert {k: v for k, v in scalars.items() if k.startswith("rollout/failures/")} == {
        "rollout/failures/environment": 3.0,
        "rollout/failures/engine": 5.0,
        "rollout/failures/prompt_too_long": 6.0,
        "rollout/failures/timeout": 1.0,
        "rollout/failures/actor_lost": 3.0,  # what the first incarnation was playing when it died
    }
    assert {k: v for k, v in scalars.items() if k.startswith("rollout/stop/")} == {
        "rollout/stop/done": 6.0, "rollout/stop/max_turns": 3.0, "rollout/stop/context_limit": 3.0,
    }
    # the agent's own errors (observations, never failures): 8 of 40 turns named no valid action
    assert scalars["rollout/agent/invalid_actions"] == 8.0
    assert abs(scalars["rollout/agent/invalid_action_rate"] - 0.2) < 1e-6
