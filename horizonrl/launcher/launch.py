"""``horizonrl train``: a run from its config to its end — resolve it, start its processes with the launcher
``launcher.type`` names (local subprocesses, Ray actors; Slurm writes a batch script instead), watch them
until the run ends, stop them — with this process's log on the console and in ``<output_dir>/logs``."""

from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from horizonrl.core.config import ConfigError, TrainConfig
from horizonrl.core.runtime import StopFlag
from horizonrl.launcher.console import RunConsole
from horizonrl.launcher.local import Launcher
from horizonrl.launcher.resolve import (AUTO_HOST, check_model_path, prepare_cluster_run, prepare_run,
                                       resolve_placement)

log = logging.getLogger("horizonrl.launcher")


def launch(config: TrainConfig, *, tensorboard: bool = False, verbose: bool = False) -> int:
    """Run training to the end; returns the exit code (0 on success). ``verbose``: the console shows every
    line every process writes, not only what goes wrong. ``launcher.type`` says what starts the processes."""
    if config.launcher.type == "ray":
        if tensorboard:
            log.warning("--tensorboard is not started by launcher.type=ray: run tensorboard --logdir %s",
                        config.run_dir.tensorboard)
        return launch_ray(config, verbose=verbose)
    if config.launcher.type == "slurm":
        raise ConfigError("launcher.type=slurm runs as a batch job: write it with `horizonrl slurm CONFIG > "
                          "job.sbatch` and submit it with `sbatch job.sbatch` (docs/cluster.md)")
    if config.network.host == AUTO_HOST:
        raise ConfigError("network.host=auto is for the cluster launchers (the coordinator's node address); a local "
                          "run binds loopback (the default) or the address you give")
    # Placement and the model first: a run that cannot start is refused before anything is written or started.
    plan = resolve_placement(config)
    check_model_path(config)
    config, path = prepare_run(config)
    launcher = Launcher(config, path, tensorboard=tensorboard, verbose=verbose, plan=plan)
    console = launcher.console
    stop = StopFlag().install()
    print(f"run {config.run.name}: {config.rollout.num_actors} actors, {config.learner.num_ranks} learner rank(s), "
          f"{config.learner.total_steps} steps; logs in {launcher.log_dir}", flush=True)
    with logging_to_console(console, launcher.log_dir / "launcher.log", verbose=verbose):
        log.info("%s", plan.table())  # which GPUs each process got, for the record
        return run_to_the_end(launcher, console, stop, launcher.start_all)


def run_to_the_end(launcher, console: RunConsole, stop: StopFlag, start: Callable[[], None]) -> int:
    """Every launcher's life: ``start()`` its processes, ``launcher.watch(stop)`` until the run ends, then
    ``launcher.stop_all(stop)`` whatever happened (a failed start too). The exit code: 0 finished, 130
    stopped, 1 failed."""
    rc = 1
    try:
        start()
        console.set_phase("starting")
        rc = launcher.watch(stop)
        if rc == 130:
            console.line("stopping: actors start no new episodes, the learner saves a checkpoint (Ctrl-C again "
                         "to force)")
        console.set_phase("stopping")
    finally:
        launcher.stop_all(stop)
        console.close({0: "finished", 130: "stopped"}.get(rc, "failed"))
    return rc


class _ConsoleHandler(logging.Handler):
    def __init__(self, console: RunConsole, level: int, by_thread: bool = False) -> None:
        super().__init__(level)
        self.console = console
        self.by_thread = by_thread  # an inline run: each role is a thread, named for it

    def emit(self, record: logging.LogRecord) -> None:
        try:
            who = record.threadName if self.by_thread else "launcher"
            self.console.line(f"{time.strftime('%H:%M:%S', time.localtime(record.created))} [{who}] "
                              f"{record.levelname} {record.getMessage()}")
        except Exception:  # noqa: BLE001 - logging must never raise into the launcher
            self.handleError(record)


@contextmanager
def logging_to_console(console: RunConsole, path: Path, *, verbose: bool, name: str = "launcher") -> Iterator[None]:
    """While the run lasts, this process's log records go to ``path`` (from INFO) and to the console (from
    WARNING; INFO with ``verbose``), through the console so that they never tear its live block. ``name`` heads
    each record (a logging format: the inline run names the role's thread)."""
    root, own = logging.getLogger(), logging.getLogger("horizonrl")
    path.parent.mkdir(parents=True, exist_ok=True)
    to_file = logging.FileHandler(path)
    to_file.setLevel(logging.INFO)
    to_file.setFormatter(logging.Formatter(f"%(asctime)s {name}[{os.getpid()}] %(levelname)s %(name)s: %(message)s",
                                           datefmt="%H:%M:%S"))
    to_console = _ConsoleHandler(console, logging.INFO if verbose else logging.WARNING, by_thread=name != "launcher")
    saved_level = own.level
    own.setLevel(logging.INFO)
    root.addHandler(to_file)
    root.addHandler(to_console)
    try:
        yield
    finally:
        root.removeHandler(to_console)
        root.removeHandler(to_file)
        own.setLevel(saved_level)
        to_file.close()


def launch_ray(config: TrainConfig, *, verbose: bool = False) -> int:
    """``horizonrl train CONFIG launcher.type=ray``: the run on a Ray cluster (or a Ray instance started here)."""
    try:
        import ray  # noqa: F401
    except ImportError:
        raise ConfigError("launcher.type=ray needs Ray: pip install 'horizonrl[ray]' (or 'ray[default]')") from None
    from horizonrl.launcher.ray_cluster import RayLauncher  # Ray only for a Ray run

    console = RunConsole.for_stdout(title=f"run {config.run.name} (Ray)", total=config.learner.total_steps,
                                    verbose=verbose)
    launcher = RayLauncher(config, console, verbose=verbose)
    stop = StopFlag().install()
    log_dir = config.run_dir.logs
    print(f"run {config.run.name} on Ray: {config.rollout.num_actors} actors, {config.learner.num_ranks} learner "
          f"rank(s), {config.learner.total_steps} steps; logs in {log_dir}", flush=True)

    def start() -> None:
        started = time.monotonic()
        launcher.start_all(lambda host, control, report: prepare_cluster_run(config, host, control, report))
        log.info("every process placed in %.1f s", time.monotonic() - started)

    with logging_to_console(console, log_dir / "launcher.log", verbose=verbose):
        return run_to_the_end(launcher, console, stop, start)
