"""The launcher: start every process of a run from one config, watch them, restart them, stop them.

It only starts, watches, restarts and stops: each role is a separate program
(``horizonrl coordinator|buffer|learner|actor --config run/config.yaml``) that can also
be started by hand for debugging. The launcher resolves free ports, writes the
resolved config next to the logs, owns the console (``launcher/console.py``: the run's status from
the coordinator's records, and one line for each thing that goes wrong; everything every process
writes goes to ``<output_dir>/logs/``, its own log to ``launcher.log``), and on Ctrl-C or SIGTERM
stops all of them — each in its own process group, so the engine processes vLLM spawns go too.

Supervision (``supervision.*``, docs/faults.md): a dead actor, buffer or managed environment
server — or the coordinator — is restarted after a back-off that doubles, at most ``max_restarts``
times per ``window_s``; a dead learner rank stops the other ranks and the learner restarts from its
newest checkpoint (``recover: auto``). Replacements find the others where their predecessors were (the
same ports): actors rejoin the weight hub at the current weights and resend their outboxes, a
buffer replays its log, a learner resumes from its checkpoint, a coordinator reads back the state it
left in the run directory and hears the rest from the others. A death past the limits stops the run
with a non-zero exit. Every decision is logged and sent to the
coordinator (``ProcessEvent``), which counts it under ``faults/`` and in ``faults.jsonl``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import defaultdict, deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Callable, Iterator

from horizonrl.core.config import ConfigError, SupervisionConfig, TrainConfig, dump_config
from horizonrl.launcher.console import RunConsole, shown_line
from horizonrl.protocol.status import parse_status_line
from horizonrl.core.placement import PlacementPlan, plan_placement, visible_gpus
from horizonrl.core.programs import horizonrl_command, role_command
from horizonrl.core.run_events import EventLog, RunEvent
from horizonrl.core.runtime import StopFlag
from horizonrl.protocol import EVENT_DIED, EVENT_GAVE_UP, EVENT_RECOVERED, EVENT_RESTARTED, ProcessEvent, encode
from horizonrl.protocol.transport import free_port, free_ports, is_loopback

log = logging.getLogger("horizonrl.launcher")

TERMINATE_GRACE_S = 20.0
ACTOR_STOP_S = 30.0  # an actor lets its last sends be acknowledged (10 s), then shuts its engine down
LEARNER_KILL_GRACE_S = 30.0  # the surviving ranks of a learner that lost one: SIGTERM, then SIGKILL
# vLLM's level in the children unless --verbose (or VLLM_LOGGING_LEVEL is set): its warnings stay in
# their logs, its INFO lines (a configuration dump per engine, every shutdown step) do not.
QUIET_VLLM_LEVEL = "WARNING"
RESTARTABLE = ("actor", "buffer", "env", "coordinator")
HEALTH_TIMEOUT_S = 0.5


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


class RestartPolicy:
    """Whether, and after what back-off, a process may be restarted: at most ``limit`` restarts within
    ``window_s`` per process; the first waits ``backoff_s``, each further one in the window twice as
    long (up to ``max_backoff_s``)."""

    def __init__(self, limit: int, window_s: float, backoff_s: float, max_backoff_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limit, self.window_s, self.backoff_s, self.max_backoff_s = limit, window_s, backoff_s, max_backoff_s
        self.clock = clock
        self._restarts: dict[str, deque[float]] = defaultdict(deque)

    @classmethod
    def for_processes(cls, cfg: SupervisionConfig) -> "RestartPolicy":
        return cls(cfg.max_restarts if cfg.restart else 0, cfg.window_s, cfg.backoff_s, cfg.max_backoff_s)

    @classmethod
    def for_learner(cls, cfg: SupervisionConfig) -> "RestartPolicy":
        return cls(cfg.max_learner_restarts if cfg.recover == "auto" else 0, cfg.window_s, cfg.backoff_s,
                   cfg.max_backoff_s)

    def recent(self, name: str) -> int:
        times, now = self._restarts[name], self.clock()
        while times and now - times[0] > self.window_s:
            times.popleft()
        return len(times)

    def next_delay(self, name: str) -> float | None:
        """The back-off before restarting ``name`` now, or None when it may not be restarted; records it."""
        recent = self.recent(name)
        if recent >= self.limit:
            return None
        self._restarts[name].append(self.clock())
        return min(self.max_backoff_s, self.backoff_s * 2 ** recent)


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    args: list[str]
    env: dict[str, str] | None
    essential: bool  # the run is over when every essential child has exited 0
    threads: list[threading.Thread] = field(default_factory=list)
    expected_exit: bool = False  # the launcher stopped it on purpose (a learner rank whose peer died)
    handled: bool = False  # its exit was dealt with

    @property
    def role(self) -> str:
        return self.name.split("-")[0]


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


class Launcher:
    def __init__(self, config: TrainConfig, config_path: Path, *, tensorboard: bool = False, verbose: bool = False,
                 console: RunConsole | None = None, plan: PlacementPlan | None = None) -> None:
        self.config = config
        self.config_path = config_path
        # Which devices each learner rank and engine gets (core/placement.py); each child's
        # CUDA_VISIBLE_DEVICES comes from it, restarts included (they reuse the child's env).
        self.plan = plan if plan is not None else resolve_placement(config)
        self.tensorboard = tensorboard
        self.verbose = verbose
        self.console = console or RunConsole.for_stdout(title=f"run {config.run.name}",
                                                        total=config.learner.total_steps, verbose=verbose)
        self.children: list[Child] = []
        self.log_dir = config.output_dir / "logs"
        self.restarts = RestartPolicy.for_processes(config.supervision)
        self.learner_restarts = RestartPolicy.for_learner(config.supervision)
        self._due: list[tuple[float, str, Callable[[], None]]] = []  # (when, what, start it)
        self._events = None  # a PUSH socket to the coordinator, made on first use
        self.run_events = EventLog(config.output_dir, "launcher")
        self._servers_recovering: dict[str, str] = {}  # restarted environment servers -> their URL

    # ------------------------------------------------------------------ starting

    def spawn(self, name: str, args: list[str], *, essential: bool, env: dict[str, str] | None = None) -> Child:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_file = open(self.log_dir / f"{name}.log", "ab", buffering=0)  # each line written whole, or lost whole
        quiet = {} if self.verbose or "VLLM_LOGGING_LEVEL" in os.environ else {"VLLM_LOGGING_LEVEL": QUIET_VLLM_LEVEL}
        proc = subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **quiet, **(env or {})},
            start_new_session=True,  # its own process group: stopping it stops what it spawned
        )
        child = Child(name, proc, args, env, essential)
        t = threading.Thread(target=_pump, args=(proc.stdout, log_file, name, self._child_line), daemon=True)
        t.start()
        child.threads.append(t)
        self.children.append(child)
        log.info("started %s (pid %d)", name, proc.pid)
        self.run_events.emit(RunEvent.PROCESS_STARTED, name=name, pid=proc.pid)
        return child

    def _child_line(self, name: str, line: str) -> None:
        """One line a child wrote (on that child's reader thread): the coordinator's status records feed the
        console's status; of the rest the console shows what says something is wrong (all with --verbose)."""
        status = parse_status_line(line) if name == "coordinator" else None
        if status is not None:
            self.console.status(status)
            return
        text = shown_line(name, line, verbose=self.verbose)
        if text is not None:
            self.console.line(text)

    def role_args(self, role: str, index: int | None = None, *extra: str) -> list[str]:
        return role_command(role, str(self.config_path), *extra, index=index)

    def start_all(self) -> None:
        cfg = self.config
        self.spawn("coordinator", self.role_args("coordinator"), essential=True)
        self.spawn("buffer", self.role_args("buffer"), essential=False)
        self.start_learner()
        for name, args in managed_env_servers(cfg):
            self.spawn(name, args, essential=False)
        for i in range(cfg.rollout.num_actors):
            self.spawn(f"actor-{i}", self.role_args("actor", i), essential=False, env=self.actor_env(i))
        if self.tensorboard:
            self.start_tensorboard()

    def start_learner(self, *extra: str) -> None:
        for rank in range(self.config.learner.num_ranks):
            self.spawn(f"learner-{rank}", self.role_args("learner", None, *extra), essential=True,
                       env=self.learner_env(rank))

    def learner_env(self, rank: int) -> dict[str, str]:
        """torchrun's variables, plus the rank's GPU from the plan (on a GPU it sees that one GPU as cuda:0)."""
        cfg = self.config
        return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(cfg.learner.num_ranks),
                "MASTER_ADDR": cfg.network.host, "MASTER_PORT": str(cfg.network.dist_port),
                **self.plan.child_env(self.plan.learner[rank])}

    def actor_env(self, index: int) -> dict[str, str] | None:
        """The engine's GPUs from the plan (tensor_parallel_size of them); None on the CPU: the environment as is."""
        return self.plan.child_env(self.plan.actors[index]) or None

    def start_tensorboard(self) -> None:
        port = self.config.monitor.tensorboard_port
        tb = [sys.executable, "-m", "tensorboard.main", "--logdir", str(self.config.output_dir / "tensorboard"),
              "--host", "127.0.0.1", "--port", str(port)]
        self.spawn("tensorboard", tb, essential=False)
        self.console.line(f"TensorBoard: http://127.0.0.1:{port}/")

    # ------------------------------------------------------------------ watching

    def learners(self) -> list[Child]:
        return [c for c in self.children if c.role == "learner" and not c.expected_exit]

    def learner_finished(self) -> bool:
        learners = self.learners()
        return bool(learners) and all(c.proc.poll() == 0 for c in learners) and not self._learner_pending()

    def _learner_pending(self) -> bool:
        return any(what == "learner" for _, what, _ in self._due)

    def watch(self, stop: StopFlag) -> int:
        """Wait until the essential processes finish (0), one dies past what supervision allows (1), or
        we are stopped (130); restart the others as they die."""
        while True:
            if stop:
                log.warning("stopping the run (%s)", stop.signal_name or "stop requested")
                self.run_events.emit(RunEvent.RUN_STOPPING, reason=stop.signal_name or "stop requested")
                return 130
            self._start_due()
            self._check_servers_recovered()
            for child in list(self.children):
                rc = child.proc.poll()
                if rc is None or child.handled:
                    continue
                child.handled = True
                outcome = self._on_exit(child, rc)
                if outcome is not None:
                    return outcome
            essential = [c for c in self.children if c.essential and not c.expected_exit]
            if not self._due and all(c.proc.poll() == 0 for c in essential):
                return 0
            self.console.tick()
            time.sleep(0.2)

    def _on_exit(self, child: Child, rc: int) -> int | None:
        """Deal with one exit; a return value ends the watch with it."""
        if child.expected_exit or child.role == "tensorboard":
            return None
        if child.role == "learner":
            if rc == 0:
                return None  # a rank that finished; the run ends when every essential process has
            return self._restart_learner(child, rc)
        if child.role == "coordinator" and rc == 0:
            return None  # after the learner's final report (or a stop signal)
        if rc == 0:
            # An actor that was told to stop (the run is ending); a buffer or server only stops on a signal.
            if child.role == "actor" or self.learner_finished():
                return None
            log.error("%s exited before the run finished; stopping the run", child.name)
            return 1
        if child.role not in RESTARTABLE:
            log.error("%s exited with code %d; stopping the run (see %s)", child.name, rc,
                      self.log_dir / f"{child.name}.log")
            return 1
        return self._restart(child, rc)

    def _restart(self, child: Child, rc: int) -> int | None:
        _signal_group(child.proc.pid, signal.SIGKILL)  # what it spawned (an engine's processes) goes with it
        self._report(child.name, EVENT_DIED, exit_code=rc)
        if self.learner_finished() and child.role != "coordinator":
            return None  # the run is over anyway (but for the coordinator, which ends it)
        delay = self.restarts.next_delay(child.name)
        if delay is None:
            log.error("%s exited with code %d; %s; stopping the run (see %s)", child.name, rc,
                      "restarts are off (supervision.restart)" if not self.config.supervision.restart else
                      f"it was restarted {self.restarts.recent(child.name)} times within "
                      f"{self.config.supervision.window_s:.0f} s", self.log_dir / f"{child.name}.log")
            self._report(child.name, EVENT_GAVE_UP, exit_code=rc)
            return 1
        restarts = self.restarts.recent(child.name)
        log.warning("%s exited with code %d; restarting it in %.1f s (restart %d of %d within %.0f s)", child.name, rc,
                    delay, restarts, self.restarts.limit, self.restarts.window_s)

        def start() -> None:
            self.children.remove(child)
            self.spawn(child.name, child.args, essential=child.essential, env=child.env)
            self._report(child.name, EVENT_RESTARTED, restarts=restarts, delay_s=delay)
            if child.role == "env":
                self._servers_recovering[child.name] = server_url(child.args)

        self._due.append((time.monotonic() + delay, child.name, start))
        return None

    def _restart_learner(self, dead: Child, rc: int) -> int | None:
        """A rank died: the others cannot go on (their collectives need it). Stop them, then start every
        rank again from the newest checkpoint."""
        self._report(dead.name, EVENT_DIED, exit_code=rc)
        survivors = [c for c in self.learners() if c is not dead and c.proc.poll() is None]
        delay = self.learner_restarts.next_delay("learner")
        if delay is None:
            log.error("%s exited with code %d; %s; stopping the run (see %s)", dead.name, rc,
                      "supervision.recover is off" if self.config.supervision.recover != "auto" else
                      f"the learner was restarted {self.learner_restarts.recent('learner')} times within "
                      f"{self.config.supervision.window_s:.0f} s", self.log_dir / f"{dead.name}.log")
            self._report("learner", EVENT_GAVE_UP, exit_code=rc)
            return 1
        restarts = self.learner_restarts.recent("learner")
        log.warning("%s exited with code %d; restarting the learner from its newest checkpoint in %.1f s (restart %d "
                    "of %d within %.0f s)", dead.name, rc, delay, restarts, self.learner_restarts.limit,
                    self.learner_restarts.window_s)
        _stop_group_members(survivors, LEARNER_KILL_GRACE_S)
        for child in self.learners():
            child.expected_exit = True
            _signal_group(child.proc.pid, signal.SIGKILL)

        def start() -> None:
            self.children = [c for c in self.children if not (c.role == "learner" and c.expected_exit)]
            self.start_learner("--resume", "auto")
            self._report("learner", EVENT_RESTARTED, restarts=restarts, delay_s=delay)

        self._due.append((time.monotonic() + delay, "learner", start))
        return None

    def _check_servers_recovered(self) -> None:
        """A restarted environment server has recovered once it answers /health (it sends no heartbeats)."""
        import urllib.request

        for name, url in list(self._servers_recovering.items()):
            try:
                with urllib.request.urlopen(url + "/health", timeout=HEALTH_TIMEOUT_S):
                    pass
            except OSError:
                continue
            del self._servers_recovering[name]
            log.info("%s answers again at %s", name, url)
            self._report(name, EVENT_RECOVERED)

    def _start_due(self) -> None:
        now = time.monotonic()
        for item in [d for d in self._due if d[0] <= now]:
            self._due.remove(item)
            item[2]()

    def _report(self, name: str, event: str, **fields) -> None:
        """Tell the coordinator (it counts faults/ and writes faults.jsonl); never blocks."""
        self.run_events.emit(RunEvent(f"process_{event}"), name=name, **fields)
        if self._events is None:
            self._events = CoordinatorEvents(self.config)
        self._events.report(name, event, **fields)

    # ------------------------------------------------------------------ stopping

    def stop_all(self, stop: StopFlag | None = None) -> None:
        """Stop in order, so nothing is lost and a checkpoint is written: first the actors (no new
        episodes; what they sent gets acknowledged) and the learner (finishes or abandons its step,
        saves), within ``monitor.stop_timeout_s``; then the buffer and the coordinator. A second
        stop signal (Ctrl-C again) kills everything at once. Whatever is left is killed, with the
        processes it spawned (each child leads its own process group)."""
        self._due.clear()
        # (roles, how long each may take) per phase; the actors' part of the first is short: they
        # only let their last sends be acknowledged.
        phases = [{"actor": ACTOR_STOP_S, "learner": self.config.monitor.stop_timeout_s},
                  {"buffer": TERMINATE_GRACE_S, "coordinator": TERMINATE_GRACE_S, "tensorboard": TERMINATE_GRACE_S,
                   "env": TERMINATE_GRACE_S}]
        for grace in phases:
            members = [c for c in self.children if c.role in grace and c.proc.poll() is None]
            for child in members:
                # The process alone: it stops what it spawned itself (an actor shuts its engine down
                # after its last sends). Signalled too, an engine core would die under the actor's
                # feet and flood its log with EngineDeadError. Leftovers are killed below.
                _signal_leader(child.proc.pid, signal.SIGTERM)
            start = time.monotonic()
            killed: set[str] = set()  # a killed process is not reaped at once: say so and kill it once
            while time.monotonic() - start < max(grace.values(), default=0):
                if stop is not None and stop.count >= 2:
                    log.warning("second stop signal: killing every process now")
                    break
                for child in members:
                    if (child.proc.poll() is None and child.name not in killed
                            and time.monotonic() - start > grace[child.role]):
                        log.warning("%s did not stop within %.0f s: killing it", child.name, grace[child.role])
                        _signal_group(child.proc.pid, signal.SIGKILL)
                        killed.add(child.name)
                if all(c.proc.poll() is not None for c in members):
                    break
                time.sleep(0.1)
            if stop is not None and stop.count >= 2:
                break
        for child in self.children:
            # Kill the group even if the leader exited: engine processes may linger.
            _signal_group(child.proc.pid, signal.SIGKILL)
            child.proc.wait()
        for child in self.children:
            for t in child.threads:
                t.join(timeout=5)
        if self._events is not None:
            self._events.close()


