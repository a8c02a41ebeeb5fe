"""``launcher.type=inline``: a whole run in this one process, every role a thread — the coordinator, the buffer, the
learner (one rank) and each actor, whose vLLM engine still runs in the processes vLLM starts for it.

For debugging (one log; a ``breakpoint()`` in any role's code stops that role's thread in the terminal of
``horizonrl train CONFIG launcher.type=inline --verbose``) and for the tests of the loop's logic. The roles are the
same code as in a local run and talk over the same protocol on the same loopback sockets; only what starts them
differs. The supervisor is the one every launcher uses (launcher/supervisor.py), over :class:`InlineRoles`, which
starts a role's thread, "signals" it through its own stop flag, and reports its exit code. What needs processes
is not here: a thread cannot be killed, so no role is restarted (a dead role ends the run), ``chaos`` and
``fault`` have nothing to kill, and every role shares this process's cores and memory (``resources.*`` pinning
is refused). A Ctrl-C in a terminal reaches vLLM's engine processes too (they are in this process's group): the
actors are stopping by then anyway.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path
from typing import Callable

import psutil

from horizonrl.actors.actor import run_actor
from horizonrl.buffer.server import run_buffer
from horizonrl.coordinator.process import run_coordinator
from horizonrl.core.config import ConfigError, TrainConfig
from horizonrl.core.run_events import EventLog, RunEvent
from horizonrl.core.runtime import StopFlag
from horizonrl.launcher.console import RunConsole, route_line
from horizonrl.launcher.launch import logging_to_console, run_to_the_end
from horizonrl.launcher.local import QUIET_VLLM_LEVEL, Launcher
from horizonrl.launcher.resolve import check_model_path, managed_env_servers, prepare_run, resolve_placement
from horizonrl.envs import make_env
from horizonrl.launcher.supervisor import ProcessSpec
from horizonrl.learner.main import run_learner
from horizonrl.learner.services import RankInfo

log = logging.getLogger("horizonrl.launcher")

ROLE_STOP_WAIT_S = 60.0  # at close, how long each role's thread may take to end after its stop


class InlineRoles:
    """The supervisor's backend for roles that are threads of this process (``ProcessBackend``)."""

    restartable: frozenset[str] = frozenset()  # a thread that died cannot be cleaned up after: the run ends

    def __init__(self, config: TrainConfig, status_out: Callable[[str], None]) -> None:
        self.config = config
        self.status_out = status_out  # the coordinator's step status records (the console's status block)
        self.threads: dict[str, threading.Thread] = {}
        self.stops: dict[str, StopFlag] = {}
        self.codes: dict[str, int] = {}  # exit codes of the roles that returned, not yet polled
        self._exited = threading.Condition()
        self.events = EventLog(config.output_dir, "launcher")

    def start(self, spec: ProcessSpec) -> None:
        if spec.name in self.threads:
            raise RuntimeError(f"{spec.name}: an inline run does not start a role twice")
        stop = StopFlag()
        run = self._role(spec, stop)
        thread = threading.Thread(target=self._run, args=(spec.name, run), name=spec.name, daemon=True)
        self.threads[spec.name], self.stops[spec.name] = thread, stop
        thread.start()
        log.info("started %s (a thread of this process)", spec.name)
        self.events.emit(RunEvent.PROCESS_STARTED, name=spec.name, pid=os.getpid())

    def _role(self, spec: ProcessSpec, stop: StopFlag) -> Callable[[], int]:
        """The role's own entry point, the one its process would run, with ``stop`` for its stop signal."""
        config = self.config
        if spec.role == "coordinator":
            return lambda: run_coordinator(config, stop, self.status_out)
        if spec.role == "buffer":
            return lambda: run_buffer(config, stop)
        if spec.role == "learner":
            ranks = RankInfo(rank=0, world_size=1, local_rank=0, master_addr=config.network.host,
                             master_port=config.network.dist_port)
            return lambda: run_learner(config, ranks, stop)
        if spec.role == "actor":
            index = int(spec.name.split("-", 1)[1])
            return lambda: run_actor(config, index, stop, make_env)
        raise ConfigError(f"launcher.type=inline runs the coordinator, buffer, learner and actors, not {spec.name}")

    def _run(self, name: str, run: Callable[[], int]) -> None:
        try:
            code = run()
        except BaseException:  # noqa: BLE001 - the role's failure is its exit code, as a process's would be
            log.exception("%s failed", name)
            code = 1
        with self._exited:
            self.codes[name] = code
            self._exited.notify_all()

    def poll(self, wait_s: float) -> list[tuple[str, int | None]]:
        with self._exited:
            if not self.codes:
                self._exited.wait(wait_s)
            exits, self.codes = list(self.codes.items()), {}
        return exits

    def running(self, name: str) -> bool:
        thread = self.threads.get(name)
        return thread is not None and thread.is_alive()

    def signal(self, name: str, sig: int, *, group: bool = False) -> None:
        stop = self.stops.get(name)
        if stop is not None:
            stop.request(signal.Signals(sig).name)

    def kill(self, name: str) -> None:
        if self.running(name):
            log.warning("%s: a thread cannot be killed; it was asked to stop again and is left to end", name)
            self.signal(name, signal.SIGKILL)

    def learner_gang(self, *extra: str) -> list[ProcessSpec]:
        return [ProcessSpec("learner-0", ["learner", *extra], essential=True)]

    def close(self) -> None:
        for name in self.stops:
            self.signal(name, signal.SIGTERM)
        stuck = []
        for name, thread in self.threads.items():
            thread.join(ROLE_STOP_WAIT_S)
            if thread.is_alive():
                stuck.append(name)
                log.error("%s did not end within %.0f s of its stop (left behind: the process exits without it)",
                          name, ROLE_STOP_WAIT_S)
        if stuck:
            end_child_processes()


