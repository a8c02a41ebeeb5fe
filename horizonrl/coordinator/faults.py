"""The run's fault ledger: deaths, restarts and give-ups the launcher reports, the episodes a dead actor
took with it, and each replacement's time to recover; counted under ``faults/`` in TensorBoard and written
one JSON line each to the run directory's ``faults.jsonl``.

A replacement has recovered when it can do its work again: an actor once its engine is up and joined the
weight hub (it holds the current weights), a buffer at its first heartbeat (after replaying its log), a
learner at its first step, an environment server when it answers /health (the launcher reports it), a
coordinator once it reads (it is the replacement).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Callable

from horizonrl.protocol import EVENT_DIED, EVENT_RECOVERED, EVENT_RESTARTED, Heartbeat, ProcessEvent
from horizonrl.protocol.counters import ActorCounters, ActorGauges, read_counters

log = logging.getLogger("horizonrl.coordinator")

WRITE_FAILURES = "coordinator_write_failures"


class FaultLedger:
    """``write_line(record)`` appends one record to faults.jsonl (False: it could not); ``changed()`` is called
    after every change worth saving (the coordinator's state); ``learner_step()`` dates the records."""

    def __init__(self, write_line: Callable[[dict], bool], changed: Callable[[], None],
                 learner_step: Callable[[], int]) -> None:
        self.faults: Counter[str] = Counter()  # faults/<role>_<event>, faults/episodes_lost, write failures
        self.recovering: dict[str, tuple[str, float, int]] = {}  # name -> (role, died at, pid or learner epoch then)
        self.recovery_s: dict[str, float] = {}  # role -> seconds from its last death to its recovery
        self._write_line = write_line
        self._changed = changed
        self._learner_step = learner_step

    def scalars(self) -> dict[str, float]:
        out = {f"faults/{key}": float(value) for key, value in self.faults.items()}
        out.update({f"faults/recovery_s/{role}": seconds for role, seconds in self.recovery_s.items()})
        return out

    def count_write_failure(self, written: bool) -> None:
        if not written:
            self.faults[WRITE_FAILURES] += 1

    def on_heartbeat(self, beat: Heartbeat, previous: dict[str, float] | None) -> None:
        """A heartbeat; ``previous``: the last counters of the incarnation before, when this one is new."""
        if previous is not None and beat.role == "actor":
            # The episodes the dead incarnation was playing were never produced: infrastructure failures.
            lost = read_counters(ActorGauges, previous).episodes_in_progress
            self.faults["episodes_lost"] += lost
            log.warning("actor-%d is back (pid %d); %d episodes it was playing were lost", beat.index, beat.pid, lost)
        name = f"{beat.role}-{beat.index}" if beat.role == "actor" else beat.role
        pending = self.recovering.get(name)
        if pending is not None and beat.role in ("actor", "buffer") and beat.pid != pending[2]:
            # A buffer is back at its first heartbeat (it replayed its log first); an actor once its
            # engine is up and has joined the weight hub (it holds the current weights and may play).
            if beat.role == "buffer" or read_counters(ActorCounters, beat.counters).weight_joins > 0:
                self.recovered(name)

    def on_process_event(self, event: ProcessEvent, then: Callable[[], int]) -> None:
        """The launcher's supervision decision. ``then()``, asked at a death: what will tell the replacement from
        the dead one (the learner's weight epoch, or the pid of the process's current incarnation)."""
        if event.event == EVENT_RECOVERED:
            if event.name in self.recovering:
                self.recovered(event.name)
            return
        self.faults[f"{event.role}_{event.event}"] += 1
        self._line({"event": event.event, "name": event.name, "role": event.role, "exit_code": event.exit_code,
                    "restarts": event.restarts, "delay_s": event.delay_s, "at": event.at,
                    "learner_step": self._learner_step()})
        if event.event == EVENT_RESTARTED and event.role == "coordinator" and event.name in self.recovering:
            self.recovered(event.name)  # this process is the replacement, and it is reading
        if event.event == EVENT_DIED:
            name = "learner" if event.role == "learner" else event.name
            # A process that dies again before it recovered: its time to recover counts from this death.
            self.recovering[name] = (event.role, event.at or time.time(), then())
        # INFO: the launcher, which decided it, has already said so on the console.
        log.info("%s %s%s", event.name, event.event,
                 f" (exit code {event.exit_code})" if event.exit_code is not None else
                 f" after {event.delay_s:.1f} s (restart {event.restarts})" if event.event == EVENT_RESTARTED else "")

    def learner_stepped(self, weight_epoch: int) -> None:
        """A restarted learner has recovered at its first step (a newer epoch than the one that died)."""
        pending = self.recovering.get("learner")
        if pending is not None and weight_epoch > pending[2]:
            self.recovered("learner")

    def recovered(self, name: str) -> None:
        role, died_at, _ = self.recovering.pop(name)
        seconds = time.time() - died_at
        self.faults[f"{role}_recovered"] += 1
        self.recovery_s[role] = seconds
        self._line({"event": "recovered", "name": name, "role": role, "recovery_s": round(seconds, 2),
                    "at": time.time(), "learner_step": self._learner_step()})
        log.info("%s recovered %.1f s after it died", name, seconds)

    def _line(self, record: dict) -> None:
        self.count_write_failure(self._write_line(record))
        self._changed()
