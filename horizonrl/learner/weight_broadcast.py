"""Rank 0's side of the weight transfer: host the weight store, admit engines at any time, send versions.

The wire format and the join steps are defined in ``protocol/weights.py``; the receiving end is
``actors/weight_receiver.py``. Nothing here touches the default process group (the learner's FSDP
group): every member's group is built directly on the ``TCPStore`` this process hosts.

Membership is elastic. A background thread admits each engine that joins: it forms the member's
two-rank group and sends it the newest packed version at once, so a late or restarted engine
plays with the current weights from its first token. :meth:`WeightHub.send` then gives each new
version to every member, each in its own thread; a member that fails or misses the timeout is
dropped (it rejoins by itself) and never holds the others back longer than that timeout.

Why one group per member rather than one group of 1 + K re-formed on every change: a fixed group
cannot admit anyone, and re-forming it needs every member at a barrier — one stuck engine stalls
all. Per-member groups cost a send per member instead of one collective; on gloo a broadcast to
K ranks is K sends anyway, and ``horizonrl bench --parts weight_sync`` measures the two side by
side (docs/benchmarks.md). On NCCL a ring broadcast would send the bytes once; with the few
engines per learner of this system the difference is K transfers of the weights per version.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterable

import torch
import torch.distributed as dist

from horizonrl.protocol import ProtocolError, WeightJoin, WeightLayout, decode_as, encode
from horizonrl.protocol.weights import JOIN_COUNTER, STORE_PREFIX, WeightSyncError, join_key, layout_offsets, member_prefix

__all__ = ["Member", "PackedWeights", "WeightHub", "WeightSyncError"]

log = logging.getLogger("horizonrl.learner.weights")

ADMIT_POLL_S = 0.2


@dataclass
class PackedWeights:
    """One version packed into the hub's flat buffer, ready for :meth:`WeightHub.send`."""

    version: int
    epoch: int
    layout_bytes: bytes
    flat: torch.Tensor
    tensors: int
    pack_s: float

    @property
    def key(self) -> tuple[int, int]:
        return (self.epoch, self.version)


@dataclass
class Member:
    """One engine in the hub: its join, its two-rank group, and the newest version it acknowledged."""

    number: int
    actor: int
    pid: int
    group: dist.ProcessGroup
    has: tuple[int, int] = (-1, -1)  # (epoch, version)

    def close(self) -> None:
        shutdown = getattr(self.group, "shutdown", None)
        if callable(shutdown):
            try:
                shutdown()
            except Exception:  # best effort: the engine may be gone already
                pass


