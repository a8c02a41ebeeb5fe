"""Supervision, written once for every backend that starts processes (local subprocesses, Ray actors): which
deaths end the run, which are restarted and after what back-off, the learner's gang restart, and the order
in which a run stops. A backend only starts, polls and signals (:class:`ProcessBackend`).

The policy (``supervision.*``, docs/faults.md): a dead process of a restartable role is restarted after a
back-off that doubles, at most ``max_restarts`` times per ``window_s``; a dead learner rank stops the other
ranks and the learner restarts as a new gang from its newest checkpoint (``recover: auto``,
``max_learner_restarts``). Replacements find the others where their predecessors were or through the
registry (protocol/registry.py). A death past the limits stops the run with a non-zero exit. Every decision
is logged, written to the run's events, and sent to the coordinator (``ProcessEvent``), which counts it
under ``faults/`` and in ``faults.jsonl``. The Slurm job's script applies the same limits in bash
(launcher/slurm.py).
"""

from __future__ import annotations

import logging
import signal
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Callable, Protocol

from horizonrl.core.config import SupervisionConfig, TrainConfig
from horizonrl.core.run_events import EventLog, RunEvent
from horizonrl.core.runtime import StopFlag
from horizonrl.protocol import EVENT_DIED, EVENT_GAVE_UP, EVENT_RECOVERED, EVENT_RESTARTED, ProcessEvent, encode

log = logging.getLogger("horizonrl.launcher")

ACTOR_STOP_S = 30.0  # an actor lets its last sends be acknowledged (10 s), then shuts its engine down
TERMINATE_GRACE_S = 20.0
LEARNER_KILL_GRACE_S = 30.0  # the surviving ranks of a learner that lost one: SIGTERM, then SIGKILL
HEALTH_TIMEOUT_S = 0.5
POLL_S = 0.2


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
class ProcessSpec:
    """One process of the run as a backend starts it: ``horizonrl ARGV...`` with ``env`` on top of the
    backend's own environment."""

    name: str  # "coordinator", "buffer", "learner-0", "actor-1", "env-0", "tensorboard"
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    essential: bool = False  # the run is over when every essential process has exited 0
    health_url: str = ""  # an environment server: it has recovered once this answers /health
    pass_fds: tuple[int, ...] = ()  # descriptors it inherits (the coordinator: the ports the launcher holds)

    @property
    def role(self) -> str:
        return self.name.split("-")[0]


class ProcessBackend(Protocol):
    """What starts the run's processes. ``restartable`` names the roles it can restart."""

    restartable: frozenset[str]

    def start(self, spec: ProcessSpec) -> None:
        """Start ``spec`` (again: a new incarnation of that name, the old one's leftovers killed)."""

    def poll(self, wait_s: float) -> list[tuple[str, int | None]]:
        """The processes that exited since the last poll, waiting up to ``wait_s`` for one: (name, exit code;
        None when its host died with it)."""

    def signal(self, name: str, sig: int, *, group: bool = False) -> None:
        """The process alone (it stops what it spawned itself), or with ``group`` everything it started too."""

    def kill(self, name: str) -> None:
        """The process and everything it started, now."""

    def running(self, name: str) -> bool:
        """Whether the current incarnation of ``name`` has not exited."""

    def learner_gang(self, *extra: str) -> list[ProcessSpec]:
        """Every learner rank of a new gang, with ``extra`` arguments."""

    def close(self) -> None:
        """Kill whatever is left, leftovers of exited processes included, and release the backend."""


class CoordinatorEvents:
    """A launcher's supervision decisions to the coordinator (``ProcessEvent`` on its report socket), which
    counts them under faults/ and writes faults.jsonl. Sending never blocks: a full queue loses the event
    (logged), never the launcher's attention."""

    def __init__(self, config: TrainConfig) -> None:
        import zmq

        from horizonrl.core.run_dirs import read_run_key
        from horizonrl.protocol.transport import make_socket, wire_security

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


