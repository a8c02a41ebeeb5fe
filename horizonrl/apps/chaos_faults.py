"""The faults ``horizonrl chaos`` fires at a running training, one kind per chaos run, at random times.

- :class:`KillProcess`: ``kill -9`` of one process of a kind: an actor, the buffer, a learner rank, a
  managed environment server, or the coordinator.
- :class:`FreezeEngine`: ``SIGSTOP`` of one actor's vLLM EngineCore for a while, then ``SIGCONT`` (a
  frozen engine: a stuck GPU, a node under swap).
- :class:`MessageStorm`: a burst of malformed and hostile messages to every socket of the run
  (``hostile.py``: no message of it can be trained on or change the run's state).
- :class:`FillDisk`: the run directory's file system filled to the last byte for a while, then freed.
- :class:`SquatCoordinator`: ``kill -9`` of the coordinator, then this process binds its two ports before the
  replacement can, and holds them for a while: it publishes forged Controls (end training, pause the rollout)
  and swallows every report. A launcher that holds the ports (the local one) leaves it nothing to bind.
- :class:`FakeJoin`: joins of the learner's weight hub that never receive (one claims actor 0's place), as
  someone who knows the run id but not its key would make them.

Each fault's ``fire`` does it once and says what it did; ``tick`` (called every loop) undoes what is due;
``end`` undoes everything still in force when the run stops, however it stops.
"""

from __future__ import annotations

import errno
import os
import random
import signal
import time
from pathlib import Path
from typing import Any, Protocol

from horizonrl.core.run_dirs import RunDir

ROLES = {"actor": ("actor",), "buffer": ("buffer",), "learner": ("learner",), "env-server": ("env", "serve"),
         "coordinator": ("coordinator",)}
ENGINE_NAME = "VLLM::EngineCor"  # the kernel keeps 15 characters of vLLM's "VLLM::EngineCore"
FILL_FILE = "chaos_disk_fill"
FILL_CHUNK = 16 * 1024 * 1024


class Fault(Protocol):
    what: str

    def fire(self, launcher_pid: int, rng: random.Random) -> dict[str, Any]: ...

    def tick(self) -> None: ...

    def end(self) -> None: ...


def run_processes(launcher_pid: int, role: str) -> list:
    """The run's processes of ``role`` (``horizonrl <role> ...``), by their command lines."""
    import psutil

    words = ROLES[role]
    found = []
    for child in psutil.Process(launcher_pid).children(recursive=True):
        try:
            cmdline = child.cmdline()
        except psutil.Error:
            continue
        if "horizonrl" in cmdline:
            tail = cmdline[cmdline.index("horizonrl") + 1:]
            if tuple(tail[:len(words)]) == words:
                found.append(child)
    return found


def engine_cores(launcher_pid: int) -> list:
    """The EngineCore process of every actor's engine."""
    import psutil

    found = []
    for actor in run_processes(launcher_pid, "actor"):
        try:
            found += [p for p in actor.children(recursive=True) if p.name().startswith(ENGINE_NAME)]
        except psutil.Error:
            continue
    return found


class KillProcess:
    def __init__(self, role: str) -> None:
        self.role = role
        self.what = f"kill -9 of a process of kind {role!r}"

    def fire(self, launcher_pid: int, rng: random.Random) -> dict[str, Any]:
        import psutil

        found = run_processes(launcher_pid, self.role)
        if not found:
            return {"pid": None, "note": f"no {self.role} process alive (still restarting?)"}
        victim = rng.choice(found)
        try:
            victim.kill()
        except psutil.Error:
            pass
        return {"pid": victim.pid, "did": f"kill -9 {self.role} pid {victim.pid}"}

    def tick(self) -> None:
        pass

    def end(self) -> None:
        pass


