"""How many groups an actor keeps in flight: fixed, or adapted to the engine's KV-cache use.

Under a rising turn budget (ScalingInter-RL) an episode's context grows stage by stage: a number of groups in
flight that fits the KV cache at 6 turns overflows it at 20, and the engine preempts requests — it drops their
KV blocks and recomputes them later, generating nothing for them meanwhile. :class:`InFlightController` keeps
the engine's KV-cache use inside a band instead: fewer groups when the cache is fuller than ``high`` or the
engine preempted, more when it is emptier than ``low`` and the actor actually keeps its current number busy.

Hysteresis, so it does not oscillate on a signal that lags (an episode's context grows for as long as it
runs; a group started now fills the cache only turns later): the band between ``low`` and ``high`` holds; a
decision waits ``hold_s`` after the last change, and after a decrease until the slots above the new number
have finished their groups; it reads the peak use since its last decision (a peak is what preempts, and one
reading between two decode steps may miss it).

:class:`EngineLoad` is what the engine reports (``RolloutEngine.load``), filled by :class:`EngineLoadLogger`,
a vLLM stat logger (``AsyncLLM(stat_loggers=...)``: vLLM calls it in this process with each batch of engine
outputs; the fields it reads are checked against the installed vLLM in ``engine_api.py``). Nothing here
imports vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class EngineLoad:
    """The engine's KV-cache use and preemptions, as its scheduler last reported them."""

    kv_cache_usage: float = 0.0  # share of KV blocks in use, 0-1 (the latest report)
    peak_kv_cache_usage: float = 0.0  # the highest since ``take_peak`` last read it
    running: int = 0  # requests the scheduler runs
    waiting: int = 0  # requests waiting for KV blocks or a batch slot
    preemptions: int = 0  # requests preempted so far (cumulative)
    reports: int = 0  # scheduler reports received: 0 means the engine does not report (an older vLLM)

    def take_peak(self) -> float:
        """The peak use since the last call; starts the next window at the current use."""
        peak, self.peak_kv_cache_usage = self.peak_kv_cache_usage, self.kv_cache_usage
        return max(peak, self.kv_cache_usage)


class EngineLoadLogger:
    """A vLLM stat logger that writes the scheduler's KV-cache use and the preemptions into an
    :class:`EngineLoad` (the interface of ``vllm.v1.metrics.loggers.StatLoggerBase``, duck-typed so this module
    does not import vLLM)."""

    def __init__(self, load: EngineLoad) -> None:
        self.load = load

    def record(self, scheduler_stats: Any, iteration_stats: Any, *args: Any, **kwargs: Any) -> None:
        load = self.load
        if scheduler_stats is not None:
            load.kv_cache_usage = float(scheduler_stats.kv_cache_usage)
            load.peak_kv_cache_usage = max(load.peak_kv_cache_usage, load.kv_cache_usage)
            load.running, load.waiting = int(scheduler_stats.num_running_reqs), int(scheduler_stats.num_waiting_reqs)
            load.reports += 1
        if iteration_stats is not None:
            load.preemptions += int(iteration_stats.num_preempted_reqs)

    def log_engine_initialized(self) -> None:
        pass

    def log(self) -> None:
        pass

    def record_sleep_state(self, *args: Any, **kwargs: Any) -> None:
        pass


def load_logger_factory(load: EngineLoad):
    """The factory vLLM's ``stat_loggers`` takes (called with the engine's config and index)."""
    return lambda vllm_config=None, engine_index=0: EngineLoadLogger(load)


@dataclass(frozen=True)
class InFlightBand:
    """``rollout.concurrency``'s settings: the band of KV-cache use to stay in, and the bounds on groups."""

    low: float = 0.6
    high: float = 0.9
    min_groups: int = 1
    max_groups: int = 16
    hold_s: float = 5.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.low < self.high <= 1.0:
            raise ValueError(f"the KV-cache band needs 0 <= low < high <= 1, got low={self.low}, high={self.high}")
        if not 1 <= self.min_groups <= self.max_groups:
            raise ValueError(f"groups in flight need 1 <= min <= max, got {self.min_groups}, {self.max_groups}")


@dataclass(frozen=True)
class InFlightDecision:
    groups: int  # the new number of groups in flight
    changed: bool
    reason: str  # "preempted", "above_band", "below_band", "in_band", "holding", "settling", "not_busy", "no_report"


class InFlightController:
    """The number of groups in flight, adapted to the engine's KV-cache use (the module docstring).

    Shrinks by a quarter (at least one group) when the engine preempted since the last decision or the peak
    use is above ``high``; grows by one when the peak is below ``low`` and every group slot is busy; otherwise
    holds. Always within ``[min_groups, max_groups]``."""

    def __init__(self, band: InFlightBand, start: int) -> None:
        self.band = band
        self.groups = min(max(start, band.min_groups), band.max_groups)
        self._last_change = float("-inf")
        self._preemptions = 0
        self.changes = 0

    def decide(self, *, now: float, peak_usage: float, preemptions: int, busy_groups: int,
               reporting: bool = True) -> InFlightDecision:
        """One decision from the engine's peak KV-cache use since the last one, its cumulative ``preemptions``
        and the groups running now."""
        preempted = preemptions > self._preemptions
        self._preemptions = max(self._preemptions, preemptions)
        if not reporting:
            return InFlightDecision(self.groups, False, "no_report")
        if now - self._last_change < self.band.hold_s:
            return InFlightDecision(self.groups, False, "holding")
        if busy_groups > self.groups:
            # A decrease has not taken effect yet: the slots above the number are finishing their groups, whose
            # contexts are what fills the cache now. Judging the cache before they end would cut again, for the
            # same excess (measured: 4 -> 1 in 10 s where 2 was enough).
            return InFlightDecision(self.groups, False, "settling")
        if preempted or peak_usage > self.band.high:
            target, reason = self.groups - max(1, self.groups // 4), "preempted" if preempted else "above_band"
        elif peak_usage < self.band.low:
            if busy_groups < self.groups:  # the slots are not all used: more would not be used either
                return InFlightDecision(self.groups, False, "not_busy")
            target, reason = self.groups + 1, "below_band"
        else:
            return InFlightDecision(self.groups, False, "in_band")
        target = min(max(target, self.band.min_groups), self.band.max_groups)
        changed = target != self.groups
        if changed:
            self.groups, self._last_change = target, now
            self.changes += 1
        return InFlightDecision(self.groups, changed, reason)