class CoordinatorEvents:
    """A launcher's supervision decisions to the coordinator (``ProcessEvent`` on its report socket), which
    counts them under faults/ and writes faults.jsonl. Sending never blocks: a full queue loses the event
    (logged), never the launcher's attention."""

    def __init__(self, config: TrainConfig) -> None:
        import zmq

        from horizonrl.protocol.transport import make_socket, wire_security

        from horizonrl.core.run_dirs import read_run_key

        self.config = config
        self.key = read_run_key(config.output_dir)  # the coordinator takes supervision events only with it
        context = zmq.Context.instance()
        self.security = wire_security(context, config.network.host, config.network.curve_keys_dir)
        self.socket = make_socket(context, zmq.PUSH, security=self.security)
        self.socket.connect(config.network.endpoint(config.network.report_port))

    def report(self, name: str, event: str, **fields) -> None:
        import zmq

        message = ProcessEvent(run_id=self.config.run.run_id, name=name, role=name.split("-")[0], event=event,
                               at=time.time(), key=self.key, **fields)
        try:
            self.socket.send(encode(message), zmq.NOBLOCK)
        except zmq.Again:
            log.warning("could not tell the coordinator that %s %s", name, event)

    def close(self) -> None:
        self.socket.close(linger=0)


def _stop_group_members(children: list[Child], grace_s: float) -> None:
    """SIGTERM each child's process group, wait up to ``grace_s`` for all, then SIGKILL what is left."""
    for child in children:
        _signal_group(child.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(c.proc.poll() is None for c in children):
        time.sleep(0.1)
    for child in children:
        _signal_group(child.proc.pid, signal.SIGKILL)
        try:
            child.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            log.error("%s (pid %d) did not die after SIGKILL", child.name, child.proc.pid)


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


def resolve_resume_setting(config: TrainConfig) -> TrainConfig:
    """``learner.resume=auto`` -> the newest complete checkpoint's directory (or no resume when there
    is none), fixed once here so that every process resumes from the same step."""
    from horizonrl.core.run_dirs import resolve_resume

    if config.learner.resume is None:
        return config
    path = resolve_resume(config.learner.resume, config.output_dir)
    if path is None:
        log.info("resume=auto: no checkpoint in %s yet; starting a fresh run", config.output_dir)
    else:
        print(f"resuming from {path}", flush=True)
    learner = config.learner.model_copy(update={"resume": None if path is None else str(path)})
    return config.model_copy(update={"learner": learner})


RUN_ID_FILE = "run_id"


def resolve_run_identity(config: TrainConfig, resuming: bool) -> TrainConfig:
    """The run's id: new for a new run, the one in ``<output_dir>/run_id`` when it resumes.

    A new run refuses a directory that holds another run's state (its log, checkpoints, actors'
    outboxes would be mixed with this one's); resuming needs ``resume=auto|PATH``."""
    id_file = config.output_dir / RUN_ID_FILE
    if resuming and id_file.is_file():
        run_id = id_file.read_text().strip()
    else:
        leftovers = [name for name in (RUN_ID_FILE, "checkpoints", "buffer_wal", "actors")
                     if (config.output_dir / name).exists()]
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
            servers.append((f"env-{i}", horizonrl_command("env", "serve", s["env"], "--host", host, "--port", port,
                                                           "--settings", json.dumps({s["env"]: s.get("env_settings", {})}))))
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
    from horizonrl.core.coordinator_state import remove_snapshot
    from horizonrl.core.run_dirs import ensure_run_key

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
    config = resolve_env_servers(config)
    start_launch(config.output_dir)
    path = config.output_dir / "config.yaml"
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
    path = config.output_dir / "config.yaml"
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
                      count_devices: Callable[[], int] | None = None) -> PlacementPlan:
    """The run's placement on this host's visible GPUs (ConfigError, naming the fix, if it cannot work)."""
    return plan_placement(config, visible_gpus(os.environ if environ is None else environ,
                                               count_devices or cuda_device_count))


