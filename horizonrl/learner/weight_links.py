"""How the weight hub reaches each member (``weight_broadcast.py``): a :class:`WeightLink` — a two-rank group
(:class:`GroupLink`), or a CUDA-IPC staging buffer for the engine on the learner's GPU (``weight_ipc.IpcSender``) —
every call bounded; a :class:`Member` is one engine worker and its link. A dropped group is destroyed by a thread
of its own (:func:`_destroy_in_background`): its destructor may block until the group's own timeout."""

from __future__ import annotations

import gc
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Iterator, Protocol

import torch
import torch.distributed as dist

from horizonrl.protocol.weights import WeightSyncError, member_bound_s

log = logging.getLogger("horizonrl.learner.weights")


STUCK_MARGIN_S = 5.0  # past a member's bound, how long its transfer thread may still take to notice it


def use_blocking_nccl_waits() -> None:
    """Make ``Work.wait(timeout)`` on NCCL groups created from now on block the host and raise at the
    timeout. Without it, NCCL's wait only orders streams, the ``.item()`` that follows blocks with no
    bound, and a dead peer hangs the process until the watchdog kills it without a word."""
    os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")


class WeightLink(Protocol):
    """How the hub reaches one member; every call bounded by ``timeout_s``, failures are WeightSyncError."""

    def begin(self, layout_bytes: bytes, bucket_bytes: int, what: str, timeout_s: float) -> None: ...
    def send_bucket(self, index: int, data: torch.Tensor, what: str, timeout_s: float) -> None: ...
    def finish(self, what: str, timeout_s: float) -> None: ...  # returns once the member has the version
    def close(self) -> None: ...


class GroupLink:
    """A member's two-rank group, this process rank 0: a version as header, layout, buckets and an
    all-reduced acknowledgement (``protocol/weights.py``), each collective bounded by ``timeout_s``
    (the hub's, passed with each call)."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, group_timeout_s: float = 0.0) -> None:
        self.group: dist.ProcessGroup | None = group
        self.device = device
        self.group_timeout_s = group_timeout_s  # the group's own timeout (its transfers give up after it)

    def begin(self, layout_bytes: bytes, bucket_bytes: int, what: str, timeout_s: float) -> None:
        header = torch.tensor([len(layout_bytes), bucket_bytes], dtype=torch.int64, device=self.device)
        layout = torch.frombuffer(bytearray(layout_bytes), dtype=torch.uint8).to(self.device)
        _broadcast(self.group, header, timeout_s, f"header of {what}")
        _broadcast(self.group, layout, timeout_s, f"layout of {what}")

    def send_bucket(self, index: int, data: torch.Tensor, what: str, timeout_s: float) -> None:
        _broadcast(self.group, data, timeout_s, f"bucket {index} of {what}")

    def finish(self, what: str, timeout_s: float) -> None:
        ack = torch.zeros(1, dtype=torch.int64, device=self.device)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.SUM
        _wait(lambda: self.group.allreduce([ack], options), timeout_s, f"acknowledgement of {what}")
        if int(ack.item()) != 1:  # bounded: the wait above completed (blocking waits on NCCL)
            raise WeightSyncError(f"weight hub: {what} acknowledged {int(ack.item())} times, not once")

    def close(self) -> None:
        group, self.group = self.group, None
        if group is None:
            return
        shutdown = getattr(group, "shutdown", None)
        if callable(shutdown):
            try:
                shutdown()
            except Exception:  # best effort: the engine may be gone already
                pass
        # Destroying a gloo group whose peer is frozen with a transfer pending blocks the thread that drops the
        # last reference until the group's own timeout ends that transfer (shutdown() and abort() do not end it;
        # measured: 57 s of a 60 s timeout). Its last references sit in a reference cycle (the time-out's
        # traceback), so the garbage collector dropped them in whichever thread it ran: the learner's training
        # step, stalled for the rest of the timeout (38 s in a stragglers run). So the group is destroyed by a
        # thread of its own. Not kept alive either: destroying it closes its connections, which is how a healthy
        # engine's pending receive on it learns at once that its membership has ended.
        _destroy_in_background(group, self.group_timeout_s + STUCK_MARGIN_S)


_DESTROYERS: list[tuple[threading.Thread, threading.Event]] = []  # each thread, and the event that ends its wait


_DESTROYERS_LOCK = threading.Lock()  # links close from the hub's transfer threads as well as its own


def _destroy_in_background(group: dist.ProcessGroup, wait_s: float) -> None:
    """Drop the last reference to ``group`` in a daemon thread, so that its destructor runs (and blocks, if it does)
    there. Other references are waited for, at most ``wait_s`` (the group's timeout, after which its transfers
    have given up and destroying it costs nothing) or until :func:`wait_for_dropped_groups`: frames of a thread
    still inside a transfer, and reference cycles, which this thread's collections break."""
    held = [group]
    del group
    give_up = threading.Event()

    def destroy() -> None:
        deadline = time.monotonic() + wait_s
        collected_at = 0.0
        # 2: the list's reference and the argument's
        while sys.getrefcount(held[0]) > 2 and time.monotonic() < deadline and not give_up.is_set():
            if time.monotonic() - collected_at > 1.0:
                gc.collect()
                collected_at = time.monotonic()
            else:
                give_up.wait(0.05)
        held.clear()

    thread = threading.Thread(target=destroy, name="destroy-dropped-group", daemon=True)
    with _DESTROYERS_LOCK:  # started under the lock: a join of a thread not yet started would raise
        thread.start()
        _DESTROYERS[:] = [(t, e) for t, e in _DESTROYERS if t.is_alive()] + [(thread, give_up)]


