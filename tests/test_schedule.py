import pytest

from horizonrl.core.config import RoundsCtrlConfig
from horizonrl.core.schedule import TurnBudgetSchedule


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


def test_budget_after_completed_steps():
    """Episodes started after d completed steps feed step d + 1: budget_after(d) = rounds[min(d // 100, 2)].

    Nothing but the completed step count goes in, so a run resumed at step k gets exactly these
    values (AgentGym-RL's counter came back one step off)."""
    s = stepwise([10, 20, 30], 100)
    assert [s.budget_after(d) for d in (0, 99, 100, 199, 200, 349)] == [10, 10, 20, 20, 30, 30]


def test_fixed_schedule_and_bad_step():
    s = TurnBudgetSchedule.from_config(RoundsCtrlConfig(type="fixed", rounds=[15]))
    assert {s.max_turns(t) for t in (1, 50, 999)} == {15}
    with pytest.raises(ValueError):
        s.max_turns(0)
