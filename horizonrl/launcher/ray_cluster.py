"""``launcher.type=ray``: the run's processes as Ray actors in one placement group.

Ray places and restarts; it runs the same programs as the local launcher
(``horizonrl coordinator|buffer|learner|actor --config <output_dir>/config.yaml``). Each process
is the child of a small Ray actor, :class:`RoleHost`, in its own bundle of one placement group
(``core/placement.py``'s :func:`cluster_bundles`: CPU bundles for the coordinator and the buffer,
``{GPU: 1}`` per learner rank, ``{GPU: tensor_parallel_size}`` per engine — one bundle, so one
node). Ray sets each host's ``CUDA_VISIBLE_DEVICES``, which its child inherits.

How the processes find each other: the coordinator is started first and picks its two ports on
its node; that address goes into the resolved config, and every other process binds a free port
where Ray put it and registers it with the coordinator (``protocol/registry.py``). With a
loopback ``network.host`` (the default) everything stays on loopback: one machine (a local
instance, or ``ray.cluster_utils.Cluster``'s simulated nodes); with ``network.host=auto`` each
process advertises its node's address (``$HORIZONRL_ADVERTISE_HOST``) and CurveZMQ keys are
required, as for any run off loopback.

Who restarts what:
- an actor or the buffer: Ray (``max_restarts`` = ``supervision.max_restarts``). A host whose
  child exits non-zero is killed with ``ray.kill(no_restart=False)``, and a host that dies (its
  node, ``kill -9``) is restarted by Ray as well; the new incarnation starts the program again,
  which registers its new endpoints: the others follow.
- the learner: this launcher, as a gang (``supervision.max_learner_restarts``): when one rank
  fails, every rank's host is killed and new ones start in the same bundles with ``--resume
  auto`` and a new gang id (their process group's rendezvous is registered under it).
- the coordinator: nobody; the run stops (``resume=auto`` continues it), as with ``local``.

The processes' output goes to ``<output_dir>/logs/<name>.log``, written on their node: the output
directory must be on a file system every node shares (checkpoints, the buffer's log and the actors'
outboxes live there too, and a process restarted elsewhere needs them). This process tails those
files for the console, as the local launcher reads its children's pipes.

A host's child is an ordinary child (no new session): if the host dies, Ray ends its process tree
with it (children started with ``start_new_session=True`` would survive). The host is its
children's subreaper, so the engine processes a dead child leaves behind are still its own to end.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from horizonrl.core.config import ConfigError, TrainConfig
from horizonrl.launcher.console import RunConsole, shown_line
from horizonrl.protocol.status import parse_status_line
from horizonrl.core.placement import ClusterBundle, cluster_bundles
from horizonrl.core.programs import horizonrl_command
from horizonrl.core.run_events import EventLog, RunEvent
from horizonrl.core.runtime import StopFlag
from horizonrl.protocol import EVENT_DIED, EVENT_GAVE_UP, EVENT_RESTARTED
from horizonrl.protocol.registry import LEARNER_GANG_ENV as GANG_ENV
from horizonrl.protocol.transport import ADVERTISE_HOST_ENV, free_ports, is_loopback

log = logging.getLogger("horizonrl.launcher.ray")

FORWARDED_ENV_PREFIXES = ("VLLM_", "NCCL_", "HF_", "TRANSFORMERS_", "TORCH_", "HORIZONRL_")
HOST_STOP_GRACE_S = 20.0
POLL_S = 0.2
REVIVE_POLL_S = 0.5
PR_SET_CHILD_SUBREAPER = 36


class RoleHost:
    """A Ray actor that runs one process of the run as its child (made a Ray actor class by :func:`_host_class`).

    Methods are called from the launcher's driver; ``wait`` blocks in one of the actor's threads
    while the others answer ``stop`` and ``ready``."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: str, advertise_node: bool,
                 start: bool = True) -> None:
        self.name = name
        self.argv = argv
        self.env = env
        self.log_path = log_path
        self.advertise_node = advertise_node
        self.proc: subprocess.Popen | None = None
        _become_subreaper()
        if start:
            self.start()

    def ready(self) -> tuple[int, str]:
        """This incarnation's pid (a restarted host answers with a new one) and the Ray node it runs on."""
        import ray

        return os.getpid(), ray.get_runtime_context().get_node_id()

    def node_address(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def free_ports(self, host: str, count: int) -> list[int]:
        """Ports free on this host now (the coordinator's, chosen where it runs)."""
        return free_ports(count, host)

    def start(self, argv: list[str] | None = None) -> int:
        """Start the program (``argv`` replaces the one given at creation); returns its pid."""
        if argv is not None:
            self.argv = argv
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        if self.advertise_node:
            env[ADVERTISE_HOST_ENV] = self.node_address()
        Path(self.log_path).parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            # No new session: the child must die with this actor (Ray ends the actor's process tree).
            self.proc = subprocess.Popen(horizonrl_command(*self.argv), stdout=out,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        return self.proc.pid

    def wait(self) -> int:
        """The program's exit code, once it exits; what it left behind (an engine's processes) is ended."""
        rc = self.proc.wait()
        _kill_descendants()
        return rc

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Signal the program alone: it stops what it spawned itself (an actor shuts its engine down)."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        """The program and everything under this host, now."""
        _kill_descendants()


def _become_subreaper() -> None:
    """Orphans of our child (vLLM's EngineCore when the actor process died) are re-parented to us, so that
    :func:`_kill_descendants` finds them."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: leftovers are Ray's to end
        pass


def _kill_descendants() -> None:
    import psutil

    for child in psutil.Process().children(recursive=True):
        try:
            child.kill()
        except psutil.Error:
            pass


def _host_class():
    import ray

    return ray.remote(max_concurrency=4)(RoleHost)


@dataclass
class Hosted:
    """The launcher's view of one hosted process."""

    name: str
    bundle: int
    handle: object
    argv: list[str]
    restartable: bool  # by Ray (actors, the buffer)
    essential: bool  # the run is over when every essential process exited 0
    host_pid: int = 0
    waiting: object = None  # the ObjectRef of handle.wait()
    reviving: object = None  # after a death: the ObjectRef of handle.ready() on the next incarnation
    revive_at: float = 0.0  # when to ask again (Ray was still restarting it)
    died_at: float = 0.0
    exit_code: int | None = None  # once it exited for good (0: finished)
    gang_member: bool = False

    @property
    def role(self) -> str:
        return self.name.split("-")[0]


class RayLauncher:
    def __init__(self, config: TrainConfig, console: RunConsole, *, verbose: bool = False) -> None:
        self.config = config
        self.console = console
        self.verbose = verbose
        self.settings = config.launcher.ray
        self.log_dir = config.output_dir / "logs"
        self.hosted: dict[str, Hosted] = {}
        self.placement_group = None
        self.started_ray = False
        self.loopback = is_loopback(config.network.host)
        self.bundles: tuple[ClusterBundle, ...] = ()
        self.config_path: Path | None = None
        self.events = None  # CoordinatorEvents, once the coordinator's address is known
        from horizonrl.launcher import RestartPolicy

        self.learner_restarts = RestartPolicy.for_learner(config.supervision)
        self._due: list[tuple[float, str, object]] = []
        self._tail_stop = threading.Event()
        self._tail_thread: threading.Thread | None = None

    # ------------------------------------------------------------------ starting

    def connect(self) -> None:
        """Attach to the cluster (or start an instance here), then reserve every bundle in one placement group."""
        import ray
        from ray.util.placement_group import placement_group

        s = self.settings
        want = self.config.resources.device != "cpu"
        if s.address is None:
            processes = 2 + self.config.learner.num_ranks + self.config.rollout.num_actors
            cpus = s.num_cpus or max(float(os.cpu_count() or 1), processes * s.cpus_per_process)
            start = time.monotonic()
            # Ray starts its workers at niceness 15 (they are helpers of a driver that does the work); here the
            # workers' children are the run itself, so they keep this process's priority.
            os.environ.setdefault("RAY_worker_niceness", "0")
            ray.init(num_cpus=cpus, num_gpus=s.num_gpus, include_dashboard=False, log_to_driver=False,
                     configure_logging=False)
            self.started_ray = True
            log.info("started a Ray instance here (%g CPUs, %s GPUs) in %.1f s", cpus,
                     "Ray's count of" if s.num_gpus is None else s.num_gpus, time.monotonic() - start)
        else:
            ray.init(address=s.address, log_to_driver=False, configure_logging=False)
            log.info("attached to the Ray cluster at %s", s.address)
        has_gpus = ray.cluster_resources().get("GPU", 0) > 0
        use_gpus = want and (s.gpus if s.gpus is not None else has_gpus)
        self.bundles = cluster_bundles(self.config, gpus=use_gpus, cpus_per_process=s.cpus_per_process)
        self.placement_group = placement_group([b.resources for b in self.bundles], strategy=s.strategy,
                                               name=f"horizonrl-{self.config.run.name}-{uuid.uuid4().hex[:8]}")
        try:
            ray.get(self.placement_group.ready(), timeout=s.ready_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise ConfigError(
                f"the Ray cluster could not place the run within launcher.ray.ready_timeout_s="
                f"{s.ready_timeout_s:.0f} s: it needs {self.bundle_summary()} ({s.strategy}); the cluster has "
                f"{ray.cluster_resources()}") from None
        log.info("placement group ready: %s", self.bundle_summary())

    def bundle_summary(self) -> str:
        return ", ".join(f"{b.name} {b.resources}" for b in self.bundles)

    def _options(self, bundle_index: int, *, restartable: bool) -> dict:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = self.bundles[bundle_index]
        sup = self.config.supervision
        return dict(
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group,
                                                                 placement_group_bundle_index=bundle_index),
            num_cpus=bundle.cpus, num_gpus=bundle.gpus,
            max_restarts=(sup.max_restarts if sup.restart else 0) if restartable else 0,
            max_task_retries=0,
        )

    def _bundle(self, name: str) -> int:
        return next(i for i, b in enumerate(self.bundles) if b.name == name)

    def _env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        from horizonrl.launcher import QUIET_VLLM_LEVEL

        # The driver's settings of the engines and collectives (an attached cluster's workers do not inherit its
        # environment); the rank variables are the launcher's to set, or unset: the learner then meets through
        # the coordinator.
        forwarded = {k: v for k, v in os.environ.items()
                     if k.startswith(FORWARDED_ENV_PREFIXES) and k not in (ADVERTISE_HOST_ENV, GANG_ENV)}
        forwarded.update({"MASTER_ADDR": "", "MASTER_PORT": ""})
        if not self.verbose and "VLLM_LOGGING_LEVEL" not in os.environ:
            forwarded["VLLM_LOGGING_LEVEL"] = QUIET_VLLM_LEVEL
        return {**forwarded, **(extra or {})}

    def host(self, name: str, argv: list[str], *, restartable: bool, essential: bool, env: dict | None = None,
             start: bool = True, gang_member: bool = False) -> Hosted:
        index = self._bundle(name)
        handle = _host_class().options(**self._options(index, restartable=restartable)).remote(
            name, argv, self._env(env), str(self.log_dir / f"{name}.log"), not self.loopback, start)
        hosted = Hosted(name, index, handle, argv, restartable, essential, gang_member=gang_member)
        self.hosted[name] = hosted
        return hosted

    def start_coordinator(self, prepare) -> Path:
        """The coordinator first: its node and ports are the address every other process is given. ``prepare``
        writes the resolved config for (host, control_port, report_port) and returns its path."""
        import ray

        coordinator = self.host("coordinator", [], restartable=False, essential=True, start=False)
        if self.loopback:
            host = self.config.network.host
        else:
            host = ray.get(coordinator.handle.node_address.remote())
        net = self.config.network
        ports = [net.control_port, net.report_port]
        if not all(ports):
            picked = iter(ray.get(coordinator.handle.free_ports.remote(host, 2)))
            ports = [p or next(picked) for p in ports]
        self.config_path = prepare(host, ports[0], ports[1])
        coordinator.argv = ["coordinator", "--config", str(self.config_path)]
        ray.get(coordinator.handle.start.remote(coordinator.argv))
        coordinator.host_pid, node = ray.get(coordinator.handle.ready.remote())
        coordinator.waiting = coordinator.handle.wait.remote()
        log.info("coordinator runs on node %s (host pid %d)", node, coordinator.host_pid)
        self._placed(coordinator, node)
        log.info("coordinator at %s:%d (control), %d (reports)", host, ports[0], ports[1])
        return self.config_path

    def start_all(self, prepare) -> None:
        from horizonrl.launcher import CoordinatorEvents

        self.start_coordinator(prepare)
        from horizonrl.core.config import load_config

        self.config = load_config(self.config_path)  # the resolved one: run id, coordinator's address
        self.events = CoordinatorEvents(self.config)
        self._start_tailing()
        self._start("buffer", ["buffer", "--config", str(self.config_path)], restartable=True, essential=False)
        self.start_learner()
        for i in range(self.config.rollout.num_actors):
            self._start(f"actor-{i}", ["actor", "--config", str(self.config_path), "--index", str(i)],
                        restartable=True, essential=False)

    def _start(self, name: str, argv: list[str], **kwargs) -> Hosted:
        hosted = self.host(name, argv, **kwargs)
        hosted.reviving = hosted.handle.ready.remote()  # ready -> its pid, then wait
        return hosted

    def start_learner(self, *extra: str) -> None:
        """Every rank, one gang (a new id: its rendezvous is registered under it)."""
        gang = uuid.uuid4().hex[:8]
        world = self.config.learner.num_ranks
        for rank in range(world):
            env = {"RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": str(world), GANG_ENV: gang}
            self._start(f"learner-{rank}", ["learner", "--config", str(self.config_path), *extra], restartable=False,
                        essential=True, env=env, gang_member=True)
        log.info("learner: %d rank(s), gang %s", world, gang)

    # ------------------------------------------------------------------ console

    def _start_tailing(self) -> None:
        self._tail_thread = threading.Thread(target=self._tail_logs, name="ray-log-tail", daemon=True)
        self._tail_thread.start()

    def _tail_logs(self) -> None:
        """Every line the hosted processes write (to their log files) to the console, as the local launcher does
        with its children's pipes: the coordinator's status records feed the status block."""
        offsets: dict[Path, int] = {}
        partial: dict[Path, bytes] = {}
        while not self._tail_stop.is_set():
            for name in list(self.hosted):
                path = self.log_dir / f"{name}.log"
                try:
                    size = path.stat().st_size
                except OSError:
                    continue
                start = offsets.setdefault(path, 0)
                if size <= start:
                    continue
                with open(path, "rb") as f:
                    f.seek(start)
                    data = partial.pop(path, b"") + f.read(size - start)
                offsets[path] = size
                *lines, rest = data.split(b"\n")
                if rest:
                    partial[path] = rest
                for raw in lines:
                    self._line(name, raw.decode(errors="replace").rstrip("\r"))
            self._tail_stop.wait(POLL_S)

    def _line(self, name: str, line: str) -> None:
        status = parse_status_line(line) if name == "coordinator" else None
        if status is not None:
            self.console.status(status)
            return
        text = shown_line(name, line, verbose=self.verbose)
        if text is not None:
            self.console.line(text)

    # ------------------------------------------------------------------ watching

    def watch(self, stop: StopFlag) -> int:
        """As the local launcher's: 0 when the coordinator and every learner rank exited 0, 1 when a death
        is past what supervision allows, 130 when stopped."""
        import ray

        while True:
            if stop:
                log.warning("stopping the run (%s)", stop.signal_name or "stop requested")
                return 130
            self._start_due()
            now = time.monotonic()
            for h in self.hosted.values():
                if h.revive_at and now >= h.revive_at:
                    h.revive_at, h.reviving = 0.0, h.handle.ready.remote()
            pending = {ref: h for h in self.hosted.values() for ref in (h.waiting, h.reviving) if ref is not None}
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=POLL_S) if pending else ([], [])
            for ref in ready:
                hosted = pending[ref]
                if self.hosted.get(hosted.name) is not hosted or ref not in (hosted.waiting, hosted.reviving):
                    continue  # a learner rank of a gang ended meanwhile
                outcome = self._on_waiting(hosted, ref) if ref is hosted.waiting else self._on_reviving(hosted, ref)
                if outcome is not None:
                    return outcome
            essential = [h for h in self.hosted.values() if h.essential]
            if not self._due and essential and all(h.exit_code == 0 for h in essential):
                return 0
            self.console.tick()
            if not pending:
                time.sleep(POLL_S)

    def _on_reviving(self, hosted: Hosted, ref) -> int | None:
        """A host answered ``ready`` (started, or restarted by Ray), or Ray gave up on it."""
        import ray

        hosted.reviving = None
        try:
            pid, node = ray.get(ref)
        except ray.exceptions.ActorUnavailableError:
            hosted.revive_at = time.monotonic() + REVIVE_POLL_S  # still restarting: ask again soon
            return None
        except ray.exceptions.RayActorError as exc:
            if self._run_over():
                return None
            log.error("%s is dead and Ray will not restart it (%s); stopping the run", hosted.name,
                      str(exc).splitlines()[0][:200])
            self._report(hosted.name, EVENT_GAVE_UP)
            return 1
        if pid == hosted.host_pid:  # the old incarnation answered before Ray's kill reached it: ask the new one
            hosted.reviving = hosted.handle.ready.remote()
            return None
        restarted = hosted.host_pid != 0
        hosted.host_pid = pid
        hosted.waiting = hosted.handle.wait.remote()
        log.info("%s runs on node %s (host pid %d)", hosted.name, node, pid)
        self._placed(hosted, node)
        if restarted:
            log.warning("%s restarted by Ray %.1f s after it died", hosted.name, time.monotonic() - hosted.died_at)
            self._report(hosted.name, EVENT_RESTARTED, delay_s=time.monotonic() - hosted.died_at)
        return None

    def _on_waiting(self, hosted: Hosted, ref) -> int | None:
        """A hosted program exited (its code), or its host died."""
        import ray

        hosted.waiting = None
        try:
            rc = ray.get(ref)
        except ray.exceptions.RayActorError:
            rc = None  # the host died with it (kill -9, its node)
        if rc == 0:
            hosted.exit_code = 0
            if hosted.role in ("actor", "coordinator", "learner") or self._run_over():
                return None
            log.error("%s exited before the run finished; stopping the run", hosted.name)
            return 1
        what = "its host died" if rc is None else f"exited with code {rc}"
        if hosted.role == "coordinator":
            log.error("the coordinator %s; stopping the run (see %s)", what, self.log_dir / "coordinator.log")
            return 1
        self._report(hosted.name, EVENT_DIED, exit_code=rc)
        if self._run_over():
            return None
        if hosted.gang_member:
            return self._restart_learner(hosted, what)
        if not hosted.restartable or self.config.supervision.max_restarts == 0 or not self.config.supervision.restart:
            log.error("%s %s; restarts are off (supervision.restart); stopping the run", hosted.name, what)
            self._report(hosted.name, EVENT_GAVE_UP, exit_code=rc)
            return 1
        log.warning("%s %s; Ray restarts it", hosted.name, what)
        hosted.died_at = time.monotonic()
        if rc is not None:
            # The host is alive, its program is not: a Ray restart (counted against max_restarts) starts it again.
            ray.kill(hosted.handle, no_restart=False)
        hosted.reviving = hosted.handle.ready.remote()
        return None

    def _restart_learner(self, dead: Hosted, what: str) -> int | None:
        """A rank failed: the others cannot go on. End every rank's host, then start a new gang from the
        newest checkpoint in the same bundles."""
        import ray

        delay = self.learner_restarts.next_delay("learner")
        if delay is None:
            log.error("%s %s; the learner was restarted %d times within %.0f s (or supervision.recover is off); "
                      "stopping the run", dead.name, what, self.learner_restarts.recent("learner"),
                      self.config.supervision.window_s)
            self._report("learner", EVENT_GAVE_UP)
            return 1
        restarts = self.learner_restarts.recent("learner")
        log.warning("%s %s; restarting the learner from its newest checkpoint in %.1f s", dead.name, what, delay)
        ranks = [h for h in self.hosted.values() if h.gang_member]
        for h in ranks:
            try:
                h.handle.stop.remote()
            except Exception:  # noqa: BLE001 - a dead host cannot be asked
                pass
        refs = [h.waiting for h in ranks if h.waiting is not None]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=HOST_STOP_GRACE_S)
        for h in ranks:
            ray.kill(h.handle, no_restart=True)
            del self.hosted[h.name]

        def start() -> None:
            self.start_learner("--resume", "auto")
            self._report("learner", EVENT_RESTARTED, restarts=restarts, delay_s=delay)

        self._due.append((time.monotonic() + delay, "learner", start))
        return None

    def _start_due(self) -> None:
        now = time.monotonic()
        for item in [d for d in self._due if d[0] <= now]:
            self._due.remove(item)
            item[2]()

    def _run_over(self) -> bool:
        learners = [h for h in self.hosted.values() if h.gang_member]
        return bool(learners) and all(h.exit_code == 0 for h in learners) and not self._due

    def _placed(self, hosted: Hosted, node: str) -> None:
        EventLog(self.config.output_dir, "launcher").emit(RunEvent.PROCESS_PLACED, name=hosted.name, node=node,
                                                          resources=self.bundles[hosted.bundle].resources)

    def _report(self, name: str, event: str, **fields) -> None:
        EventLog(self.config.output_dir, "launcher").emit(RunEvent(f"process_{event}"), name=name, **fields)
        if self.events is not None:
            self.events.report(name, event, **fields)

    # ------------------------------------------------------------------ stopping

    def stop_all(self, stop: StopFlag | None = None) -> None:
        """As the local launcher: actors and learner first (the learner saves), then the buffer and the
        coordinator; then every host is killed, the placement group removed and a Ray instance we started
        stopped."""
        import ray

        self._due.clear()
        phases = [{"actor": 30.0, "learner": self.config.monitor.stop_timeout_s},
                  {"buffer": HOST_STOP_GRACE_S, "coordinator": HOST_STOP_GRACE_S}]
        try:
            for grace in phases:
                members = [h for h in self.hosted.values() if h.role in grace and h.waiting is not None]
                for h in members:
                    try:
                        ray.get(h.handle.stop.remote(), timeout=10)
                    except Exception:  # noqa: BLE001 - a dead or restarting host: killed below
                        pass
                refs = [h.waiting for h in members]
                deadline = time.monotonic() + max(grace.values(), default=0)
                while refs and time.monotonic() < deadline:
                    if stop is not None and stop.count >= 2:
                        log.warning("second stop signal: killing every process now")
                        break
                    done, refs = ray.wait(refs, num_returns=len(refs), timeout=POLL_S)
                if stop is not None and stop.count >= 2:
                    break
            for h in self.hosted.values():
                try:
                    ray.get(h.handle.kill.remote(), timeout=10)
                except Exception:  # noqa: BLE001
                    pass
                ray.kill(h.handle, no_restart=True)
        finally:
            self._tail_stop.set()
            if self._tail_thread is not None:
                self._tail_thread.join(timeout=5)
            if self.events is not None:
                self.events.close()
            if self.placement_group is not None:
                from ray.util.placement_group import remove_placement_group

                try:
                    remove_placement_group(self.placement_group)
                except Exception:  # noqa: BLE001 - the cluster is going away anyway
                    log.warning("could not remove the placement group", exc_info=True)
            if ray.is_initialized():
                ray.shutdown()


def launch_ray(config: TrainConfig, *, verbose: bool = False) -> int:
    """``horizonrl train CONFIG launcher.type=ray``: the run on a Ray cluster (or a Ray instance started here)."""
    from horizonrl.launcher import logging_to_console, prepare_cluster_run, run_to_the_end

    try:
        import ray  # noqa: F401
    except ImportError:
        raise ConfigError("launcher.type=ray needs Ray: pip install 'horizonrl[ray]' (or 'ray[default]')") from None
    console = RunConsole.for_stdout(title=f"run {config.run.name} (Ray)", total=config.learner.total_steps,
                                    verbose=verbose)
    launcher = RayLauncher(config, console, verbose=verbose)
    stop = StopFlag().install()
    log_dir = config.output_dir / "logs"
    print(f"run {config.run.name} on Ray: {config.rollout.num_actors} actors, {config.learner.num_ranks} learner "
          f"rank(s), {config.learner.total_steps} steps; logs in {log_dir}", flush=True)

    def start() -> None:
        started = time.monotonic()
        launcher.connect()
        launcher.start_all(lambda host, control, report: prepare_cluster_run(config, host, control, report))
        log.info("every process placed in %.1f s", time.monotonic() - started)

    with logging_to_console(console, log_dir / "launcher.log", verbose=verbose):
        return run_to_the_end(launcher, console, stop, start)
