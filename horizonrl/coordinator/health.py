"""The health of the run's processes, from their heartbeats: who is alive, and their counters and gauges
added up across incarnations (protocol/counters.py says which is which)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TypeVar

import msgspec

from horizonrl.core.coordinator_state import IncarnationCounters
from horizonrl.protocol import Heartbeat
from horizonrl.protocol.counters import ActorCounters, added, read_counters

T = TypeVar("T", bound=msgspec.Struct)


@dataclass
class ProcessHealth:
    """Liveness and counters of every process, by incarnation: a restarted process starts its
    cumulative counters from 0 again, so totals add every incarnation's last heartbeat."""

    last_seen: dict[tuple[str, int], float] = field(default_factory=dict)
    current_pid: dict[tuple[str, int], int] = field(default_factory=dict)
    counters: dict[tuple[str, int, int], dict[str, float]] = field(default_factory=dict)  # (role, index, pid)

    def beat(self, hb: Heartbeat) -> dict[str, float] | None:
        """Record a heartbeat; returns the previous incarnation's last counters when this one is new."""
        key = (hb.role, hb.index)
        previous = self.current_pid.get(key)
        self.last_seen[key] = time.monotonic()
        self.current_pid[key] = hb.pid
        self.counters[(hb.role, hb.index, hb.pid)] = hb.counters
        if previous is not None and previous != hb.pid:
            return self.counters.get((hb.role, hb.index, previous), {})
        return None

    def silent(self, timeout_s: float) -> list[str]:
        now = time.monotonic()
        return [f"{r}-{i}" for (r, i), t in self.last_seen.items() if now - t > timeout_s]

    def total(self, kind: type[T]) -> T:
        """Counters of ``kind`` over every incarnation of every process of its role."""
        return added(kind, [read_counters(kind, c) for (r, _, _), c in self.counters.items() if r == kind.role])

    def gauges(self, kind: type[T]) -> T:
        """Gauges of ``kind`` over the current incarnations only: a dead process's last value is not the state of
        anything any more."""
        return added(kind, [read_counters(kind, self.current(r, i)) for (r, i) in self.current_pid if r == kind.role])

    def levels(self, kind: type[T], within_s: float) -> list[T]:
        """The gauges of ``kind`` of each current incarnation heard from within ``within_s``, one per process (a
        silent process is not the state of anything: it may be dead and not coming back)."""
        now = time.monotonic()
        return [read_counters(kind, self.current(r, i)) for (r, i) in self.current_pid
                if r == kind.role and now - self.last_seen.get((r, i), float("-inf")) <= within_s]

    def current(self, role: str, index: int) -> dict[str, float]:
        pid = self.current_pid.get((role, index))
        return self.counters.get((role, index, pid), {}) if pid is not None else {}

    def incarnations(self) -> list[IncarnationCounters]:
        return [IncarnationCounters(role, index, pid, dict(counters), self.current_pid.get((role, index)) == pid)
                for (role, index, pid), counters in self.counters.items()]

    def restore(self, incarnations: list[IncarnationCounters]) -> None:
        """A restarted coordinator's health: the counters of every incarnation as last heard, liveness timed
        from now (a process that is gone shows up as silent after the heartbeat timeout)."""
        now = time.monotonic()
        for inc in incarnations:
            self.counters[(inc.role, inc.index, inc.pid)] = dict(inc.counters)
            if inc.current:
                self.current_pid[(inc.role, inc.index)] = inc.pid
                self.last_seen[(inc.role, inc.index)] = now


class RolloutWindow:
    """What the actors did between two learner steps, from their cumulative counters.

    ``rollout/success_rate`` counts every episode the actors finished (no filtering), so
    unlike ``batch/success_mean`` it is not biased by the buffer dropping equal-reward
    groups; it rises only if new weights reach the actors.
    """

    def __init__(self) -> None:
        self._last: tuple[float, ActorCounters] | None = None

    def update(self, health: ProcessHealth) -> dict[str, float]:
        now = time.monotonic()
        totals = health.total(ActorCounters)
        out: dict[str, float] = {}
        if self._last is not None and now > self._last[0]:
            dt = now - self._last[0]
            last = self._last[1]
            out["rollout/tokens_per_s"] = (totals.generated_tokens - last.generated_tokens) / dt
            out["rollout/episodes_per_s"] = (totals.episodes - last.episodes) / dt
            completed = totals.completed - last.completed
            if completed > 0:
                out["rollout/success_rate"] = (totals.successes - last.successes) / completed
                out["rollout/reward_mean"] = (totals.reward_sum - last.reward_sum) / completed
        self._last = (now, totals)
        return out