class FreezeEngine:
    def __init__(self, seconds: float, clock=time.monotonic) -> None:
        self.seconds = seconds
        self.clock = clock
        self.what = f"SIGSTOP of an engine for {seconds:.0f} s"
        self.frozen: dict[int, float] = {}  # pid -> when it is continued

    def fire(self, launcher_pid: int, rng: random.Random) -> dict[str, Any]:
        cores = [p for p in engine_cores(launcher_pid) if p.pid not in self.frozen]
        if not cores:
            return {"pid": None, "note": "no engine running that is not frozen already"}
        victim = rng.choice(cores)
        if not _signal(victim.pid, signal.SIGSTOP):
            return {"pid": None, "note": f"engine pid {victim.pid} is gone"}
        self.frozen[victim.pid] = self.clock() + self.seconds
        return {"pid": victim.pid, "did": f"SIGSTOP engine pid {victim.pid} for {self.seconds:.0f} s"}

    def tick(self) -> None:
        now = self.clock()
        for pid, until in list(self.frozen.items()):
            if now >= until:
                _signal(pid, signal.SIGCONT)
                del self.frozen[pid]

    def end(self) -> None:
        for pid in list(self.frozen):
            _signal(pid, signal.SIGCONT)
        self.frozen.clear()


class MessageStorm:
    """``count`` hostile messages to each of the coordinator's report socket, the buffer's intake and its batch
    socket, each burst from the run's resolved config (its ports, run id and key: the storm knows what an insider
    would). Nothing of it may be trained on or change the run's state; what the processes counted is read back
    from the coordinator's state file (its own counts, and the buffer's last heartbeat) at the end."""

    def __init__(self, count: int, run_dir: Path) -> None:
        self.count, self.run_dir = count, run_dir
        self.what = f"a storm of {count} malformed or hostile messages to each socket"
        self.sent: dict[str, int] = {}

    def fire(self, launcher_pid: int, rng: random.Random) -> dict[str, Any]:
        import zmq

        from horizonrl.core.config import load_config
        from horizonrl.core.run_dirs import read_run_key
        from horizonrl.apps.hostile import intake_storm, report_storm, request_storm
        from horizonrl.protocol.transport import wire_security

        config = load_config(RunDir(self.run_dir).config)
        net, run_id, total = config.network, config.run.run_id, config.learner.total_steps
        key = read_run_key(self.run_dir)
        storms = {
            net.report_port: (zmq.PUSH, "report", report_storm(rng, run_id, key, self.count, total_steps=total,
                                                               num_actors=config.rollout.num_actors, real_run=True)),
            net.trajectory_port: (zmq.DEALER, "intake", intake_storm(
                rng, run_id, self.count, context_tokens=config.rollout.max_context_tokens, real_run=True)),
            net.batch_port: (zmq.DEALER, "requests", request_storm(rng, run_id, key, self.count, total_steps=total))}
        context = zmq.Context()
        security = wire_security(context, net.host, net.curve_keys_dir)
        try:
            for port, (kind, name, messages) in storms.items():
                sock = context.socket(kind)
                if security is not None:
                    security.apply(sock, server=False)
                sock.connect(net.endpoint(port))
                for data, _ in messages:
                    sock.send(data)
                sock.close(linger=30_000)  # what was queued goes out before the context ends
                self.sent[name] = self.sent.get(name, 0) + len(messages)
        finally:
            context.term()
            if security is not None:
                security.stop()
        return {"pid": None, "did": f"sent {3 * self.count} hostile messages", "sent": dict(self.sent)}

    def tick(self) -> None:
        pass

    def end(self) -> None:
        pass

    def counted(self) -> dict[str, float]:
        """What the run's processes counted as bad or rejected (the coordinator's own, the buffer's last heartbeat)."""
        from horizonrl.core.coordinator_state import load_snapshot
        from horizonrl.core.config import load_config

        snapshot = load_snapshot(self.run_dir, load_config(RunDir(self.run_dir).config).run.run_id)
        if snapshot is None:
            return {}
        buffer = next((i.counters for i in snapshot.incarnations if i.role == "buffer" and i.current), {})
        return {"coordinator_bad": float(sum(snapshot.bad_messages.values())),
                "coordinator_rejected": float(sum(snapshot.rejected.values())),
                "buffer_bad": buffer.get("bad_messages", 0.0), "buffer_rejected": buffer.get("rejected_total", 0.0)}


