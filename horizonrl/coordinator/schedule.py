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
        self.max_staleness = config.buffer.max_staleness
        self.groups_per_step = config.learner.groups_per_step
        self.learner_step = start_step
        self.weight_version = start_step
        self.weight_epoch = 0  # the learner's incarnation: its startup report says which
        self.finished = False

    @property
    def max_turns(self) -> int:
        """The turn budget for episodes started now."""
        return self.turn_budget.budget_after(self.learner_step)

    def rollout_paused(self, buffer: BufferGauges, actors: list[ActorGauges] | None = None) -> bool:
        """Backpressure before the work is done, on two bounds; actors start no new groups while either holds
        (groups in flight still finish and are delivered):

        - the buffer holds ``capacity_groups`` complete groups;
        - staleness-bounded admission (as AReaL bounds its rollout, arXiv 2505.24298): a group started now
          could only be trained staler than η = max_staleness, i.e. be dropped, so generating it would only take
          CPU from the learner. With s learner steps done, P groups ready or being played ahead of it, B groups
          per step and engines holding weights L versions behind the learner (the newest weights not yet
          received: L = s − the oldest live engine's version), it is served ⌈(P + 1) / B⌉ batches from now, to
          a learner at version s + ⌈(P + 1) / B⌉, with its oldest token of version s − L: staleness
          L + ⌈(P + 1) / B⌉, at most η exactly while P < (η − L)·B; never paused below one batch ahead.
        """
        if buffer.ready_groups >= self.capacity_groups:
            return True
        actors = actors or []
        ahead = buffer.ready_groups + sum(a.groups_running for a in actors)
        if self.max_staleness == 0:  # every group would be one version stale: only the capacity bounds it
            return ahead >= self.groups_per_step
        lag = max(0, self.weight_version - min((int(a.weight_version) for a in actors), default=self.weight_version))
        # Never below one batch ahead (what the synchronous loop keeps): an engine that lags far, frozen or dropped
        # from the weight hub, must not pause every actor and starve the learner (the frozen-engine test saw a
        # 58.6 s gap, the whole freeze, without this floor). Only a lagging engine's own groups risk being dropped.
        return ahead >= max(1, self.max_staleness - lag) * self.groups_per_step

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
