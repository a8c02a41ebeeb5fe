import pytest

from horizonrl.config import RoundsCtrlConfig
from horizonrl.schedule import TurnBudgetSchedule


def stepwise(rounds, interval):
    return TurnBudgetSchedule.from_config(
        RoundsCtrlConfig(type="scaling_inter_stepwise", rounds=rounds, steps_scaling_inter=interval))


def test_agentgym_stepwise_boundaries():
    s = stepwise([10, 20, 30], 100)
    # rounds[k] for learner steps k*I+1 … (k+1)*I, then the last value held.
    assert [s.max_turns(t) for t in (1, 100, 101, 200, 201, 300, 301, 10_000)] == [10, 10, 20, 20, 30, 30, 30, 30]


def test_babyai_schedule_from_the_paper():
    s = stepwise([6, 13, 20], 100)
    assert (s.max_turns(100), s.max_turns(101), s.max_turns(201)) == (6, 13, 20)


def test_budget_after_resume_equals_uninterrupted_run():
    s = stepwise([10, 20, 30], 100)
    uninterrupted = [s.budget_after(done) for done in range(0, 350)]
    # A run resumed after k completed steps keeps no counter of its own: the budget is a
    # function of the completed step count, so it cannot come back one step off.
    for k in (99, 100, 101, 200):
        resumed = TurnBudgetSchedule.from_config(
            RoundsCtrlConfig(type="scaling_inter_stepwise", rounds=[10, 20, 30], steps_scaling_inter=100))
        assert [resumed.budget_after(done) for done in range(k, 350)] == uninterrupted[k:]
    assert s.budget_after(100) == 20 and s.budget_after(99) == 10


def test_fixed_schedule_and_bad_step():
    s = TurnBudgetSchedule.from_config(RoundsCtrlConfig(type="fixed", rounds=[15]))
    assert {s.max_turns(t) for t in (1, 50, 999)} == {15}
    with pytest.raises(ValueError):
        s.max_turns(0)
