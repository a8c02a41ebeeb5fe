"""A fair engine-bound comparison on a CPU host: learner and engines on cores of their own (``--partition``).

On a GPU cluster the learner and the engines run on separate devices; on a CPU host they compete
for the same cores, and the comparison with bare engines then measures the contention as much as
the design. A partition gives the learner's side (learner ranks, coordinator, buffer) half the
cores and each actor — its process, its vLLM engine and their OpenMP threads — one core of its
own (``resources.learner_cpus`` / ``resources.actor_cpus``, applied by each process at start:
``core/placement.py``). The bare engines are then measured on the *same* actor cores.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class CorePartition:
    learner: tuple[int, ...]  # learner ranks, coordinator, buffer
    actors: tuple[tuple[int, ...], ...]  # one core set per actor (and per bare engine)

    @classmethod
    def of_this_host(cls) -> "CorePartition":
        """The cores this process may use: the first half (at least one) to the learner's side, each of the
        others to an actor of its own."""
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            raise RuntimeError(f"--partition needs at least 2 CPU cores; this process may use {cpus}")
        split = max(1, len(cpus) // 2)
        return cls(tuple(cpus[:split]), tuple((c,) for c in cpus[split:]))

    @property
    def actor_cores(self) -> set[int]:
        return {c for cores in self.actors for c in cores}

    def overrides(self) -> list[str]:
        """The training run's config overrides: one actor per actor core set, each process on its cores."""
        actors = ", ".join("[" + ", ".join(map(str, cores)) + "]" for cores in self.actors)
        return [f"rollout.num_actors={len(self.actors)}",
                f"resources.learner_cpus=[{', '.join(map(str, self.learner))}]",
                f"resources.actor_cpus=[{actors}]"]

    def describe(self) -> str:
        actors = "; ".join(f"actor {i} (its client, engine core and worker) on core(s) {list(cores)}"
                           for i, cores in enumerate(self.actors))
        return f"learner, coordinator and buffer on core(s) {list(self.learner)}; {actors}"
