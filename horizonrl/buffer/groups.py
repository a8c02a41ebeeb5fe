"""Group assembly, staleness filtering and batching: the buffer's logic, free of sockets.

Invariant: every trajectory that enters ``add`` is, at any moment, exactly one of
(a) waiting in an incomplete group, (b) in a complete group waiting for the learner,
(c) handed to the learner in a batch, or (d) dropped and counted under one reason in
``dropped`` (infrastructure failure, stale, equal rewards, group timeout, group too small).

Groups whose rewards are all equal carry no GRPO signal and are skipped, but the newest of
them are kept aside: once the policy solves (or fails) nearly every task, informative groups
become rare, and a learner waiting only for them would starve. When a request has waited
long enough or seen enough of them, ``take(..., allow_equal=True)`` tops the batch up with those groups (their
advantages are zero; the step still advances the schedule and the weight version).
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field

from horizonrl.protocol import FAILURE_NONE, Trajectory

# Reasons a trajectory is dropped (keys of GroupBuffer.dropped, counted in trajectories).
DROP_FAILURE = "infra_failure"
DROP_STALE = "stale"
DROP_EQUAL_REWARDS = "equal_rewards"
DROP_TIMEOUT = "group_timeout"
DROP_TOO_SMALL = "group_too_small"


@dataclass
class _PendingGroup:
    size: int
    first_seen: float
    members: list[Trajectory] = field(default_factory=list)
    failed: int = 0

    @property
    def arrived(self) -> int:
        return len(self.members) + self.failed


class GroupBuffer:
    def __init__(
        self,
        *,
        capacity_groups: int,
        max_staleness: int,
        skip_equal_reward_groups: bool,
        group_timeout_s: float,
        clock=time.monotonic,
    ) -> None:
        self.capacity_groups = capacity_groups
        self.max_staleness = max_staleness
        self.skip_equal_reward_groups = skip_equal_reward_groups
        self.group_timeout_s = group_timeout_s
        self._clock = clock
        self._pending: dict[str, _PendingGroup] = {}
        self._ready: OrderedDict[str, list[Trajectory]] = OrderedDict()
        self._equal: deque[list[Trajectory]] = deque()  # newest equal-reward groups, at most capacity
        self.dropped: Counter[str] = Counter()
        self.received = 0
        self.served_groups = 0
        self.served_trajectories = 0
        self.served_equal_groups = 0
        self.equal_groups_seen = 0  # equal-reward groups completed so far (a saturation signal)

    # ---- intake -------------------------------------------------------------------
    @property
    def full(self) -> bool:
        """True when the learner has not kept up: stop taking trajectories (backpressure)."""
        return len(self._ready) >= self.capacity_groups

    def add(self, traj: Trajectory) -> None:
        self.received += 1
        group = self._pending.get(traj.group_id)
        if group is None:
            group = self._pending[traj.group_id] = _PendingGroup(traj.group_size, self._clock())
        if traj.failure != FAILURE_NONE:
            # Infrastructure failures are never trained on; the rest of the group still is.
            group.failed += 1
            self.dropped[DROP_FAILURE] += 1
        else:
            group.members.append(traj)
        if group.arrived >= group.size:
            del self._pending[traj.group_id]
            self._complete(traj.group_id, group.members)

    def _complete(self, group_id: str, members: list[Trajectory]) -> None:
        if len(members) < 2:
            self.dropped[DROP_TOO_SMALL] += len(members)
            return
        if self.skip_equal_reward_groups and len({t.reward for t in members}) == 1:
            self.equal_groups_seen += 1
            self._equal.append(members)
            if len(self._equal) > self.capacity_groups:
                self.dropped[DROP_EQUAL_REWARDS] += len(self._equal.popleft())
            return
        self._ready[group_id] = members

    def expire(self) -> None:
        """Drop groups that stayed incomplete for longer than ``group_timeout_s`` (an actor died)."""
        now = self._clock()
        for gid in [g for g, p in self._pending.items() if now - p.first_seen > self.group_timeout_s]:
            self.dropped[DROP_TIMEOUT] += len(self._pending.pop(gid).members)

    # ---- output -------------------------------------------------------------------
    def drop_stale(self, learner_version: int) -> None:
        for gid in [g for g, m in self._ready.items() if self._staleness(m, learner_version) > self.max_staleness]:
            self.dropped[DROP_STALE] += len(self._ready.pop(gid))
        fresh = deque()
        for members in self._equal:
            if self._staleness(members, learner_version) > self.max_staleness:
                self.dropped[DROP_EQUAL_REWARDS] += len(members)
            else:
                fresh.append(members)
        self._equal = fresh

    def take(self, num_groups: int, learner_version: int, allow_equal: bool = False) -> list[list[Trajectory]] | None:
        """``num_groups`` groups, oldest first, after dropping stale ones; None if not enough yet.

        With ``allow_equal``, equal-reward groups (newest first) fill what informative ones lack.
        """
        self.drop_stale(learner_version)
        missing = num_groups - len(self._ready)
        if missing > 0 and not (allow_equal and len(self._equal) >= missing):
            return None
        batch = [self._ready.popitem(last=False)[1] for _ in range(min(num_groups, len(self._ready)))]
        for _ in range(max(0, missing)):
            batch.append(self._equal.pop())
            self.served_equal_groups += 1
        self.served_groups += len(batch)
        self.served_trajectories += sum(len(g) for g in batch)
        return batch

    @staticmethod
    def _staleness(members: list[Trajectory], learner_version: int) -> int:
        return learner_version - min(t.oldest_version for t in members)

    # ---- accounting ---------------------------------------------------------------
    @property
    def ready_groups(self) -> int:
        return len(self._ready)

    @property
    def pending_groups(self) -> int:
        return len(self._pending)

    def held_trajectories(self) -> int:
        return (sum(len(m) for m in self._ready.values()) + sum(len(p.members) for p in self._pending.values())
                + sum(len(m) for m in self._equal))

    def stats(self) -> dict[str, float]:
        out = {
            "received": float(self.received),
            "ready_groups": float(self.ready_groups),
            "pending_groups": float(self.pending_groups),
            "served_groups": float(self.served_groups),
            "served_equal_reward_groups": float(self.served_equal_groups),
            "dropped_total": float(sum(self.dropped.values())),
        }
        out.update({f"dropped_{k}": float(v) for k, v in self.dropped.items()})
        return out