def wait_for_dropped_groups(timeout_s: float) -> bool:
    """Whether every dropped group was destroyed within ``timeout_s``. A process that exits while a daemon thread
    is inside gloo's destructor aborts ("terminate called without an active exception"): the hub waits for those
    on close. A thread still waiting for another holder drops its reference at once (the group then goes with
    that holder): something that keeps it for long — pytest's log capture keeps each record and its error — must
    not hold the learner's exit for the group's timeout."""
    with _DESTROYERS_LOCK:
        destroyers = list(_DESTROYERS)
    for _, give_up in destroyers:
        give_up.set()
    deadline = time.monotonic() + timeout_s
    for thread, _ in destroyers:
        thread.join(max(0.0, deadline - time.monotonic()))
    return not any(t.is_alive() for t, _ in destroyers)


@dataclass
class Member:
    """One engine worker in the hub: its join, its link (:class:`GroupLink`, or an ``IpcSender`` for the
    engine on the learner's GPU), the newest version it acknowledged."""

    number: int
    actor: int
    worker: int
    pid: int
    link: WeightLink  # GroupLink, or learner.weight_ipc.IpcSender
    has: tuple[int, int] = (-1, -1)  # (epoch, version)

    @property
    def key(self) -> tuple[int, int]:
        return (self.actor, self.worker)

    def close(self) -> None:
        """Close the link, waiting at most :data:`STUCK_MARGIN_S`: a backend may block closing a group whose
        transfer is stuck (an NCCL communicator that never formed), and the hub must not block with it."""
        closing = threading.Thread(target=self.link.close, name=f"close-actor-{self.actor}-{self.worker}", daemon=True)
        closing.start()
        closing.join(STUCK_MARGIN_S)
        if closing.is_alive():
            log.warning("weight hub: closing actor %d worker %d's link did not finish within %.0f s; left behind",
                        self.actor, self.worker, STUCK_MARGIN_S)


def gloo_options(host: str, timeout: timedelta) -> "dist.ProcessGroupGloo._Options":
    """A gloo group's options with its device on ``host``: its pair sockets listen there, not on whatever
    address the machine's hostname resolves to."""
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return options


def _broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, timeout_s: float, what: str) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    _wait(lambda: group.broadcast([tensor], options), timeout_s, what)


