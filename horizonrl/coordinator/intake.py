"""What the coordinator reads on its report socket: every message is read once and counted by what became
of it — handled (``coordinator/accepted_<kind>``), undecodable (``coordinator/bad_messages_<error>``), or
well-formed but rejected: not this run's truth (``protocol/report_checks.py``: an unknown process or
environment, a number out of range, a learner report that would take the run back), or, for the kinds
that change the run's state, without the run's key (``coordinator/rejected_<kind>_<reason>``). Nothing a
peer sends can stop the coordinator."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping

from horizonrl.core.config import TrainConfig
from horizonrl.core.runtime import RateLimitedLog
from horizonrl.core.schedule import TurnBudgetSchedule
from horizonrl.protocol import Heartbeat, LearnerReport, Message, ProtocolError, decode, signed_by
from horizonrl.protocol.report_checks import (KEYED_KINDS, REJECT_UNAUTHENTICATED, RunShape,
                                              heartbeat_incarnation_problem, learner_report_order_problem,
                                              report_problem)

log = logging.getLogger("horizonrl.coordinator")

MAX_REPORT_BYTES = 16 * 1024 * 1024


class ReportIntake:
    def __init__(self, config: TrainConfig, run_key: str) -> None:
        self.run_id = config.run.run_id
        self.shape = run_shape(config)
        self.run_key = run_key  # "": a run without a key; nothing to check
        self.messages_read = 0
        self.bad_messages: Counter[str] = Counter()  # by kind: ProtocolError, ForeignRunError, UnexpectedMessage
        self.accepted: Counter[str] = Counter()  # handled, by kind (the message's tag)
        self.rejected: Counter[str] = Counter()  # <kind>_<reason>: well-formed, not this run's truth
        self._bad_log = RateLimitedLog(log)

    def accept(self, data: bytes, handled: tuple[type, ...], learner_step: int, weight_epoch: int,
               registered_pids: Mapping[str, int] | None = None) -> Message | None:
        """The message in ``data`` if it is one of the ``handled`` kinds and this run's truth (the learner at
        ``learner_step`` of ``weight_epoch`` so far; ``registered_pids``: each name's newest registration's pid);
        else None, counted."""
        self.messages_read += 1
        try:
            message = decode(data, MAX_REPORT_BYTES, self.run_id)
        except ProtocolError as exc:
            self.bad_messages[type(exc).__name__] += 1
            self._bad_log.warning("rejected malformed report #%d: %s", sum(self.bad_messages.values()), exc)
            return None
        if not isinstance(message, handled):
            self.bad_messages["UnexpectedMessage"] += 1
            self._bad_log.warning("unexpected %s on the report socket", type(message).__name__)
            return None
        kind = type(message).__struct_config__.tag
        problem = self._authority_problem(message) or report_problem(message, self.shape)
        if problem is None and isinstance(message, LearnerReport):
            problem = learner_report_order_problem(message, learner_step, weight_epoch)
        if problem is None and isinstance(message, Heartbeat):
            problem = heartbeat_incarnation_problem(message, registered_pids or {})
        if problem is not None:
            self.reject(message, *problem)
            return None
        self.accepted[kind] += 1
        return message

    def reject(self, message: Message, reason: str, detail: str) -> None:
        """Count (and log, rate-limited) a well-formed message that is not this run's truth."""
        kind = type(message).__struct_config__.tag
        self.rejected[f"{kind}_{reason}"] += 1
        self._bad_log.warning("rejected %s #%d (%s): %s", kind, sum(self.rejected.values()), reason, detail)

    def _authority_problem(self, message) -> tuple[str, str] | None:
        """The kinds that change the run's state come only from processes holding the run's key."""
        if not self.run_key or not isinstance(message, KEYED_KINDS):
            return None
        if signed_by(message, self.run_key):
            return None
        return REJECT_UNAUTHENTICATED, "not signed with the run's key (<output_dir>/run_key)"

    def scalars(self, restarts: int) -> dict[str, float]:
        """Every message on the report socket is read once and counted by what became of it (and its kind)."""
        scalars = {"coordinator/messages_read": float(self.messages_read),
                   "coordinator/bad_messages": float(sum(self.bad_messages.values())),
                   "coordinator/rejected": float(sum(self.rejected.values())),
                   "coordinator/restarts": float(restarts)}
        for prefix, counts in (("bad_messages", self.bad_messages), ("rejected", self.rejected),
                               ("accepted", self.accepted)):
            scalars.update({f"coordinator/{prefix}_{kind}": float(n) for kind, n in counts.items()})
        return scalars


def run_shape(config: TrainConfig) -> RunShape:
    """Who may report what in this run (protocol/report_checks.py)."""
    schedule = TurnBudgetSchedule.from_config(config.algorithm.rounds_ctrl)
    return RunShape(num_actors=config.rollout.num_actors, learner_ranks=config.learner.num_ranks,
                    env_names=frozenset(spec.name for spec in config.envs), total_steps=config.learner.total_steps,
                    max_turns=max(max(config.algorithm.rounds_ctrl.rounds), schedule.final_max_turns,
                                  config.eval.max_turns or 0),
                    env_servers=len(config.envs))