class WeightHub:
    """Hosts the weight store at ``host:port``; admits members; sends each version to every member.

    Thread safety: one lock guards the members, the flat buffer and the newest packed version;
    packing, a send to all members and the first send to a newcomer each hold it, so the buffer
    is never rewritten while it is being sent. Forming a newcomer's group (which waits for the
    engine) happens outside the lock, each in its own thread.
    """

    def __init__(self, host: str, port: int, *, backend: str, timeout_s: float, run_id: str) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"weight-sync backend must be 'gloo' or 'nccl', not {backend!r}")
        self.backend = backend
        self.timeout_s = timeout_s
        self.run_id = run_id
        self.address = f"{host}:{port}"
        # NCCL moves device memory only (this process's current device); gloo moves host memory.
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        try:
            self.store = dist.TCPStore(host, port, None, True, timedelta(seconds=timeout_s), wait_for_workers=False)
        except RuntimeError as exc:
            raise WeightSyncError(f"weight hub: cannot host the weight store at {self.address}: {exc}") from exc
        self._joins = dist.PrefixStore(STORE_PREFIX, self.store)
        self.members: dict[int, Member] = {}  # by actor index
        self.latest: PackedWeights | None = None
        self.counters: Counter[str] = Counter()  # admitted, replaced, dropped, failed_joins, bad_joins
        self._lock = threading.Lock()
        self._flat: torch.Tensor | None = None
        self._seen = 0  # join numbers up to this one are handled
        self._waiting: dict[int, float] = {}  # join numbers whose record has not appeared yet -> since
        self._closed = threading.Event()
        self._poller = threading.Thread(target=self._admit_forever, name="weight-hub", daemon=True)

    def start(self) -> "WeightHub":
        """Admit joiners from now on (pack the first version before, so every joiner gets one)."""
        if self.latest is None:
            raise RuntimeError("pack a version before starting the hub: a joiner must receive one at once")
        self._poller.start()
        return self

    # ------------------------------------------------------------------ versions

    def pack(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]], *, epoch: int = 0) -> PackedWeights:
        """Copy ``named_tensors`` into the flat buffer as the newest version (no communication).

        Split from :meth:`send` so the learner can pack *before* it announces the version: the
        engines stop generating from the moment they enter the receive, so nothing the sender
        can do beforehand should happen while they wait. From here on a joiner gets this version.
        """
        start = time.perf_counter()
        names, tensors = [], []
        for name, tensor in named_tensors:
            names.append(name)
            tensors.append(tensor.detach())
        offsets, total_bytes = layout_offsets([t.numel() * t.element_size() for t in tensors])
        layout = WeightLayout(run_id=self.run_id, version=version, epoch=epoch, names=names,
                              dtypes=[str(t.dtype).removeprefix("torch.") for t in tensors],
                              shapes=[list(t.shape) for t in tensors], total_bytes=total_bytes)
        with self._lock:
            if self._flat is None or self._flat.numel() != total_bytes:
                # Reused by every version of the same size: a fresh buffer each time costs its page
                # faults inside the timed send (2-3x slower on 100 MB).
                self._flat = None
                self._flat = torch.empty(total_bytes, dtype=torch.uint8, device=self.device)
            for tensor, offset in zip(tensors, offsets):
                raw = tensor.contiguous().reshape(-1)
                raw = raw.view(torch.uint8) if raw.dtype != torch.uint8 else raw
                self._flat[offset: offset + raw.numel()].copy_(raw)
            self.latest = PackedWeights(version, epoch, encode(layout), self._flat, len(tensors),
                                        time.perf_counter() - start)
            return self.latest

    def send(self, packed: PackedWeights) -> dict[str, float]:
        """Give ``packed`` to every member that does not have it, all at once; drop those that fail.

        Returns ``{"pack_s", "send_s", "total_s", "bytes", "tensors", "members", "dropped"}``."""
        start = time.perf_counter()
        with self._lock:
            if packed is not self.latest:
                raise ValueError(f"version {packed.key} is not the newest packed one; pack it again")
            targets = [m for m in self.members.values() if m.has < packed.key]
            failures = self._send_to_all(targets, packed)
            for member, error in failures:
                self._drop(member, error)
            members = len(self.members)
        send_s = time.perf_counter() - start
        return {"pack_s": packed.pack_s, "send_s": send_s, "total_s": packed.pack_s + send_s,
                "bytes": float(packed.flat.numel()), "tensors": float(packed.tensors), "members": float(members),
                "dropped": float(len(failures))}

    def _send_to_all(self, targets: list[Member], packed: PackedWeights) -> list[tuple[Member, Exception]]:
        """One thread per member (the collectives release the GIL); returns the members that failed."""
        failures: list[tuple[Member, Exception]] = []

        def send_one(member: Member) -> None:
            try:
                self._send_to(member, packed)
            except WeightSyncError as exc:
                failures.append((member, exc))

        if len(targets) == 1:
            send_one(targets[0])
            return failures
        threads = [threading.Thread(target=send_one, args=(m,), name=f"weights-to-actor-{m.actor}") for m in targets]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()  # each send is bounded by the group's timeout
        return failures

    def _send_to(self, member: Member, packed: PackedWeights) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # threads start on device 0
        what = f"version {packed.key} (epoch, version) to actor {member.actor} (join {member.number})"
        header = torch.tensor([len(packed.layout_bytes)], dtype=torch.int64, device=self.device)
        _broadcast(member.group, header, self.timeout_s, f"header of {what}")
        layout = torch.frombuffer(bytearray(packed.layout_bytes), dtype=torch.uint8).to(self.device)
        _broadcast(member.group, layout, self.timeout_s, f"layout of {what}")
        _broadcast(member.group, packed.flat, self.timeout_s, f"payload of {what}")
        ack = torch.zeros(1, dtype=torch.int64, device=self.device)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.SUM
        _wait(lambda: member.group.allreduce([ack], options), self.timeout_s, f"acknowledgement of {what}")
        if int(ack.item()) != 1:
            raise WeightSyncError(f"weight hub: {what} acknowledged {int(ack.item())} times, not once")
        member.has = packed.key

    def _drop(self, member: Member, error: Exception) -> None:
        log.warning("dropped actor %d's engine from the weight hub (it rejoins by itself): %s", member.actor, error)
        self.counters["dropped"] += 1
        if self.members.get(member.actor) is member:
            del self.members[member.actor]
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
        try:
            group = self._form_group(number)
        except WeightSyncError as exc:
            self.counters["failed_joins"] += 1
            log.warning("weight hub: actor %d (pid %d) did not complete its join %d: %s", join.actor, join.pid,
                        number, exc)
            return
        member = Member(number, join.actor, join.pid, group)
        with self._lock:
            if self._closed.is_set():
                member.close()
                return
            try:
                self._send_to(member, self.latest)
            except WeightSyncError as exc:
                self.counters["failed_joins"] += 1
                log.warning("weight hub: actor %d's first version failed: %s", join.actor, exc)
                member.close()
                return
            previous = self.members.get(join.actor)
            if previous is not None:
                self.counters["replaced"] += 1
                previous.close()
            self.members[join.actor] = member
            self.counters["admitted"] += 1
        log.info("admitted actor %d's engine (pid %d, join %d) at weights %s (epoch, version)%s", join.actor, join.pid,
                 number, member.has, "; it replaces an earlier one" if previous is not None else "")

    def _form_group(self, number: int) -> dist.ProcessGroup:
        timeout = timedelta(seconds=self.timeout_s)
        store = dist.PrefixStore(member_prefix(number), self._joins)
        try:
            if self.backend == "nccl":
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = timeout
                return dist.ProcessGroupNCCL(store, 0, 2, options)
            return dist.ProcessGroupGloo(store, 0, 2, timeout)
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


def _broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, timeout_s: float, what: str) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    _wait(lambda: group.broadcast([tensor], options), timeout_s, what)


def _wait(start_work, timeout_s: float, what: str) -> None:
    try:
        start_work().wait(timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise WeightSyncError(f"weight hub: {what} did not complete within {timeout_s:.0f} s: {exc}") from exc
