"""The max-turn budget as a function of the learner step (ScalingInter-RL).

AgentGym-RL's ``algorithm.rounds_ctrl``:
- ``fixed``: always ``rounds[0]``.
- ``scaling_inter_stepwise``: ``rounds[k]`` for learner steps ``k*I+1 … (k+1)*I``
  (``I = steps_scaling_inter``), holding the last value afterwards.

Learner steps count from 1. Episodes generated while the learner has completed
``s`` steps feed step ``s + 1``, so they run under ``max_turns(s + 1)``. The budget
is a pure function of the completed step count, which is what makes it exact after a
resume (AgentGym-RL keeps a counter that comes back one step off).
"""

from __future__ import annotations

from dataclasses import dataclass

from horizonrl.core.config import RoundsCtrlConfig


@dataclass(frozen=True)
class TurnBudgetSchedule:
    kind: str
    rounds: tuple[int, ...]
    steps_per_stage: int

    @classmethod
    def from_config(cls, cfg: RoundsCtrlConfig) -> "TurnBudgetSchedule":
        return cls(cfg.type, tuple(cfg.rounds), cfg.steps_scaling_inter)

    def max_turns(self, step: int) -> int:
        """The turn budget for learner step ``step`` (1-based)."""
        if step < 1:
            raise ValueError(f"learner steps count from 1, got {step}")
        if self.kind == "fixed":
            return self.rounds[0]
        stage = (step - 1) // self.steps_per_stage
        return self.rounds[min(stage, len(self.rounds) - 1)]

    def budget_after(self, completed_steps: int) -> int:
        """The budget for episodes started when ``completed_steps`` learner steps are done."""
        return self.max_turns(completed_steps + 1)

    @property
    def final_max_turns(self) -> int:
        return self.rounds[0] if self.kind == "fixed" else self.rounds[-1]
