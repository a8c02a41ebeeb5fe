"""Where training is — completed learner steps, the newest weights — and what that means for the actors:
the turn budget of the episodes they start now (a pure function of the step, ScalingInter-RL's schedule,
so a resumed run matches an uninterrupted one at every step) and the rollout pause (backpressure)."""

from __future__ import annotations

from horizonrl.core.config import TrainConfig
from horizonrl.core.schedule import TurnBudgetSchedule
from horizonrl.protocol import LearnerReport
from horizonrl.protocol.counters import ActorGauges, BufferGauges


class TrainingProgress:
    def __init__(self, config: TrainConfig, start_step: int) -> None:
        self.turn_budget = TurnBudgetSchedule.from_config(config.algorithm.rounds_ctrl)
        self.capacity_groups = config.buffer.capacity_groups
        # The groups that can still be trained within max_staleness versions (see rollout_paused).
        self.staleness_window_groups = max(1, config.buffer.max_staleness) * config.learner.groups_per_step
        self.learner_step = start_step
        self.weight_version = start_step
        self.weight_epoch = 0  # the learner's incarnation: its startup report says which
        self.finished = False

    @property
    def max_turns(self) -> int:
        """The turn budget for episodes started now."""
        return self.turn_budget.budget_after(self.learner_step)

    def rollout_paused(self, buffer: BufferGauges, actors: ActorGauges | None = None) -> bool:
        """Backpressure before the work is done, on two bounds; actors start no new groups while either holds
        (groups in flight still finish and are delivered):

        - the buffer holds ``capacity_groups`` complete groups;
        - staleness-bounded admission (as AReaL bounds its rollout, arXiv 2505.24298): the groups made and being made,
          ready + running = P, already fill the next max_staleness learner batches, P ≥ η·B (η = max_staleness,
          B = groups_per_step). A group started now waits for the P ahead of it: it is trained at the
          (⌊P/B⌋ + 1)-th step from now, by weights ⌊P/B⌋ versions past its own, so once P ≥ η·B it could only be
          trained staler than η, i.e. dropped. Generating it would only take CPU from the learner.
        """
        if buffer.ready_groups >= self.capacity_groups:
            return True
        running = actors.groups_running if actors is not None else 0.0
        return buffer.ready_groups + running >= self.staleness_window_groups

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
