"""One process of a run, started by its role (``horizonrl coordinator|buffer|learner|actor --config ...``):
the wiring every role shares — its log format, its CPU cores — then its part's ``main``.

Pinning is here, at the start of the program, because it changes the process itself (its affinity, and for
an actor the environment its vLLM engine inherits): the plan of which cores is the bottom layer's
(``core/placement.py``), applying it is the program's.
"""

from __future__ import annotations

import logging
import os
import sys

from horizonrl.core.config import ConfigError, TrainConfig
from horizonrl.core.placement import cpus_of, engine_cpus_of, vllm_cpu_binding

log = logging.getLogger("horizonrl")


def run_role(role: str, config: TrainConfig, index: int = 0) -> int:
    """Start ``role`` (actor number ``index``) from a resolved config; returns its exit code."""
    from horizonrl.core.runtime import exit_skipping_finalization, setup_logging

    if not config.network.resolved:
        print("error: this config has unresolved ports (0); start the run with `horizonrl train`, or pass "
              "the config.yaml it wrote to the run's output directory", file=sys.stderr)
        return 2
    name = {"actor": f"actor-{index}", "learner": f"learner-{os.environ.get('RANK', '0')}"}.get(role, role)
    setup_logging(name, config.run.log_level)
    follow_the_launcher(config, role, name)
    cpus = pin_to_cpus(config, role, index)
    if cpus is not None:
        log.info("%s runs on CPU cores %s (resources)", name, cpus)
    if role == "coordinator":
        from horizonrl.coordinator import main as coordinator_main

        return coordinator_main(config)
    if role == "buffer":
        from horizonrl.buffer.server import main as buffer_main

        return buffer_main(config)
    if role == "learner":
        from horizonrl.learner.main import main as learner_main

        exit_skipping_finalization(learner_main(config))  # its gloo groups can abort finalization
    from horizonrl.actors.actor import main as actor_main
    from horizonrl.envs import make_env

    # The actor has shut its engine down and closed its sockets and outbox; finalization would only run the
    # exit hooks of what vLLM imported (Ray's, when Ray is installed, imports more of Ray: tens of seconds on
    # a loaded host, past the launcher's stop grace).
    exit_skipping_finalization(actor_main(config, index, make_env))
    return 0  # not reached: exit_skipping_finalization exits


def follow_the_launcher(config: TrainConfig, role: str, name: str) -> None:
    """Stop this process once the launcher that started it is gone (``stop_when_launcher_dies``), with an event
    that says so. It gets the time its role gets from the launcher's own stop, and more: the learner
    ``monitor.stop_timeout_s`` (it may be finishing its step), the others a minute."""
    from horizonrl.core.run_events import EventLog, RunEvent
    from horizonrl.core.runtime import stop_when_launcher_dies

    events = EventLog(config.output_dir, name)
    grace_s = config.monitor.stop_timeout_s + 30.0 if role == "learner" else 60.0
    stop_when_launcher_dies(lambda pid: events.emit(RunEvent.LAUNCHER_GONE, launcher_pid=pid),
                            log_path=config.run_dir.log(name), grace_s=grace_s)


def _check_allowed(cpus: list[int], what: str) -> None:
    allowed = os.sched_getaffinity(0)
    missing = sorted(set(cpus) - allowed)
    if missing:
        raise ConfigError(f"resources: {what} is given CPU cores {missing} that this process may not use "
                          f"(allowed: {sorted(allowed)})")


def pin_to_cpus(config: TrainConfig, role: str, index: int = 0) -> list[int] | None:
    """Restrict this process, and every process it starts from now on, to its cores (``cpus_of``); an actor's
    vLLM engine binds its OpenMP threads to the engine's cores (``engine_cpus_of``, through
    ``VLLM_CPU_OMP_THREADS_BIND``; by default vLLM-CPU binds to cores of its own choosing) and, when those differ
    from the actor's, is started on them (``RolloutEngine.start(cpus=...)``). Returns the process's cores, or
    None when the config gives none."""
    cpus = cpus_of(config, role, index)
    name = f"actor {index}" if role == "actor" else role
    if cpus is not None:
        _check_allowed(cpus, name)
    if role == "actor":
        engine_cpus = engine_cpus_of(config, index)
        if engine_cpus is not None:
            _check_allowed(engine_cpus, f"the engine of actor {index}")
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = vllm_cpu_binding(
                engine_cpus, config.rollout.engine.tensor_parallel_size)
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    return cpus
