"""The coordinator's status records: one line per learner step on its stdout, read by whichever launcher
started it (its console, ``launcher/console.py``). The line is ``STATUS_PREFIX`` + JSON, so that it survives
a pipe, a log file and Ray's or Slurm's log tailing unchanged, and a damaged one is merely not shown.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Mapping

STATUS_PREFIX = "status "

# The scalars a status record carries: what the block and the plain line show (the rest is in TensorBoard).
STATUS_KEYS = (
    "batch/reward_mean", "rollout/success_rate", "batch/success_mean", "batch/turns_mean", "schedule/max_turns",
    "schedule/next_max_turns", "batch/staleness_mean", "rollout/tokens_per_s", "throughput/learner_tokens_per_s",
    "time/step_s", "buffer/dropped_total", "rollout/groups_in_flight", "rollout/kv_cache_usage",
    "rollout/engine_preemptions",
)
STATUS_KEY_PREFIXES = ("faults/", "rollout/failures/")
BUFFER_GROUPS = "status/buffer_groups"  # ready groups in the buffer when the step was reported
BUFFER_CAPACITY = "status/buffer_capacity"


@dataclass(frozen=True)
class StepStatus:
    step: int
    total: int
    scalars: dict[str, float] = field(default_factory=dict)
    startup: bool = False  # the learner (re)started at this step; no step was trained yet


def status_record_line(step: int, total: int, scalars: Mapping[str, float], *, startup: bool = False) -> str:
    """The coordinator's line for the launcher: the step and the scalars the console shows."""
    kept = {k: float(v) for k, v in scalars.items() if k in STATUS_KEYS or k.startswith(STATUS_KEY_PREFIXES)
            or k in (BUFFER_GROUPS, BUFFER_CAPACITY)}
    return STATUS_PREFIX + json.dumps({"step": step, "total": total, "startup": startup, "scalars": kept},
                                      separators=(",", ":"))


def parse_status_line(line: str) -> StepStatus | None:
    """A status record, or None when ``line`` is not one (or is damaged: the console is no reason to stop)."""
    if not line.startswith(STATUS_PREFIX):
        return None
    try:
        data = json.loads(line[len(STATUS_PREFIX):])
        return StepStatus(int(data["step"]), int(data["total"]),
                          {str(k): float(v) for k, v in data.get("scalars", {}).items()}, bool(data.get("startup")))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
