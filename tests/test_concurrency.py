"""The adaptive number of groups in flight (actors/concurrency.py): the controller's band, bounds and hysteresis,
and the stat logger that reads vLLM's scheduler reports into the engine's load."""

from types import SimpleNamespace

import pytest

from horizonrl.actors.concurrency import EngineLoad, EngineLoadLogger, InFlightBand, InFlightController, \
    load_logger_factory
from horizonrl.core.config import ConcurrencyConfig

BAND = InFlightBand(low=0.5, high=0.8, min_groups=2, max_groups=6, hold_s=10.0)


def decide(ctl, now, usage, preemptions=0, busy=None, reporting=True):
    return ctl.decide(now=now, peak_usage=usage, preemptions=preemptions,
                      busy_groups=ctl.groups if busy is None else busy, reporting=reporting)


def test_grows_one_group_at_a_time_below_the_band_and_holds_between_changes():
    ctl = InFlightController(BAND, start=3)
    d = decide(ctl, 0.0, 0.2)
    assert (d.groups, d.changed, d.reason) == (4, True, "below_band")
    assert decide(ctl, 5.0, 0.2).reason == "holding" and ctl.groups == 4  # within hold_s of the change
    assert decide(ctl, 10.0, 0.2).groups == 5
    assert decide(ctl, 20.0, 0.2).groups == 6
    d = decide(ctl, 30.0, 0.2)
    assert (d.groups, d.changed) == (6, False)  # max_groups
    assert ctl.changes == 3


def test_holds_inside_the_band():
    ctl = InFlightController(BAND, start=4)
    for now in (0.0, 20.0, 40.0):
        d = decide(ctl, now, 0.65)
        assert (d.groups, d.changed, d.reason) == (4, False, "in_band")


def test_shrinks_a_quarter_above_the_band_and_on_a_preemption_never_below_the_minimum():
    big = InFlightBand(low=0.5, high=0.8, min_groups=2, max_groups=16, hold_s=0.0)
    ctl = InFlightController(big, start=12)
    assert decide(ctl, 0.0, 0.95).groups == 9  # 12 - 12 // 4
    d = decide(ctl, 1.0, 0.6, preemptions=3)  # in the band, but the engine preempted
    assert (d.groups, d.reason) == (7, "preempted")
    assert decide(ctl, 2.0, 0.6, preemptions=3).reason == "in_band"  # the same count: no new preemption
    for now in range(3, 10):
        decide(ctl, float(now), 0.99)
    assert ctl.groups == 2  # min_groups


def test_a_preemption_during_the_hold_still_counts_once_the_hold_is_over():
    ctl = InFlightController(BAND, start=4)
    decide(ctl, 0.0, 0.95)  # 4 -> 3
    assert decide(ctl, 1.0, 0.6, preemptions=5).reason == "holding"
    # the preemption seen while holding is remembered as seen: the next decision judges the band only
    assert decide(ctl, 11.0, 0.6, preemptions=5).reason == "in_band"


def test_does_not_grow_when_the_slots_are_not_all_busy():
    ctl = InFlightController(BAND, start=4)
    d = decide(ctl, 0.0, 0.1, busy=2)  # the buffer paused the rollout, or an evaluation runs
    assert (d.groups, d.changed, d.reason) == (4, False, "not_busy")


def test_without_reports_it_stays_where_it_started():
    ctl = InFlightController(BAND, start=3)
    d = decide(ctl, 100.0, 0.0, reporting=False)
    assert (d.groups, d.changed, d.reason) == (3, False, "no_report")


def test_the_start_is_clamped_to_the_bounds():
    assert InFlightController(BAND, start=1).groups == 2
    assert InFlightController(BAND, start=50).groups == 6


