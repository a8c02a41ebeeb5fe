"""Rank 0's side of the weight transfer: host the weight store, admit engines at any time, send versions.

The wire format and the join steps are defined in ``protocol/weights.py``, the bucket plan in
``protocol/weight_buckets.py``; the receiving end is ``actors/weight_receiver.py``. Nothing here
touches the default process group (the learner's FSDP group) except :func:`gather_buckets`, which
every learner rank calls together (``weight_gather.py``): each member's group is built directly on the ``TCPStore`` this
process hosts.

A version travels in buckets of at most ``bucket_bytes`` (``learner.weight_bucket_mb``).
:func:`gather_buckets` gathers the sharded parameters one at a time (``DTensor.full_tensor()`` on
the learner's device), in the engine's dtype, straight into a bucket on that device, and hands
each bucket over as it fills; :meth:`WeightHub.publish` broadcasts it to every member before the
next one is gathered. Peak extra device memory is one bucket plus one full parameter, whatever
the model's size; a model smaller than one bucket is one payload collective per update.

Membership is elastic. A background thread admits each engine that joins (``weight_admission.JoinDesk``):
it forms the member's two-rank group, and the hub sends it the newest version at once, so a late or
restarted engine plays with the current weights from its first token. A joiner can come while the
other learner ranks are busy in a training step, when nothing can be gathered, so rank 0 keeps the newest version in
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

A member is reached through its *link* (``weight_links.py``): a two-rank group (``GroupLink``), or, for
the engine that shares the learner's GPU (colocated mode; its join names an ``ipc_address``), a CUDA-IPC
staging buffer (:class:`~horizonrl.learner.weight_ipc.IpcSender`). Both take a version as
``begin`` (layout), ``send_bucket`` per bucket, ``finish`` (the engine has it), so everything above
— admission, the admission copy, drops, abandons — is the same for both.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from horizonrl.learner.weight_admission import JoinDesk
from horizonrl.learner.weight_gather import gather_buckets, gather_without_sending, layout_of
from horizonrl.learner.weight_links import (STUCK_MARGIN_S, Member, WeightLink, stream_version,
                                            use_blocking_nccl_waits, wait_for_dropped_groups)
from horizonrl.protocol import WeightJoin, WeightLayout, encode
from horizonrl.protocol.weight_buckets import Bucket, plan_buckets
from horizonrl.protocol.weights import STORE_PREFIX, WeightSyncError

__all__ = ["PackedWeights", "WeightHub", "WeightSyncError", "hosted_store"]

log = logging.getLogger("horizonrl.learner.weights")

DEFAULT_BUCKET_BYTES = 256 << 20


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


def sendable_buckets(packed: PackedWeights, device: torch.device) -> Iterator[torch.Tensor]:
    """``packed``'s buckets as the links take them: the admission copy itself on gloo; on a GPU each bucket
    copied from host memory into one device buffer, reused bucket after bucket (NCCL moves device memory
    only: handed a host tensor it raises, and no engine would ever be admitted). A bucket is sent in full
    before the next one is asked for, so one buffer serves; extra device memory: the largest bucket, while
    a version is sent from the admission copy (a join, ``WeightHub.send``)."""
    if device.type == "cpu":
        yield from packed.buckets
        return
    staging = torch.empty(max((b.nbytes for b in packed.plan), default=1), dtype=torch.uint8, device=device)
    for bucket, host in zip(packed.plan, packed.buckets):
        target = staging[: bucket.nbytes]
        target.copy_(host)  # synchronous from pageable or pinned memory: done before the collective reads it
        yield target


def layout_message(run_id: str, version: int, epoch: int, names, dtypes, shapes, plan: list[Bucket]) -> bytes:
    """A version's ``WeightLayout`` as sent ahead of its buckets."""
    return encode(WeightLayout(run_id=run_id, version=version, epoch=epoch, names=names, dtypes=dtypes, shapes=shapes,
                               total_bytes=sum(b.nbytes for b in plan)))


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
        self.members: dict[tuple[int, int], Member] = {}  # by (actor index, engine worker)
        self.latest: PackedWeights | None = None
        # admitted, replaced, dropped, failed_joins, bad_joins, unauthenticated_joins
        self.counters: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self.desk = JoinDesk(dist.PrefixStore(STORE_PREFIX, self.store), run_id=run_id, run_key=run_key, host=host,
                             address=self.address, backend=backend, device=self.device, timeout_s=timeout_s,
                             counters=self.counters, closed=self._closed, admit=self._admit)
        self._sending: threading.Thread | None = None  # publish(background=True)'s send of the newest version
        self.last_send: dict[str, float] | None = None  # what the last background send measured (None: abandoned)
        # (epoch, version) of a send abandoned after a stop: its members may be mid-version, nothing more is sent
        self.abandoned: tuple[int, int] | None = None
        self._send_error: Exception | None = None

    def start(self) -> "WeightHub":
        """Admit joiners from now on (give it a version before, so every joiner gets one)."""
        if self.latest is None:
            raise RuntimeError("pack or publish a version before starting the hub: a joiner must receive one at once")
        self.desk.start()
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

    def pack(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]], *, epoch: int = 0) -> PackedWeights:
        """Copy full (unsharded, host or device) ``named_tensors`` into the admission copy as the newest
        version, for :meth:`send` (no communication). The learner uses :meth:`publish`; this path serves
        tests, benchmarks and single-process callers."""
        named = [(name, tensor.detach()) for name, tensor in named_tensors]
        with self._lock:
            return self._fill_admission_copy(version, epoch, named, None, torch.device("cpu"))

    def _fill_admission_copy(self, version: int, epoch: int, named: list[tuple[str, torch.Tensor]],
                             dtype: torch.dtype | None, device: torch.device) -> PackedWeights:
        """Under the lock: ``named`` gathered (in ``dtype``, on ``device``) into the admission copy, the newest
        version."""
        start = time.perf_counter()
        names, dtypes, shapes = layout_of(named, dtype)
        plan = plan_buckets(names, dtypes, shapes, self.bucket_bytes)
        buckets = self._admission_copy(plan)
        self.latest = None  # being rewritten: no joiner may read it until the end
        for _ in gather_buckets(named, plan, device=device, fill=True, into=buckets):
            pass
        self.latest = PackedWeights(version, epoch, layout_message(self.run_id, version, epoch, names, dtypes, shapes,
                                                                   plan), self.bucket_bytes, plan, buckets, len(named),
                                    time.perf_counter() - start)
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
            outcome = stream_version(targets, packed.key, packed.layout_bytes, packed.bucket_bytes,
                                     sendable_buckets(packed, self.device), should_abandon, packed.nbytes,
                                     **self._bounds)
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
            layout_bytes = layout_message(self.run_id, version, epoch, names, dtypes, shapes, plan)
            outcome = stream_version(targets, key, layout_bytes, self.bucket_bytes, timed_buckets(), should_abandon,
                                     sum(b.nbytes for b in plan), **self._bounds)
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
        with self._lock:
            packed = self._fill_admission_copy(version, epoch, named, dtype, self.device)
        gather_s, names, plan = packed.pack_s, packed.tensors, packed.plan
        self._sending = threading.Thread(target=self._send_in_background, args=(packed, should_abandon),
                                         name=f"weights-v{version}", daemon=True)
        self._sending.start()
        previous = previous or {"send_s": 0.0, "members": float(len(self.members)), "dropped": 0.0}
        return {"gather_s": gather_s, "send_s": previous["send_s"], "total_s": gather_s + previous["send_s"],
                "bytes": float(packed.nbytes), "tensors": float(names), "buckets": float(len(plan)),
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

    @property
    def _bounds(self) -> dict:
        """What bounds each member's transfer (read at each send: a test shortens the timeout of a live hub)."""
        return {"timeout_s": self.timeout_s, "device": self.device}

    def _settle(self, targets: list[Member], key: tuple[int, int], failures: list[tuple[Member, Exception]]) -> int:
        failed = {id(member) for member, _ in failures}
        for member in targets:
            if id(member) not in failed:
                member.has = key
        for member, error in failures:
            self._drop(member, error)
        return len(failures)

    def _drop(self, member: Member, error: Exception) -> None:
        log.warning("dropped actor %d worker %d from the weight hub (it rejoins by itself): %s", member.actor,
                    member.worker, error)
        self.counters["dropped"] += 1
        if self.members.get(member.key) is member:
            del self.members[member.key]
        member.close()

    # ------------------------------------------------------------------ admission

    def _admit(self, number: int, join: WeightJoin, worker: int, link: WeightLink) -> None:
        """A newcomer the door let in (``weight_admission.JoinDesk``), with its link: its first version, then
        membership (replacing an earlier membership of the same engine worker)."""
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
            outcome = stream_version([member], latest.key, latest.layout_bytes, latest.bucket_bytes,
                                     sendable_buckets(latest, self.device), None, latest.nbytes, **self._bounds)
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

    def close(self) -> None:
        """Admit no one more and close every member's group (the store lives until the process ends)."""
        self._closed.set()
        with self._lock:
            for member in self.members.values():
                member.close()
            self.members.clear()
        self.desk.close()
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


