"""``launcher.type=ray``: the run's processes as Ray actors in one placement group, supervised by the same
:class:`~horizonrl.launcher.supervisor.Supervisor` as local processes (:class:`RayActors` is its backend).

Each process is the child of a small Ray actor, :class:`RoleHost`, in its own bundle of one placement group
(``core/placement.py``'s :func:`cluster_bundles`: CPU bundles for the coordinator and the buffer, ``{GPU: 1}``
per learner rank, ``{GPU: tensor_parallel_size}`` per engine — one bundle, so one node). Ray sets each host's
``CUDA_VISIBLE_DEVICES``, which its child inherits.

How the processes find each other: the coordinator is started first and picks its two ports on its node; that
address goes into the resolved config, and every other process binds a free port where Ray put it and
registers it with the coordinator (``protocol/registry.py``). With a loopback ``network.host`` (the default)
everything stays on loopback: one machine (a local instance, or ``ray.cluster_utils.Cluster``'s simulated
nodes); with ``network.host=auto`` each process advertises its node's address (``$HORIZONRL_ADVERTISE_HOST``)
and CurveZMQ keys are required, as for any run off loopback.

Who restarts what: the supervisor, with the policy of every launcher (``supervision.*``). A process that
exits non-zero, or whose host dies (its node, ``kill -9``), is restarted as a new host in the same bundle
(Ray's own ``max_restarts`` is not used: one policy, one place); the new incarnation registers its new
endpoints and the others follow. The learner restarts as a gang: every rank's host is ended and new ones
start in the same bundles with ``--resume auto`` and a new gang id (their process group's rendezvous is
registered under it). The coordinator is not restarted here (its address is fixed in every process's config
when the run starts): a dead coordinator stops the run, and ``resume=auto`` continues it.

The processes' output goes to ``<output_dir>/logs/<name>.log``, written on their node: the output directory
must be on a file system every node shares (checkpoints, the buffer's log and the actors' outboxes live there
too, and a process restarted elsewhere needs them). This process tails those files for the console, as the
local launcher reads its children's pipes.

A host's child is an ordinary child (no new session): if the host dies, Ray ends its process tree with it
(children started with ``start_new_session=True`` would survive). The host is its children's subreaper, so
the engine processes a dead child leaves behind are still its own to end.
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
from typing import Callable

from horizonrl.core.config import ConfigError, TrainConfig, load_config
from horizonrl.core.placement import ClusterBundle, cluster_bundles
from horizonrl.core.programs import role_command
from horizonrl.core.run_events import EventLog, RunEvent
from horizonrl.core.runtime import StopFlag
from horizonrl.launcher.console import RunConsole, route_line
from horizonrl.launcher.local import QUIET_VLLM_LEVEL
from horizonrl.launcher.supervisor import ProcessSpec, Supervisor
from horizonrl.protocol.registry import LEARNER_GANG_ENV as GANG_ENV
from horizonrl.protocol.transport import ADVERTISE_HOST_ENV, free_ports, is_loopback

log = logging.getLogger("horizonrl.launcher.ray")

FORWARDED_ENV_PREFIXES = ("VLLM_", "NCCL_", "HF_", "TRANSFORMERS_", "TORCH_", "HORIZONRL_")
HOST_CALL_S = 10.0  # how long a call into a host may take (a dead or restarting one never answers)
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
        """Start the program, a whole command line (``argv`` replaces the one given at creation); returns its pid."""
        if argv is not None:
            self.argv = argv
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        if self.advertise_node:
            env[ADVERTISE_HOST_ENV] = self.node_address()
        Path(self.log_path).parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            # No new session: the child must die with this actor (Ray ends the actor's process tree).
            self.proc = subprocess.Popen(self.argv, stdout=out,
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
    """One incarnation of a hosted process."""

    spec: ProcessSpec
    bundle: int
    handle: object
    ready: object = None  # the ObjectRef of handle.ready() until the host answered it
    waiting: object = None  # then the ObjectRef of handle.wait()
    revive_at: float = 0.0  # Ray was still creating it: when to ask ``ready`` again
    exited: bool = False


class RayActors:
    """The run's processes as hosts in one placement group: a bundle per process (a restart starts a new host in
    the same bundle), every host polled through its ``ready`` and ``wait`` calls."""

    restartable = frozenset({"actor", "buffer"})

    def __init__(self, config: TrainConfig, on_line: Callable[[str, str], None], *, verbose: bool = False) -> None:
        self.config = config
        self.on_line = on_line
        self.verbose = verbose
        self.settings = config.launcher.ray
        self.hosted: dict[str, Hosted] = {}
        self.retired: list[Hosted] = []  # earlier incarnations, ended at close
        self.placement_group = None
        self.started_ray = False
        self.loopback = is_loopback(config.network.host)
        self.bundles: tuple[ClusterBundle, ...] = ()
        self._tail_stop = threading.Event()
        self._tail_thread: threading.Thread | None = None

    # ------------------------------------------------------------------ the cluster

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

    def _host(self, spec: ProcessSpec, *, start: bool) -> Hosted:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        index = next(i for i, b in enumerate(self.bundles) if b.name == spec.name)
        bundle = self.bundles[index]
        options = dict(scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group,
                                                                            placement_group_bundle_index=index),
                       num_cpus=bundle.cpus, num_gpus=bundle.gpus, max_restarts=0, max_task_retries=0)
        handle = _host_class().options(**options).remote(spec.name, spec.argv, self._env(spec.env),
                                                         str(self.config.run_dir.log(spec.name)), not self.loopback,
                                                         start)
        hosted = Hosted(spec, index, handle)
        self.hosted[spec.name] = hosted
        return hosted

    def _env(self, extra: dict[str, str]) -> dict[str, str]:
        # The driver's settings of the engines and collectives (an attached cluster's workers do not inherit its
        # environment); the rank variables are the launcher's to set, or unset: the learner then meets through
        # the coordinator.
        forwarded = {k: v for k, v in os.environ.items()
                     if k.startswith(FORWARDED_ENV_PREFIXES) and k not in (ADVERTISE_HOST_ENV, GANG_ENV)}
        forwarded.update({"MASTER_ADDR": "", "MASTER_PORT": ""})
        if not self.verbose and "VLLM_LOGGING_LEVEL" not in os.environ:
            forwarded["VLLM_LOGGING_LEVEL"] = QUIET_VLLM_LEVEL
        return {**forwarded, **extra}

    def start_coordinator(self, spec: ProcessSpec, prepare: Callable[[str, int, int], Path]) -> Path:
        """The coordinator first: its node and ports are the address every other process is given. ``prepare``
        writes the resolved config for (host, control_port, report_port) and returns its path; ``spec``'s
        command line names that path once it is known (:func:`role_command` with it)."""
        import ray

        coordinator = self._host(spec, start=False)
        host = self.config.network.host if self.loopback else ray.get(coordinator.handle.node_address.remote())
        net = self.config.network
        ports = [net.control_port, net.report_port]
        if not all(ports):
            picked = iter(ray.get(coordinator.handle.free_ports.remote(host, 2)))
            ports = [p or next(picked) for p in ports]
        path = prepare(host, ports[0], ports[1])
        spec.argv = role_command("coordinator", str(path))
        ray.get(coordinator.handle.start.remote(spec.argv))
        coordinator.ready = coordinator.handle.ready.remote()
        log.info("coordinator at %s:%d (control), %d (reports)", host, ports[0], ports[1])
        self.config = load_config(path)  # the resolved one: run id, coordinator's address
        return path

    # ------------------------------------------------------------------ the backend

    def start(self, spec: ProcessSpec) -> None:
        previous = self.hosted.pop(spec.name, None)
        if previous is not None:
            self._end(previous)  # a host whose child died may still be alive: its bundle is the new one's
            self.retired.append(previous)
        hosted = self._host(spec, start=True)
        hosted.ready = hosted.handle.ready.remote()  # ready -> its pid and node, then wait

    def poll(self, wait_s: float) -> list[tuple[str, int | None]]:
        import ray

        now = time.monotonic()
        for h in self.hosted.values():
            if h.revive_at and now >= h.revive_at:
                h.revive_at, h.ready = 0.0, h.handle.ready.remote()
        pending = {ref: h for h in self.hosted.values() if not h.exited for ref in (h.ready, h.waiting)
                   if ref is not None}
        if not pending:
            time.sleep(wait_s)
            return []
        done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=wait_s)
        exits = []
        for ref in done:
            hosted = pending[ref]
            if self.hosted.get(hosted.spec.name) is not hosted or hosted.exited:
                continue
            rc = self._answered_ready(hosted, ref) if ref is hosted.ready else self._exited(hosted, ref)
            if hosted.exited:
                exits.append((hosted.spec.name, rc))
        return exits

    def _answered_ready(self, hosted: Hosted, ref) -> None:
        """A host answered ``ready`` (it runs its program), or could not be created."""
        import ray

        hosted.ready = None
        try:
            pid, node = ray.get(ref)
        except ray.exceptions.ActorUnavailableError:
            hosted.revive_at = time.monotonic() + REVIVE_POLL_S  # still being created: ask again soon
            return None
        except ray.exceptions.RayActorError as exc:
            log.error("%s: its host could not start (%s)", hosted.spec.name, str(exc).splitlines()[0][:200])
            hosted.exited = True
            return None
        hosted.waiting = hosted.handle.wait.remote()
        log.info("%s runs on node %s (host pid %d)", hosted.spec.name, node, pid)
        EventLog(self.config.output_dir, "launcher").emit(RunEvent.PROCESS_PLACED, name=hosted.spec.name, node=node,
                                                          resources=self.bundles[hosted.bundle].resources)
        return None

    def _exited(self, hosted: Hosted, ref) -> int | None:
        """A hosted program exited (its code), or its host died with it (None)."""
        import ray

        hosted.waiting, hosted.exited = None, True
        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError:
            return None

    def running(self, name: str) -> bool:
        """Whether ``name``'s program still runs, asked without waiting (an exit seen here is not polled again:
        it is asked while the run stops, or while a gang it belongs to is ended)."""
        import ray

        hosted = self.hosted.get(name)
        if hosted is None or hosted.exited:
            return False
        if hosted.waiting is not None and ray.wait([hosted.waiting], timeout=0)[0]:
            hosted.exited, hosted.waiting = True, None
        return not hosted.exited

    def signal(self, name: str, sig: int, *, group: bool = False) -> None:
        """The program alone; ``group`` makes no difference: the host ends what the program leaves behind once it
        exits."""
        import ray

        hosted = self.hosted.get(name)
        if hosted is not None and not hosted.exited:
            try:
                ray.get(hosted.handle.stop.remote(sig), timeout=HOST_CALL_S)
            except Exception:  # noqa: BLE001 - a dead or restarting host cannot be asked: ended by kill
                pass

    def kill(self, name: str) -> None:
        hosted = self.hosted.get(name)
        if hosted is not None:
            self._end(hosted)

    def _end(self, hosted: Hosted) -> None:
        """The program and everything under its host, then the host itself."""
        import ray

        try:
            ray.get(hosted.handle.kill.remote(), timeout=HOST_CALL_S)
        except Exception:  # noqa: BLE001 - a dead host has nothing left to end
            pass
        ray.kill(hosted.handle, no_restart=True)
        hosted.exited, hosted.ready, hosted.waiting = True, None, None

    def learner_gang(self, *extra: str) -> list[ProcessSpec]:
        """Every rank, one gang (a new id: its rendezvous is registered under it)."""
        gang, world = uuid.uuid4().hex[:8], self.config.learner.num_ranks
        log.info("learner: %d rank(s), gang %s", world, gang)
        return [ProcessSpec(f"learner-{rank}", role_command("learner", str(self.config.run_dir.config), *extra),
                            {"RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": str(world), GANG_ENV: gang},
                            essential=True) for rank in range(world)]

    def close(self) -> None:
        import ray

        try:
            for hosted in [*self.retired, *self.hosted.values()]:
                self._end(hosted)
        finally:
            self._tail_stop.set()
            if self._tail_thread is not None:
                self._tail_thread.join(timeout=5)
            if self.placement_group is not None:
                from ray.util.placement_group import remove_placement_group

                try:
                    remove_placement_group(self.placement_group)
                except Exception:  # noqa: BLE001 - the cluster is going away anyway
                    log.warning("could not remove the placement group", exc_info=True)
            if ray.is_initialized():
                ray.shutdown()

    # ------------------------------------------------------------------ the console

    def start_tailing(self) -> None:
        self._tail_thread = threading.Thread(target=self._tail_logs, name="ray-log-tail", daemon=True)
        self._tail_thread.start()

    def _tail_logs(self) -> None:
        """Every line the hosted processes write (to their log files) to the console, as the local launcher does
        with its children's pipes."""
        offsets: dict[Path, int] = {}
        partial: dict[Path, bytes] = {}
        while not self._tail_stop.is_set():
            for name in list(self.hosted):
                path = self.config.run_dir.log(name)
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
                    self.on_line(name, raw.decode(errors="replace").rstrip("\r"))
            self._tail_stop.wait(0.2)