def test_a_band_that_makes_no_sense_is_refused():
    with pytest.raises(ValueError, match="low < high"):
        InFlightBand(low=0.9, high=0.5)
    with pytest.raises(ValueError, match="min <= max"):
        InFlightBand(min_groups=5, max_groups=2)
    with pytest.raises(ValueError, match="kv_cache_low"):
        ConcurrencyConfig(kv_cache_low=0.9, kv_cache_high=0.8)


def scheduler(usage, running=3, waiting=0):
    return SimpleNamespace(kv_cache_usage=usage, num_running_reqs=running, num_waiting_reqs=waiting)


def test_the_stat_logger_keeps_the_latest_use_the_peak_and_the_preemptions():
    load = EngineLoad()
    logger = load_logger_factory(load)(None, 0)
    assert isinstance(logger, EngineLoadLogger)
    logger.record(scheduler(0.3), SimpleNamespace(num_preempted_reqs=0), None, engine_idx=0)
    logger.record(scheduler(0.9, running=5, waiting=2), SimpleNamespace(num_preempted_reqs=2))
    logger.record(scheduler(0.4), None)
    logger.record(None, SimpleNamespace(num_preempted_reqs=1))
    assert (load.kv_cache_usage, load.running, load.waiting, load.preemptions, load.reports) == (0.4, 3, 0, 3, 3)
    assert load.take_peak() == 0.9
    assert load.take_peak() == 0.4  # the next window starts at the current use
    logger.log_engine_initialized(), logger.log(), logger.record_sleep_state(1, 0)


def test_the_benchmark_clocks_each_budget_stage_and_prints_both_modes_side_by_side():
    from horizonrl.apps.bench.horizon import COLUMNS, stage_bounds, table

    assert stage_bounds([6, 13, 20], 4, 12) == [("budget 6", 1, 4), ("budget 13", 4, 8), ("budget 20", 8, 12),
                                                ("overall", 1, 12)]
    figures = {name: 1.0 for name, _ in COLUMNS}
    result = {"stages": ["budget 6"], "results": {"fixed": [{"budget 6": {**figures, "preemptions": 40.0}}],
                                                   "adaptive": [{"budget 6": {**figures, "preemptions": 3.0}}]}}
    header, _, row = table(result).splitlines()
    assert header.startswith("| stage (fixed / adaptive) | preemptions | tokens_per_s |")
    assert row.startswith("| budget 6 | 40 / 3 | 1 / 1 |")


def test_after_a_decrease_it_waits_for_the_slots_above_to_finish_their_groups():
    ctl = InFlightController(BAND, start=6)
    assert decide(ctl, 0.0, 0.95).groups == 5
    d = decide(ctl, 20.0, 0.95, preemptions=4, busy=6)  # the sixth group is still running: its context is the excess
    assert (d.groups, d.changed, d.reason) == (5, False, "settling")
    assert decide(ctl, 21.0, 0.95, busy=5).groups == 4  # settled, still full: cut again (the preemptions are old)


def test_the_coordinator_charts_the_groups_in_flight_of_all_actors_and_their_mean_kv_cache_use():
    from horizonrl.coordinator.health import ProcessHealth
    from horizonrl.coordinator.metrics import actor_scalars

    health = ProcessHealth(current_pid={("actor", 0): 11, ("actor", 1): 12},
                           counters={("actor", 0, 11): {"groups_in_flight": 3.0, "kv_cache_usage": 0.4,
                                                        "engine_preemptions": 5.0},
                                     ("actor", 0, 10): {"groups_in_flight": 9.0, "kv_cache_usage": 1.0,
                                                        "engine_preemptions": 2.0},  # a dead incarnation
                                     ("actor", 1, 12): {"groups_in_flight": 2.0, "kv_cache_usage": 0.8}})
    scalars = actor_scalars(health, episodes_lost=0.0)
    assert scalars["rollout/groups_in_flight"] == 5.0  # gauges: the current incarnations only
    assert abs(scalars["rollout/kv_cache_usage"] - 0.6) < 1e-9
    assert scalars["rollout/engine_preemptions"] == 7.0  # a counter: every incarnation's
