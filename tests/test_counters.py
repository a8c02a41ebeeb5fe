"""The heartbeat's typed counters (protocol/counters.py): the names an actor sends are the fields the
coordinator reads and charts, every failure kind and stop reason has its field, and a heartbeat of another
version (names unknown or missing) still reads."""

import pytest

from horizonrl.protocol import FAILURE_ACTOR_LOST, FAILURE_KINDS, FAILURE_NONE, STOP_CONTEXT, STOP_DONE, STOP_MAX_TURNS
from horizonrl.protocol.counters import (ActorCounters, ActorGauges, BufferGauges, DeliveryCounters, added, charted,
                                         heartbeat_counters, read_counters)

# What the coordinator charts from the actors' counters at every learner step.
CHARTED = {
    "rollout/episodes_total", "rollout/generated_tokens_total", "rollout/failures/environment",
    "rollout/failures/engine", "rollout/failures/prompt_too_long", "rollout/failures/timeout", "rollout/stop/done",
    "rollout/stop/max_turns", "rollout/stop/context_limit", "rollout/agent/invalid_actions", "rollout/weight_updates",
    "rollout/weight_versions_skipped", "rollout/weight_stall_s", "rollout/weight_transfer_s", "rollout/weight_load_s",
    "rollout/weight_pause_wait_s", "rollout/continued_requests", "rollout/kept_requests",
    "rollout/lost_stage_messages", "rollout/engine_idle_s_total", "rollout/engine_wall_s_total",
    "rollout/engine_request_s_total", "rollout/paused_s", "rollout/send_wait_s", "rollout/engine_preemptions",
    "rollout/in_flight_changes", "rollout/context_windows",
}


def test_the_charted_fields_are_the_rollout_scalars():
    assert set(charted(ActorCounters())) | set(charted(DeliveryCounters())) == CHARTED
    assert not set(charted(ActorCounters())) & set(charted(DeliveryCounters()))


@pytest.mark.parametrize("kind", [k for k in FAILURE_KINDS if k not in (FAILURE_NONE, FAILURE_ACTOR_LOST)])
def test_every_failure_an_actor_can_count_has_a_field(kind):
    counters = ActorCounters()
    counters.count_failure(kind)
    assert charted(counters)[f"rollout/failures/{kind}"] == 1


@pytest.mark.parametrize("reason", [STOP_DONE, STOP_MAX_TURNS, STOP_CONTEXT])
def test_every_way_the_agent_ends_an_episode_has_a_field(reason):
    counters = ActorCounters()
    counters.count_stop(reason)
    assert charted(counters)[f"rollout/stop/{reason}"] == 1


def test_an_unknown_failure_or_stop_is_an_error_not_a_counter_nobody_reads():
    with pytest.raises(KeyError):
        ActorCounters().count_failure("mystery")
    with pytest.raises(KeyError):
        ActorCounters().count_stop("mystery")


def test_what_is_sent_reads_back_and_unknown_or_missing_names_do_not_break_it():
    counters, gauges = ActorCounters(episodes=3.0, weight_joins=1.0), ActorGauges(episodes_in_progress=2.0)
    wire = heartbeat_counters(counters, DeliveryCounters(sent=5.0), gauges, extra={"diagnostic": 7.0})
    assert wire["episodes"] == 3.0 and wire["sent"] == 5.0 and wire["diagnostic"] == 7.0
    assert read_counters(ActorCounters, wire) == counters and read_counters(ActorGauges, wire) == gauges
    assert read_counters(BufferGauges, {"ready_groups": 4.0, "from_a_newer_buffer": 1.0}).ready_groups == 4.0
    assert read_counters(ActorCounters, {}) == ActorCounters()


def test_counters_add_up_field_by_field():
    total = added(ActorCounters, [ActorCounters(episodes=2.0), ActorCounters(episodes=5.0, successes=1.0)])
    assert (total.episodes, total.successes, total.turns) == (7.0, 1.0, 0.0)