class Supervisor:
    """The run's processes, watched until it ends. ``config`` is the resolved config (the coordinator's address
    in it: supervision events go there)."""

    def __init__(self, config: TrainConfig, backend: ProcessBackend) -> None:
        self.config = config
        self.backend = backend
        self.specs: dict[str, ProcessSpec] = {}  # the current incarnation of each name
        self.exited: dict[str, int | None] = {}  # name -> its exit code, once its current incarnation exited
        self.restarts = RestartPolicy.for_processes(config.supervision)
        self.learner_restarts = RestartPolicy.for_learner(config.supervision)
        self.due: list[tuple[float, str, Callable[[], None]]] = []  # (when, what, start it)
        self._events: CoordinatorEvents | None = None  # made on first use
        # one writer for the run's whole supervision: the events a full disk refused are kept and written after it
        self.events = EventLog(config.output_dir, "launcher")
        self._servers_recovering: dict[str, str] = {}  # restarted environment servers -> their URL

    # ------------------------------------------------------------------ starting

    def start(self, spec: ProcessSpec) -> None:
        self.specs[spec.name] = spec
        self.exited.pop(spec.name, None)
        self.backend.start(spec)

    def adopt(self, spec: ProcessSpec) -> None:
        """Watch a process the backend started itself (a cluster's coordinator, started before the resolved
        config this supervisor needs existed)."""
        self.specs[spec.name] = spec
        self.exited.pop(spec.name, None)

    def start_learner(self, *extra: str) -> None:
        for spec in self.backend.learner_gang(*extra):
            self.start(spec)

    def learners(self) -> list[str]:
        return [name for name, spec in self.specs.items() if spec.role == "learner"]

    # ------------------------------------------------------------------ watching

    def learner_finished(self) -> bool:
        learners = self.learners()
        return (bool(learners) and all(self.exited.get(n, -1) == 0 for n in learners)
                and not any(what == "learner" for _, what, _ in self.due))

    def watch(self, stop: StopFlag, tick: Callable[[], None] = lambda: None) -> int:
        """Wait until the essential processes finish (0), one dies past what supervision allows (1), or
        we are stopped (130); restart the others as they die."""
        while True:
            if stop:
                log.warning("stopping the run (%s)", stop.signal_name or "stop requested")
                self.events.emit(RunEvent.RUN_STOPPING, reason=stop.signal_name or "stop requested")
                return 130
            self._start_due()
            self._check_servers_recovered()
            self.events.retry()
            outcome = self.handle_exits(self.backend.poll(POLL_S))
            if outcome is not None:
                return outcome
            essential = [n for n, spec in self.specs.items() if spec.essential]
            if not self.due and essential and all(self.exited.get(n, -1) == 0 for n in essential):
                return 0
            tick()

    def handle_exits(self, exits: list[tuple[str, int | None]]) -> int | None:
        """Deal with the exits of one poll; a return value ends the watch with it."""
        # Every exit of this poll is known before any is dealt with (a learner that finished beside a
        # buffer that failed: the run is over, and the buffer is not restarted).
        exits = [(name, rc) for name, rc in exits if name in self.specs]  # others: a gang stopped on purpose
        self.exited.update(exits)
        for name, rc in exits:
            spec = self.specs.get(name)
            if spec is None:
                # Both ranks of a gang died in one poll: the first one's exit already stopped the gang and
                # forgot its members, so this one is expected, not a second death to deal with.
                continue
            outcome = self.on_exit(spec, rc)
            if outcome is not None:
                return outcome
        return None

    def on_exit(self, spec: ProcessSpec, rc: int | None) -> int | None:
        """Deal with one exit (``rc`` None: its host died with it); a return value ends the watch with it."""
        what = "its host died" if rc is None else f"exited with code {rc}"
        if spec.role == "tensorboard":
            return None
        if spec.role == "learner":
            return None if rc == 0 else self._restart_learner(spec, what, rc)
        if rc == 0:
            # An actor that was told to stop, or a coordinator after the learner's final report (or a stop
            # signal); a buffer or server stops only on a signal.
            if spec.role in ("actor", "coordinator") or self.learner_finished():
                return None
            log.error("%s exited before the run finished; stopping the run", spec.name)
            return 1
        if spec.role not in self.backend.restartable:
            log.error("%s %s; stopping the run (see %s)", spec.name, what, self.config.run_dir.log(spec.name))
            return 1
        return self._restart(spec, what, rc)

    def _restart(self, spec: ProcessSpec, what: str, rc: int | None) -> int | None:
        self.backend.kill(spec.name)  # what it spawned (an engine's processes) goes with it
        self.report(spec.name, EVENT_DIED, exit_code=rc)
        if self.learner_finished() and spec.role != "coordinator":
            return None  # the run is over anyway (but for the coordinator, which ends it)
        delay = self.restarts.next_delay(spec.name)
        if delay is None:
            log.error("%s %s; %s; stopping the run (see %s)", spec.name, what,
                      "restarts are off (supervision.restart)" if not self.config.supervision.restart else
                      f"it was restarted {self.restarts.recent(spec.name)} times within "
                      f"{self.config.supervision.window_s:.0f} s", self.config.run_dir.log(spec.name))
            self.report(spec.name, EVENT_GAVE_UP, exit_code=rc)
            return 1
        restarts = self.restarts.recent(spec.name)
        log.warning("%s %s; restarting it in %.1f s (restart %d of %d within %.0f s)", spec.name, what, delay,
                    restarts, self.restarts.limit, self.restarts.window_s)

        def start() -> None:
            self.start(spec)
            self.report(spec.name, EVENT_RESTARTED, restarts=restarts, delay_s=delay)
            if spec.health_url:
                self._servers_recovering[spec.name] = spec.health_url

        self.due.append((time.monotonic() + delay, spec.name, start))
        return None

    def _restart_learner(self, dead: ProcessSpec, what: str, rc: int | None) -> int | None:
        """A rank died: the others cannot go on (their collectives need it). Stop them, then start every
        rank again, a new gang, from the newest checkpoint."""
        self.report(dead.name, EVENT_DIED, exit_code=rc)
        delay = self.learner_restarts.next_delay("learner")
        if delay is None:
            log.error("%s %s; %s; stopping the run (see %s)", dead.name, what,
                      "supervision.recover is off" if self.config.supervision.recover != "auto" else
                      f"the learner was restarted {self.learner_restarts.recent('learner')} times within "
                      f"{self.config.supervision.window_s:.0f} s", self.config.run_dir.log(dead.name))
            self.report("learner", EVENT_GAVE_UP, exit_code=rc)
            return 1
        restarts = self.learner_restarts.recent("learner")
        log.warning("%s %s; restarting the learner from its newest checkpoint in %.1f s (restart %d of %d within "
                    "%.0f s)", dead.name, what, delay, restarts, self.learner_restarts.limit,
                    self.learner_restarts.window_s)
        ranks = self.learners()
        self.stop_members([n for n in ranks if self.backend.running(n)], LEARNER_KILL_GRACE_S, group=True)
        for name in ranks:
            self.backend.kill(name)
            del self.specs[name]  # the old gang's exits are expected now: not watched
            self.exited.pop(name, None)

        def start() -> None:
            self.start_learner("--resume", "auto")
            self.report("learner", EVENT_RESTARTED, restarts=restarts, delay_s=delay)

        self.due.append((time.monotonic() + delay, "learner", start))
        return None

    def _start_due(self) -> None:
        now = time.monotonic()
        for item in [d for d in self.due if d[0] <= now]:
            self.due.remove(item)
            item[2]()

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
            self.report(name, EVENT_RECOVERED)

    def report(self, name: str, event: str, **fields) -> None:
        """Tell the coordinator (it counts faults/ and writes faults.jsonl); never blocks."""
        self.events.emit(RunEvent(f"process_{event}"), name=name, **fields)
        if self._events is None:
            self._events = CoordinatorEvents(self.config)
        self._events.report(name, event, **fields)

    # ------------------------------------------------------------------ stopping

    def stop_members(self, names: list[str], grace_s: float, *, group: bool = False,
                     stop: StopFlag | None = None, graces: dict[str, float] | None = None) -> None:
        """SIGTERM each of ``names`` (``group``: what it spawned too), wait up to ``grace_s`` for all (or each its
        role's grace in ``graces``), killing those past theirs; a second stop signal kills at once."""
        for name in names:
            self.backend.signal(name, signal.SIGTERM, group=group)
        start = time.monotonic()
        killed: set[str] = set()
        while time.monotonic() - start < grace_s and any(self.backend.running(n) for n in names):
            if stop is not None and stop.count >= 2:
                log.warning("second stop signal: killing every process now")
                return
            for name in names:
                own = (graces or {}).get(self.specs[name].role, grace_s) if name in self.specs else grace_s
                if self.backend.running(name) and name not in killed and time.monotonic() - start > own:
                    log.warning("%s did not stop within %.0f s: killing it", name, own)
                    self.backend.kill(name)
                    killed.add(name)
            time.sleep(0.1)

    def stop_all(self, stop: StopFlag | None = None) -> None:
        """Stop in order, so nothing is lost and a checkpoint is written: first the actors (no new
        episodes; what they sent gets acknowledged) and the learner (finishes or abandons its step,
        saves), within ``monitor.stop_timeout_s``; then the buffer, the coordinator and the servers. A second
        stop signal (Ctrl-C again) kills everything at once. Whatever is left is killed, with the
        processes it spawned."""
        self.due.clear()
        # (roles, how long each may take) per phase; the actors' part of the first is short: they
        # only let their last sends be acknowledged.
        phases = [{"actor": ACTOR_STOP_S, "learner": self.config.monitor.stop_timeout_s},
                  {"buffer": TERMINATE_GRACE_S, "coordinator": TERMINATE_GRACE_S, "tensorboard": TERMINATE_GRACE_S,
                   "env": TERMINATE_GRACE_S}]
        try:
            for graces in phases:
                # The process alone: it stops what it spawned itself (an actor shuts its engine down after its
                # last sends). Signalled too, an engine core would die under the actor's feet and flood its log
                # with EngineDeadError. Leftovers are killed below.
                members = [n for n, spec in self.specs.items() if spec.role in graces and self.backend.running(n)]
                self.stop_members(members, max(graces.values(), default=0), stop=stop, graces=graces)
                if stop is not None and stop.count >= 2:
                    break
        finally:
            self.backend.close()
            if self._events is not None:
                self._events.close()
