"""The scalars of one learner step: the learner's own metrics, and what the coordinator adds from the
others — the actors' counters (every charted field of their structs, protocol/counters.py), the rollout
window's rates, the turn budget, the fault ledger, the report socket's counts."""

from __future__ import annotations

from horizonrl.coordinator.health import ProcessHealth, RolloutWindow
from horizonrl.protocol import FAILURE_ACTOR_LOST
from horizonrl.protocol.counters import ActorCounters, ActorGauges, DeliveryCounters, LearnerCounters, charted


def actor_scalars(health: ProcessHealth, episodes_lost: float) -> dict[str, float]:
    """The actors' cumulative counters, over every actor and incarnation: episode outcomes by kind
    (failures, never trained on; the agent's own endings), weight updates (the stall, the receive, the load,
    the wait for the engine's step), the engines' clocks, pauses and sends."""
    actors = health.total(ActorCounters)
    scalars = {**charted(actors), **charted(health.total(DeliveryCounters)), **charted(health.total(LearnerCounters))}
    # The episodes a dead actor was playing: infrastructure failures the fault ledger counted.
    scalars[f"rollout/failures/{FAILURE_ACTOR_LOST}"] = episodes_lost
    # The groups the actors keep in flight now (rollout.concurrency: fixed, or adapted to the engines' KV-cache use)
    # and the engines' mean KV-cache use.
    gauges = health.gauges(ActorGauges)
    live = sum(1 for role, _ in health.current_pid if role == ActorGauges.role)
    scalars["rollout/groups_in_flight"] = gauges.groups_in_flight
    if live:
        scalars["rollout/kv_cache_usage"] = gauges.kv_cache_usage / live
    # The agent's own errors: turns whose reply named no valid action (the environment said so and went on).
    if actors.completed_turns:
        scalars["rollout/agent/invalid_action_rate"] = actors.invalid_actions / actors.completed_turns
    return scalars


def step_scalars(metrics: dict[str, float], window: RolloutWindow, health: ProcessHealth,
                 *others: dict[str, float]) -> dict[str, float]:
    """A learner step's scalars: the learner's ``metrics``, the rollout window's rates since the step before,
    then the ``others`` (the schedule's, the actors', the faults', ...) in order."""
    scalars = dict(metrics)
    scalars.update(window.update(health))
    for more in others:
        scalars.update(more)
    return scalars
