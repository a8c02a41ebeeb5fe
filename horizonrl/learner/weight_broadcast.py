"""Rank 0's side of the weight transfer: host the weight store, admit engines at any time, send versions.

The wire format and the join steps are defined in ``protocol/weights.py``, the bucket plan in
``protocol/weight_buckets.py``; the receiving end is ``actors/weight_receiver.py``. Nothing here
touches the default process group (the learner's FSDP group) except :func:`gather_buckets`, which
every learner rank calls together: each member's group is built directly on the ``TCPStore`` this
process hosts.

A version travels in buckets of at most ``bucket_bytes`` (``learner.weight_bucket_mb``).
:func:`gather_buckets` gathers the sharded parameters one at a time (``DTensor.full_tensor()`` on
the learner's device), in the engine's dtype, straight into a bucket on that device, and hands
each bucket over as it fills; :meth:`WeightHub.publish` broadcasts it to every member before the
next one is gathered. Peak extra device memory is one bucket plus one full parameter, whatever
the model's size; a model smaller than one bucket is one payload collective per update.

Membership is elastic. A background thread admits each engine that joins: it forms the member's
two-rank group and sends it the newest version at once, so a late or restarted engine plays with
the current weights from its first token. A joiner can come while the other learner ranks are
busy in a training step, when nothing can be gathered, so rank 0 keeps the newest version in
host memory (the *admission copy*, filled from each bucket as it is sent: host RAM of one model
in the engine's dtype, no GPU memory). :meth:`WeightHub.publish` gives each new version to every
member, each in its own thread; a member that fails or misses the timeout is dropped (it rejoins
by itself) and never holds the others back longer than that timeout.

Why one group per member rather than one group of 1 + K re-formed on every change: a fixed group
cannot admit anyone, and re-forming it needs every member at a barrier — one stuck engine stalls
all. Per-member groups cost a send per member instead of one collective; on gloo a broadcast to
K ranks is K sends anyway, and ``horizonrl bench --parts weight_sync`` measures the two side by
side (docs/benchmarks.md). On NCCL a ring broadcast would send the bytes once; with the few
engines per learner of this system the difference is K transfers of the weights per version.
A tensor-parallel engine is one member per worker (``WeightJoin.worker``): each worker receives
the full tensors and its loader keeps its own shard.

A member is reached through its *link*: a two-rank group (:class:`GroupLink`), or, for the engine
that shares the learner's GPU (colocated mode; its join names an ``ipc_address``), a CUDA-IPC
staging buffer (:class:`~horizonrl.learner.weight_ipc.IpcSender`). Both take a version as
``begin`` (layout), ``send_bucket`` per bucket, ``finish`` (the engine has it), so everything above
— admission, the admission copy, drops, abandons — is the same for both.
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Iterable, Iterator, Protocol

import torch
import torch.distributed as dist
import zmq

from horizonrl.protocol import ProtocolError, WeightJoin, WeightLayout, decode_as, encode, signed_by
from horizonrl.protocol.weight_buckets import Bucket, plan_buckets
from horizonrl.protocol.weights import (JOIN_COUNTER, STORE_PREFIX, WeightSyncError, join_key, member_bound_s,
                                        member_prefix)

__all__ = ["GroupLink", "Member", "PackedWeights", "WeightHub", "WeightLink", "WeightSyncError", "gather_buckets",
           "layout_of", "gather_without_sending", "use_blocking_nccl_waits"]

log = logging.getLogger("horizonrl.learner.weights")

ADMIT_POLL_S = 0.2
STUCK_MARGIN_S = 5.0  # past a member's bound, how long its transfer thread may still take to notice it
DEFAULT_BUCKET_BYTES = 256 << 20


def use_blocking_nccl_waits() -> None:
    """Make ``Work.wait(timeout)`` on NCCL groups created from now on block the host and raise at the
    timeout. Without it, NCCL's wait only orders streams, the ``.item()`` that follows blocks with no
    bound, and a dead peer hangs the process until the watchdog kills it without a word."""
    os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")


@dataclass
class PackedWeights:
    """The newest version as the hub holds it for joiners: its layout and its buckets in host memory."""

    version: int
    epoch: int
    layout_bytes: bytes
    bucket_bytes: int
    plan: list[Bucket]
    buckets: list[torch.Tensor]  # uint8, one per bucket of ``plan``: the admission copy
    tensors: int
    pack_s: float
    readers: int = 0  # admissions sending it now, outside the hub's lock: it is not rewritten meanwhile

    @property
    def key(self) -> tuple[int, int]:
        return (self.epoch, self.version)

    @property
    def nbytes(self) -> int:
        return sum(bucket.nbytes for bucket in self.plan)


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


def layout_of(named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None):
    """Names, dtype names and shapes of ``named`` as sent: floating tensors in ``dtype`` (the engine's),
    others as they are. A sharded ``DTensor`` counts with its full shape (no communication)."""
    names, dtypes, shapes = [], [], []
    for name, tensor in named:
        names.append(name)
        sent = dtype if (dtype is not None and tensor.is_floating_point()) else tensor.dtype
        dtypes.append(str(sent).removeprefix("torch."))
        shapes.append([int(d) for d in tensor.shape])
    return names, dtypes, shapes


def gather_buckets(named: list[tuple[str, torch.Tensor]], plan: list[Bucket], *, device: torch.device,
                   fill: bool, into: list[torch.Tensor] | None = None) -> Iterator[torch.Tensor | None]:
    """Collective (every learner rank iterates it to the end, in step): yields each bucket of ``plan``
    filled with the full tensors of ``named`` (FSDP-sharded ``DTensor``s are gathered one at a time).

    ``fill``: this rank keeps the bytes (rank 0); the others only take part in the gathers and get
    None. The bucket is a reused buffer on ``device`` (valid until the next one is asked for), or
    ``into[i]`` when given (rank 0 on the CPU fills the admission copy directly, saving a copy).
    Floating tensors are cast to the plan's dtype *before* the gather, so a bf16 engine costs half
    the gathered bytes of fp32 master weights.
    """
    tensors = dict(named)
    staging = None
    if fill and into is None and plan:
        staging = torch.empty(max(b.nbytes for b in plan), dtype=torch.uint8, device=device)
    for bucket in plan:
        target = None
        if fill:
            target = into[bucket.index] if into is not None else staging[: bucket.nbytes]
        for entry in bucket.entries:
            tensor = tensors[entry.name].detach()
            dtype = getattr(torch, entry.dtype)
            if tensor.dtype != dtype:
                tensor = tensor.to(dtype)
            full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            if target is not None:
                raw = target[entry.offset: entry.offset + entry.nbytes]
                raw.view(dtype).view(entry.shape).copy_(full, non_blocking=False)
            del full, tensor
        yield target


class WeightHub:
    """Hosts the weight store at ``host:port`` (listening there only: the address the run binds, loopback
    unless configured otherwise); admits members; sends each version to every member.

    Admission: a join must carry the run's key (``run_key``; "" checks nothing) — without it nothing of the
    hub is spent on it (no group, no version) and it is counted (``unauthenticated_joins``): only the run's
    own engines receive its weights or replace a member.

    Thread safety: one lock guards the members and the newest version (its admission copy); a publish and a
    send hold it. A newcomer's group is formed and its first version sent *outside* it, each admission in its
    own thread with its own bound, so a joiner that never receives costs the publishes nothing: the version it
    reads is marked (``PackedWeights.readers``), and a publish meanwhile fills a new admission copy instead of
    rewriting the one being read.
    """

    def __init__(self, host: str, port: int, *, backend: str, timeout_s: float, run_id: str,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, run_key: str = "") -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"weight-sync backend must be 'gloo' or 'nccl', not {backend!r}")
        self.backend = backend
        self.timeout_s = timeout_s
        self.run_id = run_id
        self.run_key = run_key
        self.host = host
        self.bucket_bytes = int(bucket_bytes)
        self.address = f"{host}:{port}"
        # NCCL moves device memory only (this process's current device); gloo moves host memory.
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        if backend == "nccl":
            use_blocking_nccl_waits()
        try:
            # port 0: a free port (the learner registers the one it got with the coordinator)
            self.store = hosted_store(host, port, None, timedelta(seconds=timeout_s))
        except (RuntimeError, OSError) as exc:
            raise WeightSyncError(f"weight hub: cannot host the weight store at {self.address}: {exc}") from exc
        self.port = self.store.port
        self.address = f"{host}:{self.port}"
        self._joins = dist.PrefixStore(STORE_PREFIX, self.store)
        self.members: dict[tuple[int, int], Member] = {}  # by (actor index, engine worker)
        self.latest: PackedWeights | None = None
        # admitted, replaced, dropped, failed_joins, bad_joins, unauthenticated_joins
        self.counters: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._seen = 0  # join numbers up to this one are handled
        self._waiting: dict[int, float] = {}  # join numbers whose record has not appeared yet -> since
        self._closed = threading.Event()
        self._poller = threading.Thread(target=self._admit_forever, name="weight-hub", daemon=True)
        self._sending: threading.Thread | None = None  # publish(background=True)'s send of the newest version
        self.last_send: dict[str, float] | None = None  # what the last background send measured (None: abandoned)
        # (epoch, version) of a send abandoned after a stop: its members may be mid-version, nothing more is sent
        self.abandoned: tuple[int, int] | None = None
        self._send_error: Exception | None = None
        self._zmq: zmq.Context | None = zmq.Context()  # the sockets of CUDA-IPC members (colocated engine)

    def start(self) -> "WeightHub":
        """Admit joiners from now on (give it a version before, so every joiner gets one)."""
        if self.latest is None:
            raise RuntimeError("pack or publish a version before starting the hub: a joiner must receive one at once")
        self._poller.start()
        return self

    # ------------------------------------------------------------------ versions

    def _admission_copy(self, plan: list[Bucket]) -> list[torch.Tensor]:
        """Host buffers for ``plan``'s buckets, reused while the plan's sizes stay the same (a fresh
        buffer each version costs its page faults inside the timed send: 2-3x slower on 100 MB)."""
        old = self.latest
        if old is not None and not old.readers and [b.nbytes for b in old.plan] == [b.nbytes for b in plan]:
            return old.buckets  # (an admission still reading it: a new copy; the old one goes when it is done)
        self.latest = None  # drop the old copy before allocating the new one
        pin = self.device.type == "cuda"
        return [torch.empty(b.nbytes, dtype=torch.uint8, pin_memory=pin) for b in plan]

    def _layout(self, version: int, epoch: int, names, dtypes, shapes, plan) -> bytes:
        return encode(WeightLayout(run_id=self.run_id, version=version, epoch=epoch, names=names, dtypes=dtypes,
                                   shapes=shapes, total_bytes=sum(b.nbytes for b in plan)))

    def pack(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]], *, epoch: int = 0) -> PackedWeights:
        """Copy full (unsharded, host or device) ``named_tensors`` into the admission copy as the newest
        version, for :meth:`send` (no communication). The learner uses :meth:`publish`; this path serves
        tests, benchmarks and single-process callers."""
        start = time.perf_counter()
        named = [(name, tensor.detach()) for name, tensor in named_tensors]
        names, dtypes, shapes = layout_of(named)
        plan = plan_buckets(names, dtypes, shapes, self.bucket_bytes)
        with self._lock:
            buckets = self._admission_copy(plan)
            for _ in gather_buckets(named, plan, device=torch.device("cpu"), fill=True, into=buckets):
                pass
            self.latest = PackedWeights(version, epoch, self._layout(version, epoch, names, dtypes, shapes, plan),
                                        self.bucket_bytes, plan, buckets, len(named), time.perf_counter() - start)
            return self.latest

    def send(self, packed: PackedWeights,
             should_abandon: Callable[[], bool] | None = None) -> dict[str, float] | None:
        """Give ``packed`` (the newest version) to every member that does not have it, all at once; drop
        those that fail. Returns ``{"pack_s", "send_s", "total_s", "bytes", "tensors", "buckets", "members",
        "dropped"}``, or None when ``should_abandon()`` turned true while members were still receiving."""
        start = time.perf_counter()
        with self._lock:
            if packed is not self.latest:
                raise ValueError(f"version {packed.key} is not the newest packed one; pack it again")
            targets = [m for m in self.members.values() if m.has < packed.key]
            outcome = self._stream(targets, packed.key, packed.layout_bytes, packed.bucket_bytes,
                                   self._sendable(packed), should_abandon, packed.nbytes)
            if outcome is None:
                self.abandoned = packed.key
                return None
            dropped = self._settle(targets, packed.key, outcome)
            members = len(self.members)
        send_s = time.perf_counter() - start
        return {"pack_s": packed.pack_s, "send_s": send_s, "total_s": packed.pack_s + send_s,
                "bytes": float(packed.nbytes), "tensors": float(packed.tensors), "buckets": float(len(packed.plan)),
                "members": float(members), "dropped": float(dropped)}

    def publish(self, version: int, epoch: int, named: list[tuple[str, torch.Tensor]], *,
                dtype: torch.dtype | None = None, should_abandon: Callable[[], bool] | None = None,
                background: bool = False) -> dict[str, float] | None:
        """Rank 0's half of a collective update (the other ranks call :func:`gather_without_sending`):
        gather ``named`` (FSDP-sharded parameters) bucket by bucket on the learner's device, in ``dtype``,
        and broadcast each bucket to every member as it fills; the admission copy is filled on the way.

        Returns :meth:`send`'s statistics with ``gather_s`` (time in the gathers) in place of ``pack_s``,
        or None when ``should_abandon()`` turned true while members were still receiving (the gathers
        still run to the end: the other ranks are in them).

        ``background`` (gloo, where the gathers fill the admission copy in host memory): gather the whole
        version, then send it from the admission copy in a thread and return at once, so the learner trains
        its next step while the engines take this version. The next publish first waits for that send.
        Returns the gather's time and the statistics of the *previous* background send (None if it was
        abandoned). On NCCL the buckets stream from device memory as they are gathered, so it sends in the
        caller's thread as without ``background``."""
        if not self.wait_for_send(should_abandon) or self.abandoned is not None:
            # After a stop: a background send still reads the admission copy, or one abandoned its members
            # mid-version. Nothing more is sent; the gathers still run (every rank is in them).
            gather_without_sending(named, bucket_bytes=self.bucket_bytes, dtype=dtype)
            return None
        if background and self.device.type == "cpu":
            return self._publish_in_background(version, epoch, named, dtype, should_abandon)
        start = time.perf_counter()
        names, dtypes, shapes = layout_of(named, dtype)
        plan = plan_buckets(names, dtypes, shapes, self.bucket_bytes)
        with self._lock:
            buckets = self._admission_copy(plan)
            self.latest = None  # the admission copy is being rewritten: no joiner may read it until the end
            on_device = self.device.type != "cpu"
            gathered = gather_buckets(named, plan, device=self.device, fill=True, into=None if on_device else buckets)
            gather_s = [0.0]

            def timed_buckets() -> Iterator[torch.Tensor]:
                for bucket in plan:
                    began = time.perf_counter()
                    tensor = next(gathered)
                    if on_device:
                        buckets[bucket.index].copy_(tensor)  # the admission copy; also orders the gather first
                    gather_s[0] += time.perf_counter() - began
                    yield tensor

            key = (epoch, version)
            targets = [m for m in self.members.values() if m.has < key]
            layout_bytes = self._layout(version, epoch, names, dtypes, shapes, plan)
            outcome = self._stream(targets, key, layout_bytes, self.bucket_bytes, timed_buckets(), should_abandon,
                                   sum(b.nbytes for b in plan))
            for _ in gathered:  # after an abandon: the gathers still left (every rank is in them)
                pass
            self.latest = PackedWeights(version, epoch, layout_bytes, self.bucket_bytes, plan, buckets, len(names),
                                        gather_s[0])
            if outcome is None:
                self.abandoned = key
                return None
            dropped = self._settle(targets, key, outcome)
            members = len(self.members)
        total_s = time.perf_counter() - start
        return {"gather_s": gather_s[0], "send_s": total_s - gather_s[0], "total_s": total_s,
                "bytes": float(self.latest.nbytes), "tensors": float(len(names)), "buckets": float(len(plan)),
                "members": float(members), "dropped": float(dropped)}

    def _publish_in_background(self, version: int, epoch: int, named: list[tuple[str, torch.Tensor]],
                               dtype: torch.dtype | None, should_abandon: Callable[[], bool] | None) -> dict:
        previous, self.last_send = self.last_send, None
        start = time.perf_counter()
        names, dtypes, shapes = layout_of(named, dtype)
        plan = plan_buckets(names, dtypes, shapes, self.bucket_bytes)
        with self._lock:
            buckets = self._admission_copy(plan)
            self.latest = None  # being rewritten: no joiner may read it until the end
            for _ in gather_buckets(named, plan, device=self.device, fill=True, into=buckets):
                pass
            gather_s = time.perf_counter() - start
            self.latest = PackedWeights(version, epoch, self._layout(version, epoch, names, dtypes, shapes, plan),
                                        self.bucket_bytes, plan, buckets, len(names), gather_s)
            packed = self.latest
        self._sending = threading.Thread(target=self._send_in_background, args=(packed, should_abandon),
                                         name=f"weights-v{version}", daemon=True)
        self._sending.start()
        previous = previous or {"send_s": 0.0, "members": float(len(self.members)), "dropped": 0.0}
        return {"gather_s": gather_s, "send_s": previous["send_s"], "total_s": gather_s + previous["send_s"],
                "bytes": float(packed.nbytes), "tensors": float(len(names)), "buckets": float(len(plan)),
                "members": previous["members"], "dropped": previous["dropped"]}

    def _send_in_background(self, packed: PackedWeights, should_abandon: Callable[[], bool] | None) -> None:
        try:
            self.last_send = self.send(packed, should_abandon)
        except Exception as exc:  # noqa: BLE001 - raised again in the learner's thread by wait_for_send
            self._send_error = exc

    def wait_for_send(self, should_abandon: Callable[[], bool] | None = None) -> bool:
        """Until the background send, if one runs, has ended (``last_send`` then holds its statistics, None
        when it abandoned its members); True then. False, with the send still running, once
        ``should_abandon()`` turned true first. A send that failed raises its error here."""
        thread = self._sending
        while thread is not None and thread.is_alive():
            thread.join(0.1)
            if thread.is_alive() and should_abandon is not None and should_abandon():
                return False
        self._sending = None
        error, self._send_error = self._send_error, None
        if error is not None:
            raise error
        return True

    def _sendable(self, packed: PackedWeights) -> Iterator[torch.Tensor]:
        """``packed``'s buckets as the links take them: the admission copy itself on gloo; on a GPU each bucket
        copied from host memory into one device buffer, reused bucket after bucket (NCCL moves device memory
        only: handed a host tensor it raises, and no engine would ever be admitted). A bucket is sent in full
        before the next one is asked for, so one buffer serves; extra device memory: the largest bucket, while
        a version is sent from the admission copy (a join, :meth:`send`)."""
        if self.device.type == "cpu":
            yield from packed.buckets
            return
        staging = torch.empty(max((b.nbytes for b in packed.plan), default=1), dtype=torch.uint8, device=self.device)
        for bucket, host in zip(packed.plan, packed.buckets):
            target = staging[: bucket.nbytes]
            target.copy_(host)  # synchronous from pageable or pinned memory: done before the collective reads it
            yield target

    def _settle(self, targets: list[Member], key: tuple[int, int], failures: list[tuple[Member, Exception]]) -> int:
        failed = {id(member) for member, _ in failures}
        for member in targets:
            if id(member) not in failed:
                member.has = key
        for member, error in failures:
            self._drop(member, error)
        return len(failures)

    def _stream(self, targets: list[Member], key: tuple[int, int], layout_bytes: bytes, bucket_bytes: int,
                buckets: Iterator[torch.Tensor], should_abandon: Callable[[], bool] | None, nbytes: int):
        """Header, layout, each bucket as ``buckets`` yields it, acknowledgement: to every member in
        ``targets`` at once. Returns the members that failed, with why, or None when abandoned. A member
        that fails stops receiving; ``buckets`` is consumed to the end all the same (it drives gathers).
        Each step of it is bounded by :func:`member_bound_s` of the version's ``nbytes``: a frozen member is
        dropped after that, and holds the others (and the learner) no longer."""
        bound_s = member_bound_s(nbytes, self.timeout_s)
        alive = list(targets)
        failures: list[tuple[Member, Exception]] = []
        abandoned = False

        def to_all(action: Callable[[Member], None]) -> None:
            nonlocal alive, abandoned
            if abandoned or not alive:
                return
            failed = self._run_for_each(alive, action, should_abandon, bound_s)
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

    def _run_for_each(self, members: list[Member], action: Callable[[Member], None],
                      should_abandon: Callable[[], bool] | None,
                      bound_s: float) -> list[tuple[Member, Exception]] | None:
        """``action(member)`` for every member at once, one thread each (the collectives release the GIL); the
        members whose action failed, or None when ``should_abandon()`` turned true before all finished.

        Each action bounds its own waits by ``bound_s``; its thread is given ``bound_s`` + a margin all the
        same, and one still running then is a failure of its member: a call that blocks before its wait begins
        — NCCL creates a group's communicator inside the first collective, and waits for the peer there with no
        time-out — or a link that ignores its bound must not hold the hub (its lock: every other member's
        version and every admission wait behind it). The stuck thread is left behind; closing the member's
        link (:meth:`_drop`) ends it where the backend can."""
        failures: list[tuple[Member, Exception]] = []

        def run(member: Member) -> None:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # threads start on device 0
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

    def _drop(self, member: Member, error: Exception) -> None:
        log.warning("dropped actor %d worker %d from the weight hub (it rejoins by itself): %s", member.actor,
                    member.worker, error)
        self.counters["dropped"] += 1
        if self.members.get(member.key) is member:
            del self.members[member.key]
        member.close()

    # ------------------------------------------------------------------ admission

    def _admit_forever(self) -> None:
        while not self._closed.wait(ADMIT_POLL_S):
            try:
                count = self._joins.add(JOIN_COUNTER, 0)
            except RuntimeError as exc:
                log.warning("weight hub: reading the join counter failed: %s", exc)
                continue
            now = time.monotonic()
            for number in range(self._seen + 1, count + 1):
                self._waiting.setdefault(number, now)
            self._seen = max(self._seen, count)
            for number, since in list(self._waiting.items()):
                if self._joins.check([join_key(number)]):
                    del self._waiting[number]
                    threading.Thread(target=self._admit, args=(number,), name=f"weight-join-{number}",
                                     daemon=True).start()
                elif now - since > self.timeout_s:  # the joiner died between its two steps
                    del self._waiting[number]
                    self.counters["failed_joins"] += 1
                    log.warning("weight hub: join %d never said who it is; forgotten", number)

    def _admit(self, number: int) -> None:
        try:
            join = decode_as(self._joins.get(join_key(number)), WeightJoin, run_id=self.run_id)
        except (ProtocolError, RuntimeError) as exc:  # another run's engine, or not a join at all
            self.counters["bad_joins"] += 1
            log.warning("weight hub: refused join %d: %s", number, exc)
            return
        if not signed_by(join, self.run_key):
            self.counters["unauthenticated_joins"] += 1  # nothing spent on it: no group, no version
            log.warning("weight hub: refused join %d (actor %d, pid %d): without the run's key", number, join.actor,
                        join.pid)
            return
        worker = int(getattr(join, "worker", 0))
        try:
            if join.ipc_address:
                link = self._connect_ipc(join)
            else:
                link = GroupLink(self._form_group(number), self.device, group_timeout_s=self.timeout_s)
        except WeightSyncError as exc:
            self.counters["failed_joins"] += 1
            log.warning("weight hub: actor %d worker %d (pid %d) did not complete its join %d: %s", join.actor, worker,
                        join.pid, number, exc)
            return
        member = Member(number, join.actor, worker, join.pid, link)
        latest = self._first_version(member)
        if latest is None:
            return
        with self._lock:
            if self._closed.is_set():
                member.close()
                return
            member.has = latest.key  # a version published meanwhile reaches it with the next publish
            previous = self.members.get(member.key)
            if previous is not None:
                self.counters["replaced"] += 1
                previous.close()
            self.members[member.key] = member
            self.counters["admitted"] += 1
        log.info("admitted actor %d's engine worker %d (pid %d, join %d%s) at weights %s (epoch, version)%s",
                 join.actor, worker, join.pid, number, ", CUDA IPC" if join.ipc_address else "", member.has,
                 "; it replaces an earlier one" if previous is not None else "")

    def _first_version(self, member: Member) -> PackedWeights | None:
        """Send a newcomer the newest version, outside the hub's lock (publishes go on meanwhile: the copy it
        reads is marked and not rewritten) and bounded like any member's version; the version it got, or None
        (it failed: counted, closed)."""
        with self._lock:
            latest = self.latest
            if self._closed.is_set() or latest is None:
                # latest is None only while a version is being written (or after one failed half-way)
                self.counters["failed_joins"] += int(not self._closed.is_set())
                member.close()
                return None
            latest.readers += 1
        try:
            outcome = self._stream([member], latest.key, latest.layout_bytes, latest.bucket_bytes,
                                   self._sendable(latest), None, latest.nbytes)
        finally:
            with self._lock:
                latest.readers -= 1
        if outcome:
            self.counters["failed_joins"] += 1
            log.warning("weight hub: actor %d worker %d's first version failed: %s", member.actor, member.worker,
                        outcome[0][1])
            member.close()
            return None
        return latest

    def _connect_ipc(self, join: WeightJoin) -> WeightLink:
        """The link of an engine on this GPU (colocated): a PAIR socket to the address it listens on."""
        from horizonrl.learner.weight_ipc import IpcSender

        if self.device.type != "cuda":
            raise WeightSyncError(f"actor {join.actor} asked for CUDA IPC, but this hub runs on the CPU "
                                  f"({self.backend}): only an engine on the learner's GPU can take weights that way")
        if not join.ipc_address.startswith("tcp://"):
            raise WeightSyncError(f"actor {join.actor}'s CUDA-IPC address {join.ipc_address!r} is not tcp://HOST:PORT")
        if self._zmq is None:
            raise WeightSyncError("weight hub: closed")
        sock = self._zmq.socket(zmq.PAIR)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(join.ipc_address)
        return IpcSender(sock, self.device, self.timeout_s)

    def _form_group(self, number: int) -> dist.ProcessGroup:
        timeout = timedelta(seconds=self.timeout_s)
        store = dist.PrefixStore(member_prefix(number), self._joins)
        try:
            if self.backend == "nccl":
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = timeout
                return dist.ProcessGroupNCCL(store, 0, 2, options)
            return dist.ProcessGroupGloo(store, 0, 2, gloo_options(self.host, timeout))
        except RuntimeError as exc:  # DistStoreError / DistNetworkError / DistBackendError
            raise WeightSyncError(f"group of join {number} at {self.address} ({self.backend}) not formed within "
                                  f"{self.timeout_s:.0f} s: {exc}") from exc

    def close(self) -> None:
        """Admit no one more and close every member's group (the store lives until the process ends)."""
        self._closed.set()
        with self._lock:
            for member in self.members.values():
                member.close()
            self.members.clear()
            if self._zmq is not None:
                self._zmq.destroy(linger=0)  # also a socket an admission thread is still connecting
                self._zmq = None
        if not wait_for_dropped_groups(self.timeout_s + STUCK_MARGIN_S):
            log.warning("weight hub: a dropped member's group was still being destroyed %.0f s after the hub closed "
                        "(its engine frozen?)", self.timeout_s + STUCK_MARGIN_S)