class RayLauncher:
    """A run on Ray: the cluster's bundles, the coordinator first, then the rest under the supervisor."""

    def __init__(self, config: TrainConfig, console: RunConsole, *, verbose: bool = False) -> None:
        self.config = config
        self.console = console
        self.processes = RayActors(config, lambda name, line: route_line(console, name, line, verbose=verbose),
                                   verbose=verbose)
        self.supervisor: Supervisor | None = None

    def start_all(self, prepare: Callable[[str, int, int], Path]) -> None:
        self.processes.connect()
        coordinator = ProcessSpec("coordinator", [], essential=True)
        path = self.processes.start_coordinator(coordinator, prepare)
        self.config = self.processes.config
        self.supervisor = Supervisor(self.config, self.processes)
        self.supervisor.adopt(coordinator)
        self.processes.start_tailing()
        self.supervisor.start(ProcessSpec("buffer", role_command("buffer", str(path))))
        self.supervisor.start_learner()
        for i in range(self.config.rollout.num_actors):
            self.supervisor.start(ProcessSpec(f"actor-{i}", role_command("actor", str(path), index=i)))

    def watch(self, stop: StopFlag) -> int:
        return self.supervisor.watch(stop, self.console.tick)

    def stop_all(self, stop: StopFlag | None = None) -> None:
        if self.supervisor is not None:
            self.supervisor.stop_all(stop)
        else:
            self.processes.close()  # the placement group, a Ray instance started here
