"""``launcher.type=local``: the run's processes as subprocesses of this one, each in its own process group (so
the engine processes vLLM spawns stop with it), its output read line by line into ``<output_dir>/logs/`` and
to the console. :class:`LocalProcesses` is the backend the supervisor starts, polls and signals;
:class:`Launcher` is what ``horizonrl train`` runs: which processes a run has, and where they run.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Callable

from horizonrl.core.config import TrainConfig
from horizonrl.core.placement import PlacementPlan
from horizonrl.core.programs import role_command, tensorboard_command
from horizonrl.core.run_events import EventLog, RunEvent
from horizonrl.core.runtime import LAUNCHER_PID_ENV, StopFlag
from horizonrl.launcher.console import RunConsole, route_line
from horizonrl.launcher.resolve import managed_env_servers, resolve_placement, server_url
from horizonrl.launcher.supervisor import ProcessBackend, ProcessSpec, Supervisor
from horizonrl.protocol.transport import held_ports_env, hold_port

log = logging.getLogger("horizonrl.launcher")

# vLLM's level in the children unless --verbose (or VLLM_LOGGING_LEVEL is set): its warnings stay in
# their logs, its INFO lines (a configuration dump per engine, every shutdown step) do not.
QUIET_VLLM_LEVEL = "WARNING"


@dataclass
class Child:
    """One incarnation of a process started here."""

    spec: ProcessSpec
    proc: subprocess.Popen
    threads: list[threading.Thread] = field(default_factory=list)
    reported: bool = False  # its exit was returned by a poll


def _pump(stream: IO[bytes], log_file: IO[bytes], name: str, on_line: Callable[[str, str], None]) -> None:
    """Every line of a child's output into its log file, then to ``on_line`` (which decides what the console shows).

    A log file that cannot be written (a full disk) does not stop the pump: the child's lines still reach
    ``on_line``, and the pipe keeps draining (a child writing into a full pipe would block); once the file
    can be written again it says how many lines it lost meanwhile."""
    lost = 0
    for raw in iter(stream.readline, b""):
        try:
            if lost:
                log_file.write(f"[launcher: {lost} lines of this log were lost: it could not be written]\n".encode())
            log_file.write(raw)
            lost = 0
        except OSError:
            lost += 1
        on_line(name, raw.decode(errors="replace").rstrip("\r\n"))
    stream.close()
    try:
        log_file.close()
    except OSError:
        pass


class LocalProcesses:
    """Subprocesses, one process group each. An exited child stays known until its name starts again (its
    group may hold leftovers: killed then) or the backend closes."""

    restartable = frozenset({"actor", "buffer", "env", "coordinator"})

    def __init__(self, config: TrainConfig, plan: PlacementPlan, on_line: Callable[[str, str], None], *,
                 verbose: bool = False) -> None:
        self.config = config
        self.plan = plan
        self.on_line = on_line
        self.verbose = verbose
        self.children: dict[str, Child] = {}
        self.retired: list[Child] = []  # earlier incarnations, killed and reaped at close
        self.events = EventLog(config.output_dir, "launcher")

    def start(self, spec: ProcessSpec) -> None:
        previous = self.children.pop(spec.name, None)
        if previous is not None:
            self.retired.append(previous)
        log_dir = self.config.run_dir.logs
        log_dir.mkdir(parents=True, exist_ok=True)
        log_file = open(self.config.run_dir.log(spec.name), "ab", buffering=0)  # each line written whole, or lost whole
        quiet = {} if self.verbose or "VLLM_LOGGING_LEVEL" in os.environ else {"VLLM_LOGGING_LEVEL": QUIET_VLLM_LEVEL}
        proc = subprocess.Popen(
            spec.argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **quiet, **spec.env,
                 LAUNCHER_PID_ENV: str(os.getpid())},  # it stops itself if this process dies (SIGKILL)
            start_new_session=True,  # its own process group: stopping it stops what it spawned
            pass_fds=spec.pass_fds,
        )
        child = Child(spec, proc)
        t = threading.Thread(target=_pump, args=(proc.stdout, log_file, spec.name, self.on_line), daemon=True)
        t.start()
        child.threads.append(t)
        self.children[spec.name] = child
        log.info("started %s (pid %d)", spec.name, proc.pid)
        self.events.emit(RunEvent.PROCESS_STARTED, name=spec.name, pid=proc.pid)

    def poll(self, wait_s: float) -> list[tuple[str, int | None]]:
        exits = []
        for name, child in self.children.items():
            rc = child.proc.poll()
            if rc is not None and not child.reported:
                child.reported = True
                exits.append((name, rc))
        if not exits:
            threading.Event().wait(wait_s)
        return exits

    def running(self, name: str) -> bool:
        child = self.children.get(name)
        return child is not None and child.proc.poll() is None

    def signal(self, name: str, sig: int, *, group: bool = False) -> None:
        child = self.children.get(name)
        if child is not None:
            (_signal_group if group else _signal_leader)(child.proc.pid, sig)

    def kill(self, name: str) -> None:
        child = self.children.get(name)
        if child is not None:
            _signal_group(child.proc.pid, signal.SIGKILL)  # the child leads its group: its leftovers go too
            try:
                child.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                log.error("%s (pid %d) did not die after SIGKILL", name, child.proc.pid)

    def learner_gang(self, *extra: str) -> list[ProcessSpec]:
        return [ProcessSpec(f"learner-{rank}", role_command("learner", str(self.config.run_dir.config), *extra),
                            self.learner_env(rank), essential=True)
                for rank in range(self.config.learner.num_ranks)]

    def learner_env(self, rank: int) -> dict[str, str]:
        """torchrun's variables, plus the rank's GPU from the plan (on a GPU it sees that one GPU as cuda:0)."""
        cfg = self.config
        return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(cfg.learner.num_ranks),
                "MASTER_ADDR": cfg.network.host, "MASTER_PORT": str(cfg.network.dist_port),
                **self.plan.child_env(self.plan.learner[rank])}

    def close(self) -> None:
        everyone = [*self.retired, *self.children.values()]
        for child in everyone:
            # Kill the group even if the leader exited: engine processes may linger.
            _signal_group(child.proc.pid, signal.SIGKILL)
            child.proc.wait()
        for child in everyone:
            for t in child.threads:
                t.join(timeout=5)


def _signal_leader(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # the child leads its own group (start_new_session), so pgid == pid
    except ProcessLookupError:
        pass


class Launcher:
    """A run on this host: which processes, with which devices (core/placement.py: each child's
    CUDA_VISIBLE_DEVICES comes from the plan, restarts included), supervised."""

    def __init__(self, config: TrainConfig, config_path: Path, *, tensorboard: bool = False, verbose: bool = False,
                 console: RunConsole | None = None, plan: PlacementPlan | None = None,
                 backend: ProcessBackend | None = None) -> None:
        """``backend``: what starts the processes (default: :class:`LocalProcesses`; the inline run's threads,
        apps/inline_run.py, which share this process's ports and so get none held for them)."""
        self.config = config
        self.config_path = config_path
        self.plan = plan if plan is not None else resolve_placement(config)
        self.tensorboard = tensorboard
        self.console = console or RunConsole.for_stdout(title=f"run {config.run.name}",
                                                        total=config.learner.total_steps, verbose=verbose)
        self.log_dir = config.run_dir.logs
        self.processes = backend or LocalProcesses(config, self.plan, lambda name, line: route_line(
            self.console, name, line, verbose=verbose), verbose=verbose)
        self.supervisor = Supervisor(config, self.processes)
        # The coordinator's two ports, held here for the whole run and handed to each coordinator incarnation: a
        # restarted coordinator always binds them again, and no other process can take them while it restarts.
        net = config.network
        self.held_ports = ({port: hold_port(net.bind_address(), port) for port in (net.control_port, net.report_port)}
                           if net.resolved and backend is None else {})

    def specs(self) -> list[ProcessSpec]:
        """Every process of the run but the learner's ranks (``LocalProcesses.learner_gang``)."""
        cfg, path = self.config, str(self.config_path)
        held = self.held_ports
        specs = [ProcessSpec("coordinator", role_command("coordinator", path), held_ports_env(held), essential=True,
                             pass_fds=tuple(sock.fileno() for sock in held.values())),
                 ProcessSpec("buffer", role_command("buffer", path))]
        specs += [ProcessSpec(name, argv, health_url=server_url(argv)) for name, argv in managed_env_servers(cfg)]
        specs += [ProcessSpec(f"actor-{i}", role_command("actor", path, index=i),
                              self.plan.child_env(self.plan.actors[i])) for i in range(cfg.rollout.num_actors)]
        return specs

    def start_all(self) -> None:
        coordinator, buffer, *others = self.specs()
        self.supervisor.start(coordinator)
        self.supervisor.start(buffer)
        self.supervisor.start_learner()
        for spec in others:
            self.supervisor.start(spec)
        if self.tensorboard:
            self.start_tensorboard()

    def start_tensorboard(self) -> None:
        port = self.config.monitor.tensorboard_port
        self.supervisor.start(ProcessSpec("tensorboard", tensorboard_command(str(self.config.run_dir.tensorboard),
                                                                             port)))
        self.console.line(f"TensorBoard: http://127.0.0.1:{port}/")

    def watch(self, stop: StopFlag) -> int:
        return self.supervisor.watch(stop, self.console.tick)

    def stop_all(self, stop: StopFlag | None = None) -> None:
        try:
            self.supervisor.stop_all(stop)
        finally:
            for sock in self.held_ports.values():
                sock.close()
