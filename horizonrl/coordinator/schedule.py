"""Where training is — completed learner steps, the newest weights — and what that means for the actors:
the turn budget of the episodes they start now (a pure function of the step, ScalingInter-RL's schedule,
so a resumed run matches an uninterrupted one at every step) and the rollout pause (backpressure)."""

from __future__ import annotations

from horizonrl.core.config import TrainConfig
from horizonrl.core.schedule import TurnBudgetSchedule
from horizonrl.protocol import LearnerReport
from horizonrl.protocol.counters import BufferGauges


class TrainingProgress:
    def __init__(self, config: TrainConfig, start_step: int) -> None:
        self.turn_budget = TurnBudgetSchedule.from_config(config.algorithm.rounds_ctrl)
        self.capacity_groups = config.buffer.capacity_groups
        self.learner_step = start_step
        self.weight_version = start_step
        self.weight_epoch = 0  # the learner's incarnation: its startup report says which
        self.finished = False

    @property
    def max_turns(self) -> int:
        """The turn budget for episodes started now."""
        return self.turn_budget.budget_after(self.learner_step)

    def rollout_paused(self, buffer: BufferGauges) -> bool:
        """Backpressure before the work is done: while the buffer holds a full load of groups, actors start no
        new ones (generating them would only make stale data and take CPU from the learner). Groups in
        flight still finish and are delivered."""
        return buffer.ready_groups >= self.capacity_groups

    def take(self, report: LearnerReport) -> bool:
        """Move to where the learner's report says it is; True when the report repeats the step before (the
        closing report of a learner that made no step since)."""
        repeated = report.step == self.learner_step and report.step > 0
        self.learner_step, self.weight_version, self.weight_epoch = (report.step, report.weight_version,
                                                                     report.weight_epoch)
        self.finished = report.final
        return repeated

    def scalars(self, step: int) -> dict[str, float]:
        """The budget ``step`` trained under, and the next one's."""
        return {"schedule/max_turns": float(self.turn_budget.max_turns(step)),
                "schedule/next_max_turns": float(self.max_turns)}
