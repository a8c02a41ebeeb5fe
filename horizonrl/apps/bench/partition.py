"""A fair engine-bound comparison on a CPU host: learner and engines on cores of their own (``--partition``).

On a GPU cluster the learner and the engines run on separate devices; on a CPU host they compete
for the same cores, and the comparison with bare engines then measures the contention as much as
the design. A partition gives the learner's side (learner ranks, coordinator, buffer) half the
cores and each engine cores of its own, in one of two layouts:

- ``actors`` (the default): each whole actor — its own process (the client: event loop, environments,
  tokenizing, trajectories) and its vLLM engine's processes and OpenMP threads — on a core of its own
  (``resources.actor_cpus``), so the client's CPU work takes from its engine's core.
- ``engines``: each vLLM engine — its engine-core and worker processes and their OpenMP threads — alone on
  a core, as a GPU is the engine's alone; the actors' own processes run with the learner's side on the
  host's half, as a GPU host's CPUs run them beside the learner's (``resources.engine_cpus``). Measured
  (docs/benchmarks.md): the clients then take the learner's core and feed their engines later, and the
  ratio came out lower than with ``actors``.

The bare engines are measured in the same layout: each engine on its actor's engine cores, their client
where the actors' clients run. Each process applies its cores itself at start (``core/placement.py``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

LAYOUTS = ("actors", "engines")


@dataclass(frozen=True)
class CorePartition:
    learner: tuple[int, ...]  # learner ranks, coordinator, buffer
    engines: tuple[tuple[int, ...], ...]  # one core set per actor's engine (and per bare engine)
    layout: str = "actors"  # where the actors' clients run: "actors": with their engine; "engines": with the learner

    @classmethod
    def of_this_host(cls, layout: str = "actors") -> "CorePartition":
        """The cores this process may use: the first half (at least one) to the learner's side, each of the
        others to an engine of its own."""
        if layout not in LAYOUTS:
            raise RuntimeError(f"--partition layout {layout!r}: choose from {', '.join(LAYOUTS)}")
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            raise RuntimeError(f"--partition needs at least 2 CPU cores; this process may use {cpus}")
        split = max(1, len(cpus) // 2)
        return cls(tuple(cpus[:split]), tuple((c,) for c in cpus[split:]), layout)

    @property
    def client_cores(self) -> tuple[tuple[int, ...], ...]:
        """Where each actor's own process (and a bare engine's client) runs."""
        return tuple(self.learner for _ in self.engines) if self.layout == "engines" else self.engines

    def overrides(self) -> list[str]:
        """The training run's config overrides: one actor per engine core set, each process on its cores."""
        def lists(core_sets):
            return "[" + ", ".join("[" + ", ".join(map(str, cores)) + "]" for cores in core_sets) + "]"

        return [f"rollout.num_actors={len(self.engines)}",
                f"resources.learner_cpus=[{', '.join(map(str, self.learner))}]",
                f"resources.actor_cpus={lists(self.client_cores)}",
                f"resources.engine_cpus={lists(self.engines)}"]

    def describe(self) -> str:
        if self.layout == "engines":
            engines = "; ".join(f"engine {i} (engine core and worker) alone on core(s) {list(cores)}"
                                for i, cores in enumerate(self.engines))
            return (f"layout 'engines': learner, coordinator, buffer and the actors' clients on core(s) "
                    f"{list(self.learner)}; {engines}")
        actors = "; ".join(f"actor {i} (its client, engine core and worker) on core(s) {list(cores)}"
                           for i, cores in enumerate(self.engines))
        return f"layout 'actors': learner, coordinator and buffer on core(s) {list(self.learner)}; {actors}"