def launch(config: TrainConfig, *, tensorboard: bool = False, verbose: bool = False) -> int:
    """Run training to the end; returns the exit code (0 on success). ``verbose``: the console shows every
    line every process writes, not only what goes wrong. ``launcher.type`` says what starts the processes."""
    if config.launcher.type == "ray":
        from horizonrl.launcher.ray_cluster import launch_ray

        if tensorboard:
            log.warning("--tensorboard is not started by launcher.type=ray: run tensorboard --logdir %s",
                        config.output_dir / "tensorboard")
        return launch_ray(config, verbose=verbose)
    if config.launcher.type == "slurm":
        raise ConfigError("launcher.type=slurm runs as a batch job: write it with `horizonrl slurm CONFIG > job.sbatch` "
                          "and submit it with `sbatch job.sbatch` (docs/cluster.md)")
    if config.network.host == AUTO_HOST:
        raise ConfigError("network.host=auto is for the cluster launchers (the coordinator's node address); a local "
                          "run binds loopback (the default) or the address you give")
    # Placement first: a plan that cannot run is refused before anything is written or started.
    plan = resolve_placement(config)
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
    def __init__(self, console: RunConsole, level: int) -> None:
        super().__init__(level)
        self.console = console

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.console.line(f"{time.strftime('%H:%M:%S', time.localtime(record.created))} [launcher] "
                              f"{record.levelname} {record.getMessage()}")
        except Exception:  # noqa: BLE001 - logging must never raise into the launcher
            self.handleError(record)


@contextmanager
def logging_to_console(console: RunConsole, path: Path, *, verbose: bool) -> Iterator[None]:
    """While the run lasts, this process's log records go to ``path`` (from INFO) and to the console (from
    WARNING; INFO with ``verbose``), through the console so that they never tear its live block."""
    root, own = logging.getLogger(), logging.getLogger("horizonrl")
    path.parent.mkdir(parents=True, exist_ok=True)
    to_file = logging.FileHandler(path)
    to_file.setLevel(logging.INFO)
    to_file.setFormatter(logging.Formatter(f"%(asctime)s launcher[{os.getpid()}] %(levelname)s %(name)s: %(message)s",
                                           datefmt="%H:%M:%S"))
    to_console = _ConsoleHandler(console, logging.INFO if verbose else logging.WARNING)
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