class FillDisk:
    """Fill the run directory's file system to the last byte for ``seconds``, then free it. Refused when the file
    system has more than ``max_bytes`` free: filling a big shared disk would take long and hurt others. Put
    ``run.output_dir`` on a small file system of its own (a tmpfs, a loop-mounted image) to use it."""

    def __init__(self, seconds: float, run_dir: Path, max_bytes: int, clock=time.monotonic) -> None:
        self.seconds, self.run_dir, self.max_bytes, self.clock = seconds, run_dir, max_bytes, clock
        self.what = f"the run directory's disk full for {seconds:.0f} s"
        self.until: float | None = None

    @property
    def path(self) -> Path:
        return self.run_dir / FILL_FILE

    def free_bytes(self) -> int:
        stats = os.statvfs(self.run_dir)
        # root may write into the blocks reserved for it: all of them must go for the disk to be full for root too
        return stats.f_frsize * (stats.f_bfree if os.geteuid() == 0 else stats.f_bavail)

    def check(self) -> None:
        """Refuse before the run starts, not in the middle of it."""
        free = self.free_bytes()
        if free > self.max_bytes:
            raise ValueError(f"{self.run_dir} is on a file system with {free / 2**30:.1f} GiB free, more than "
                             f"--fill-max-gb {self.max_bytes / 2**30:.1f}: put run.output_dir on a small file system "
                             "of its own (a tmpfs, a loop-mounted image), or raise --fill-max-gb")

    def fire(self, launcher_pid: int, rng: random.Random) -> dict[str, Any]:
        if self.until is not None:
            return {"pid": None, "note": "the disk is full already"}
        self.check()
        written = 0
        chunk = bytes(FILL_CHUNK)
        with open(self.path, "ab", buffering=0) as out:
            while written < self.max_bytes:
                try:
                    written += out.write(chunk[: min(FILL_CHUNK, self.max_bytes - written)])
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    if len(chunk) == 1:
                        break
                    chunk = chunk[: max(1, len(chunk) // 16)]  # the last bytes, in ever smaller writes
        self.until = self.clock() + self.seconds
        return {"pid": None, "did": f"filled {self.run_dir}'s disk with {written / 2**20:.0f} MiB "
                                    f"({self.free_bytes()} bytes left) for {self.seconds:.0f} s"}

    def tick(self) -> None:
        if self.until is not None and self.clock() >= self.until:
            self.end()

    def end(self) -> None:
        self.path.unlink(missing_ok=True)
        self.until = None


class SquatCoordinator:
    def __init__(self, seconds: float, run_dir: Path, clock=time.monotonic) -> None:
        self.seconds, self.run_dir, self.clock = seconds, run_dir, clock
        self.what = f"kill -9 of the coordinator, its ports squatted for {seconds:.0f} s"
        self.held: list = []  # the squatter's sockets, while it holds the ports
        self.until: float | None = None
        self.context = None
        self.swallowed = 0  # reports that reached the squatter instead of the coordinator
        self.forged = 0  # Controls it published

    def fire(self, launcher_pid: int, rng: random.Random) -> dict[str, Any]:
        import zmq

        from horizonrl.core.config import load_config
        from horizonrl.protocol import Control, encode

        if self.until is not None:
            return {"pid": None, "note": "the ports are squatted already"}
        victims = run_processes(launcher_pid, "coordinator")
        if not victims:
            return {"pid": None, "note": "no coordinator alive (still restarting?)"}
        config = load_config(RunDir(self.run_dir).config)
        net = config.network
        victims[0].kill()
        self.context = zmq.Context()
        pub, pull = self.context.socket(zmq.PUB), self.context.socket(zmq.PULL)
        bound, deadline = [], self.clock() + 2.0
        for sock, port in ((pub, net.control_port), (pull, net.report_port)):
            while self.clock() < deadline:
                try:
                    sock.bind(net.endpoint(port))
                    bound.append(port)
                    break
                except zmq.ZMQError:
                    time.sleep(0.01)  # the dead coordinator's sockets are still closing, or a launcher holds them
        self.held = [pub, pull]
        self.forged_control = encode(Control(run_id=config.run.run_id, learner_step=config.learner.total_steps,
                                             max_turns=1, weight_version=0, pause_rollout=True, end_training=True))
        self.until = self.clock() + self.seconds
        return {"pid": victims[0].pid, "did": f"kill -9 coordinator pid {victims[0].pid}; bound {len(bound)} of its 2 "
                                              "ports" + ("" if bound else " (none: they are held for the run)"),
                "ports_squatted": len(bound)}

    def tick(self) -> None:
        import zmq

        if self.until is None:
            return
        if self.clock() >= self.until:
            self.end()
            return
        pub, pull = self.held
        pub.send(self.forged_control)
        self.forged += 1
        while True:
            try:
                pull.recv(zmq.NOBLOCK)
                self.swallowed += 1
            except zmq.ZMQError:
                break

    def end(self) -> None:
        for sock in self.held:
            sock.close(linger=0)
        self.held = []
        if self.context is not None:
            self.context.term()
            self.context = None
        self.until = None


class FakeJoin:
    def __init__(self, count: int, run_dir: Path) -> None:
        self.count, self.run_dir = count, run_dir
        self.what = f"{count} joins of the weight hub without the run's key that never receive"
        self.threads: list = []
        self.done = None

    def fire(self, launcher_pid: int, rng: random.Random) -> dict[str, Any]:
        import threading

        from horizonrl.core.config import load_config
        from horizonrl.core.coordinator_state import load_snapshot
        from horizonrl.protocol import ENDPOINT_WEIGHTS
        from horizonrl.protocol.transport import split_endpoint

        config = load_config(RunDir(self.run_dir).config)
        snapshot = load_snapshot(self.run_dir, config.run.run_id)
        endpoint = (snapshot.endpoints.get(ENDPOINT_WEIGHTS) if snapshot is not None else None)
        host, port = (split_endpoint(endpoint) if endpoint else (config.network.host, config.network.weight_port))
        if not port:
            return {"pid": None, "note": "no weight hub registered yet"}
        self.done = self.done or threading.Event()
        for n in range(self.count):
            thread = threading.Thread(target=_never_receiving_member, daemon=True,
                                      args=(host, port, config.run.run_id, 0 if n == 0 else 1000 + n, self.done))
            thread.start()
            self.threads.append(thread)
        return {"pid": None, "did": f"{self.count} keyless joins of the hub at {host}:{port} (one as actor 0)"}

    def tick(self) -> None:
        pass

    def end(self) -> None:
        if self.done is not None:
            self.done.set()


def _never_receiving_member(host: str, port: int, run_id: str, actor: int, done) -> None:
    """Join (without the key), take part in forming the two-rank group if the hub forms one, then never receive."""
    from datetime import timedelta

    import torch.distributed as dist

    from horizonrl.actors.weight_join import announce_join
    from horizonrl.protocol import WeightJoin
    from horizonrl.protocol.weights import member_prefix

    try:
        _, joins, number = announce_join(host, port, 30, WeightJoin(run_id=run_id, actor=actor, pid=os.getpid(),
                                                                    key="not-the-run-key"))
        group = dist.ProcessGroupGloo(dist.PrefixStore(member_prefix(number), joins), 1, 2, timedelta(seconds=30))
        done.wait(3600)  # a member that never takes a version
        del group
    except Exception:  # noqa: BLE001 - refused (the hub wants the key) or gone: that is the point
        pass


def _signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False