def end_child_processes(grace_s: float = 5.0) -> None:
    """What a role left behind did not shut down (an actor stuck before its engine's shutdown): this process's
    children (vLLM's engine processes), SIGTERM then SIGKILL after ``grace_s``, each named in the log."""
    children = psutil.Process().children(recursive=True)
    for child in children:
        try:
            log.warning("ending pid %d (%s), left by a role that did not stop", child.pid,
                        " ".join(child.cmdline()[:3]))
            child.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(children, timeout=grace_s)
    for child in alive:
        try:
            child.kill()
        except psutil.Error:
            pass


def check_inline(config: TrainConfig) -> None:
    """What an inline run cannot do, refused before anything starts."""
    if config.learner.num_ranks != 1:
        raise ConfigError(f"launcher.type=inline runs one learner rank, not learner.num_ranks="
                          f"{config.learner.num_ranks} (ranks are processes: use launcher.type=local)")
    if managed_env_servers(config):
        raise ConfigError("launcher.type=inline does not start environment servers (managed: true): start the server "
                          "yourself and give its url, or use launcher.type=local")
    r = config.resources
    pinned = [name for name in ("learner_cpus", "actor_cpus", "engine_cpus") if getattr(r, name)]
    if pinned:
        raise ConfigError(f"launcher.type=inline runs every role on this process's cores: resources.{pinned[0]} "
                          "cannot pin one of them (use launcher.type=local)")


def import_what_the_roles_import(config: TrainConfig) -> None:
    """Import, in this thread and before any role starts, the libraries the roles import lazily. Two threads that
    import the same package tree at once can each hold a module the other needs: Python then hands one of them
    a partly initialized module (seen: transformers' generation utilities and accelerate, from the learner's model
    and the actor's engine, "cannot import name 'AlignDevicesHook' from partially initialized module")."""
    import importlib

    import transformers

    for module in ("transformers.generation", "transformers.models.auto.modeling_auto", "vllm.engine.arg_utils",
                   "vllm.v1.engine.async_llm", "vllm.sampling_params"):
        importlib.import_module(module)
    model_config = transformers.AutoConfig.from_pretrained(config.model.path)
    transformers.AutoModelForCausalLM.from_config  # noqa: B018 - the lazy class itself
    importlib.import_module(type(model_config).__module__.replace("configuration_", "modeling_"))
    transformers.AutoTokenizer.from_pretrained(config.model.path)


def launch_inline(config: TrainConfig, *, verbose: bool = False) -> int:
    """``horizonrl train CONFIG launcher.type=inline``: the run to its end in this process; the exit code."""
    check_inline(config)
    plan = resolve_placement(config)
    check_model_path(config)
    config, path = prepare_run(config)
    if not verbose:  # vLLM's INFO lines (its configuration, every shutdown step) stay out, as a local run's do
        os.environ.setdefault("VLLM_LOGGING_LEVEL", QUIET_VLLM_LEVEL)
    import_what_the_roles_import(config)
    console = RunConsole.for_stdout(title=f"run {config.run.name} (inline)", total=config.learner.total_steps,
                                    verbose=verbose)
    roles = InlineRoles(config, lambda line: route_line(console, "coordinator", line, verbose=verbose))
    launcher = Launcher(config, path, console=console, plan=plan, backend=roles)
    stop = StopFlag().install()
    log_path = config.run_dir.log("inline")
    print(f"run {config.run.name} inline (pid {os.getpid()}): {config.rollout.num_actors} actors, 1 learner rank, "
          f"{config.learner.total_steps} steps; its log in {log_path}", flush=True)
    with logging_to_console(console, Path(log_path), verbose=verbose, name="%(threadName)s"):
        return run_to_the_end(launcher, console, stop, launcher.start_all)
