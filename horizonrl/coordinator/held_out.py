"""Held-out evaluation during training (``eval.every``): when to ask actor 0 for one, how each result is
dated and charted, and the plateau that ends training early (``eval.stop_after_plateau``).

At step 0 (or the step a run resumes from), every ``eval.every`` steps and at the learner's last step,
``Control.eval_step`` asks actor 0 for an evaluation; its ``HeldOutEval`` is charted as ``eval/success_rate``
and ``eval/<env>/...`` at that step (or at the step of the oldest weights that played it, when the engine
had moved past the step asked for). After the last step the run stays open (rollout paused) until that
evaluation is in, at most ``eval.final_wait_s``.
"""

from __future__ import annotations

import logging
import time

from horizonrl.core.config import EvalConfig
from horizonrl.protocol import HeldOutEval, LearnerReport

log = logging.getLogger("horizonrl.coordinator")


class HeldOutPlateau:
    """``eval.stop_after_plateau``: reached once ``patience`` evaluations in a row have not beaten the best
    held-out success so far by more than ``min_delta`` (never with ``patience`` 0). The first evaluation
    sets the best; only progress moves it, so a slow climb (rises below ``min_delta`` that add up) still
    counts as progress once it has added up. A reached plateau stays reached."""

    def __init__(self, patience: int, min_delta: float) -> None:
        self.patience = patience
        self.min_delta = min_delta
        self.best = float("-inf")
        self.best_step = -1
        self.without_progress = 0
        self.reached = False

    def add(self, step: int, success: float) -> bool:
        """Count one evaluation (in step order); True when this one reaches the plateau."""
        if not self.patience or self.reached:
            return False
        if success > self.best + self.min_delta or self.best_step < 0:
            self.best, self.best_step, self.without_progress = success, step, 0
            return False
        self.without_progress += 1
        self.reached = self.without_progress >= self.patience
        return self.reached


class HeldOutSchedule:
    """Which step's evaluation is asked for (``eval_step``, -1: none), which were charted, and (after the
    learner's last step) until when the run waits for the last one."""

    def __init__(self, settings: EvalConfig, start_step: int) -> None:
        self.settings = settings
        self.eval_step = start_step if settings.every else -1
        self.evaluated_steps: set[int] = set()
        self.final_deadline: float | None = None  # time.monotonic()
        self.plateau = HeldOutPlateau(settings.stop_after_plateau, settings.plateau_min_delta)

    def awaiting_final(self, finished: bool) -> bool:
        """The learner is done, but the held-out evaluation of its last step is not in yet (nor overdue)."""
        if not finished or self.final_deadline is None or self.eval_step in self.evaluated_steps:
            return False
        if time.monotonic() < self.final_deadline:
            return True
        log.warning("no held-out evaluation of step %d within eval.final_wait_s=%.0f s; stopping without it",
                    self.eval_step, self.settings.final_wait_s)
        self.final_deadline = None
        return False

    def after_report(self, report: LearnerReport) -> None:
        """Ask for a held-out evaluation every ``eval.every`` steps and after the last one."""
        every = self.settings.every
        if not every or report.startup:
            return
        if report.step > self.eval_step and (report.step % every == 0 or report.final):
            self.eval_step = report.step
        if report.final and self.eval_step not in self.evaluated_steps and self.final_deadline is None:
            self.final_deadline = time.monotonic() + self.settings.final_wait_s
            log.info("waiting up to %.0f s for the held-out evaluation of step %d", self.settings.final_wait_s,
                     self.eval_step)

    def evaluator_died(self) -> None:
        """Actor 0 died while the last step's evaluation was awaited: after the learner's last step the
        launcher restarts nothing, so it will not come."""
        log.warning("actor-0 died during the held-out evaluation of the last step; stopping without it")
        self.final_deadline = None

    def take(self, result: HeldOutEval) -> tuple[int, dict[str, float]] | None:
        """The step to chart ``result`` at and its scalars; None for one already charted (a restarted actor 0
        may repeat it). The step is that of the oldest weights that played it: the step asked for, or later
        when the engine had moved on by then (a step-0 evaluation that actor 0 could only start after the
        learner's first steps is not the starting policy, and the curve must not say it is)."""
        if result.learner_step in self.evaluated_steps:
            return None
        self.evaluated_steps.add(result.learner_step)
        return max(result.learner_step, result.weight_versions[0]), held_out_scalars(result)


def held_out_scalars(result: HeldOutEval) -> dict[str, float]:
    """``eval/<env>/<metric>`` per environment, and ``eval/success_rate`` over all of them (successes over
    valid episodes: infrastructure failures are not the agent's doing and are left out, as in docs/evaluation.md)."""
    scalars: dict[str, float] = {}
    successes = valid = 0.0
    for env, metrics in sorted(result.results.items()):
        for key, value in metrics.items():
            scalars[f"eval/{env}/{key}"] = float(value)
        valid += metrics.get("episodes_valid", 0.0)
        successes += metrics.get("success_rate", 0.0) * metrics.get("episodes_valid", 0.0)
    if valid:
        scalars["eval/success_rate"] = successes / valid
    scalars["eval/episodes_valid"] = valid
    scalars["eval/weight_version_min"], scalars["eval/weight_version_max"] = (float(v) for v in result.weight_versions)
    scalars["eval/wall_s"] = result.wall_s
    return scalars