def hosted_store(host: str, port: int, world_size: int | None, timeout: timedelta) -> dist.TCPStore:
    """A TCPStore server listening on ``host`` alone (port 0: a free one). ``TCPStore`` by itself listens on
    every interface of the machine whatever host it is given; here it is handed a socket bound to ``host``
    (the run's bind address: loopback unless configured otherwise)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(128)
        bound_port = listener.getsockname()[1]
    except OSError:
        listener.close()
        raise
    return dist.TCPStore(host, bound_port, world_size, True, timeout, wait_for_workers=False,
                         master_listen_fd=listener.detach())


def gloo_options(host: str, timeout: timedelta) -> "dist.ProcessGroupGloo._Options":
    """A gloo group's options with its device on ``host``: its pair sockets listen there, not on whatever
    address the machine's hostname resolves to."""
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return options


def gather_without_sending(named: list[tuple[str, torch.Tensor]], *, bucket_bytes: int,
                           dtype: torch.dtype | None = None) -> None:
    """A learner rank's part in :meth:`WeightHub.publish` when it sends nothing: the same gathers, in the same
    order, nothing kept (the plan is computed from the same names, dtypes and shapes as rank 0's). Every rank
    other than 0 calls it, and rank 0 too once a stop has abandoned the sending (the other ranks are still
    in the gathers)."""
    names, dtypes, shapes = layout_of(named, dtype)
    plan = plan_buckets(names, dtypes, shapes, bucket_bytes)
    for _ in gather_buckets(named, plan, device=torch.device("cpu"), fill=False):
        pass


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