def _wait(start_work, timeout_s: float, what: str) -> None:
    try:
        completed = start_work().wait(timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise WeightSyncError(f"weight hub: {what} did not complete within {timeout_s:.0f} s: {exc}") from exc
    if completed is False:
        raise WeightSyncError(f"weight hub: {what} did not complete within {timeout_s:.0f} s")


# ---------------------------------------------------------------------------- a version to several members at once


def stream_version(targets: list[Member], key: tuple[int, int], layout_bytes: bytes, bucket_bytes: int,
                   buckets: Iterator[torch.Tensor], should_abandon: Callable[[], bool] | None, nbytes: int, *,
                   timeout_s: float, device: torch.device) -> list[tuple[Member, Exception]] | None:
    """Header, layout, each bucket as ``buckets`` yields it, acknowledgement: to every member in
    ``targets`` at once. Returns the members that failed, with why, or None when abandoned. A member
    that fails stops receiving; ``buckets`` is consumed to the end all the same (it drives gathers).
    Each step of it is bounded by :func:`member_bound_s` of the version's ``nbytes``: a frozen member is
    dropped after that, and holds the others (and the learner) no longer."""
    bound_s = member_bound_s(nbytes, timeout_s)
    alive = list(targets)
    failures: list[tuple[Member, Exception]] = []
    abandoned = False

    def to_all(action: Callable[[Member], None]) -> None:
        nonlocal alive, abandoned
        if abandoned or not alive:
            return
        failed = run_for_each(alive, action, should_abandon, bound_s, device)
        if failed is None:
            abandoned = True
            return
        failures.extend(failed)
        gone = {id(member) for member, _ in failed}
        alive = [member for member in alive if id(member) not in gone]

    def what(m: Member) -> str:
        return f"version {key} (epoch, version) to actor {m.actor} worker {m.worker} (join {m.number})"

    to_all(lambda m: m.link.begin(layout_bytes, bucket_bytes, what(m), bound_s))
    for index, bucket in enumerate(buckets):
        to_all(lambda m: m.link.send_bucket(index, bucket, what(m), bound_s))
    to_all(lambda m: m.link.finish(what(m), bound_s))
    return None if abandoned else failures


def run_for_each(members: list[Member], action: Callable[[Member], None], should_abandon: Callable[[], bool] | None,
                 bound_s: float, device: torch.device) -> list[tuple[Member, Exception]] | None:
    """``action(member)`` for every member at once, one thread each (the collectives release the GIL); the
    members whose action failed, or None when ``should_abandon()`` turned true before all finished.

    Each action bounds its own waits by ``bound_s``; its thread is given ``bound_s`` + a margin all the
    same, and one still running then is a failure of its member: a call that blocks before its wait begins
    — NCCL creates a group's communicator inside the first collective, and waits for the peer there with no
    time-out — or a link that ignores its bound must not hold the hub (its lock: every other member's
    version and every admission wait behind it). The stuck thread is left behind; closing the member's
    link (the hub drops it) ends it where the backend can."""
    failures: list[tuple[Member, Exception]] = []

    def run(member: Member) -> None:
        if device.type == "cuda":
            torch.cuda.set_device(device)  # threads start on device 0
        try:
            action(member)
        except WeightSyncError as exc:
            failures.append((member, exc))
        except Exception as exc:  # noqa: BLE001 - any failure of one member's link drops that member alone
            failures.append((member, WeightSyncError(f"weight hub: actor {member.actor} worker {member.worker}: "
                                                     f"{type(exc).__name__}: {exc}")))

    threads = {m.key: threading.Thread(target=run, args=(m,), name=f"weights-to-actor-{m.actor}-{m.worker}",
                                       daemon=True) for m in members}
    for thread in threads.values():
        thread.start()
    deadline = time.monotonic() + bound_s + STUCK_MARGIN_S
    for member in members:
        thread = threads[member.key]
        while thread.is_alive() and time.monotonic() < deadline:
            thread.join(0.1)
            if thread.is_alive() and should_abandon is not None and should_abandon():
                return None
        if thread.is_alive():
            failures.append((member, WeightSyncError(
                f"weight hub: actor {member.actor} worker {member.worker} was still inside a transfer "
                f"{bound_s + STUCK_MARGIN_S:.0f} s after it began (a frozen engine, or a communicator that never "
                "formed): dropped")))
    return list(failures)

