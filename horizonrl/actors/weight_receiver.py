"""An engine worker's side of the weight transfer: join the learner's weight hub, receive versions.

Runs inside the vLLM worker process (see ``vllm_worker.py``), which already has a default
process group, so nothing here touches it. The join steps and the wire format are defined in
``protocol/weights.py``, the bucket plan in ``protocol/weight_buckets.py``; the sending end is
``learner/weight_broadcast.py``.

Two ways to take a version, both bounded by the group's timeout at every collective, and inside an RPC of the
engine's also by that RPC's deadline (an absolute ``time.time()``, :func:`wait_bound_s`): every wait of the call
ends by then, so the worker answers before vLLM's executor gives up on the RPC (its late answer would be read by
the next RPC, ``protocol/worker_replies.RpcReply``):

- :func:`open_weight_stream` — bucket by bucket: each bucket is received when the loader has used
  up the previous one, so the extra memory is about one bucket whatever the model's size (what the
  engine does; see ``vllm_worker.py``);
- :func:`receive_weights` — the whole version into one flat buffer, then the named views (the
  staged receive, :class:`StagedReceive`, runs it in a thread while the engine generates; the
  extra memory is the whole model, in host memory: on a GPU only one bucket passes through device
  memory, outside vLLM's ``gpu_memory_utilization`` budget).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Iterator

import msgspec
import torch
import torch.distributed as dist

from horizonrl.actors.weight_ipc import IpcReceiver
from horizonrl.actors.weight_join import announce_join
from horizonrl.protocol import ProtocolError, WeightJoin, WeightLayout, decode_as
from horizonrl.protocol.weight_buckets import Bucket, plan_buckets
from horizonrl.protocol.weights import WeightSyncError, member_prefix
from horizonrl.protocol.worker_replies import StageOutcome

log = logging.getLogger("horizonrl.actors.weights")

__all__ = ["StagedReceive", "WeightReceiver", "WeightStream", "WeightSyncError", "join_weight_hub",
           "open_weight_stream", "receive_weights"]


@dataclass
class WeightReceiver:
    """Rank 1 of a two-rank group with the learner (rank 0): one membership of the weight hub."""

    number: int  # the join number
    backend: str
    timeout_s: float
    process_group: dist.ProcessGroup
    store: dist.Store
    worker: int = 0  # the engine worker (tensor-parallel rank) this membership belongs to
    # A staged version waits in host memory (a GPU's receive buffers hold one bucket), see StagedReceive.
    stage_in_host: bool = False
    # One receive buffer reused by every version of the same size (no page faults per receive).
    _flat: torch.Tensor | None = None
    # The staged versions' host memory (pageable: pinned memory is locked RAM), reused likewise; it crosses to and
    # from the GPU through one pinned 64 MiB buffer (HostStaging).
    _host_flat: torch.Tensor | None = None
    _bucket: torch.Tensor | None = None  # the device buffer staged buckets pass through, reused likewise
    _stream_buckets: list[torch.Tensor] = field(default_factory=list)  # inline buckets' buffers (stream_bucket)
    host_staging: "HostStaging" = field(default_factory=lambda: HostStaging())
    bucket_bytes: int = 0  # the bucket size of the last version received (its header's)
    received_bytes: int = 0  # bytes of buckets received from the learner, all versions (the relay test reads it)
    _staging_stream: object | None = None  # the CUDA stream staged receives run on (staging_stream)
    formed: bool = False  # a collective has completed: NCCL's communicator exists (see _wait)

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    def flat_buffer(self, nbytes: int) -> torch.Tensor:
        if self._flat is None or self._flat.numel() != nbytes:
            self._flat = None
            self._flat = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._flat

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        if self._host_flat is None or self._host_flat.numel() != nbytes:
            self._host_flat = None
            self._host_flat = torch.empty(nbytes, dtype=torch.uint8)
        return self._host_flat

    def bucket_buffer(self, nbytes: int) -> torch.Tensor:
        if self._bucket is None or self._bucket.numel() < nbytes:
            self._bucket = None
            self._bucket = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._bucket[:nbytes]

    def stream_bucket(self, nbytes: int) -> torch.Tensor:
        """A buffer on the device for one bucket of an inline receive: an earlier one that nothing views any more
        (the loader dropped every tensor of its bucket), else a new one kept for the next versions. vLLM's
        layer-wise reload holds a layer's tensors until the layer is complete and a layer may straddle buckets, so a
        buffer is reused only once no tensor holds its memory (torch's storage use count; where torch does not
        have it, a new buffer per bucket as before)."""
        return reusable_buffer(self._stream_buckets, nbytes, self.device)

    def staging_stream(self):
        """The CUDA stream a staged receive's collectives and copies run on, not the engine's. Model Runner V2
        computes on the default stream (0.33 ``v1/worker/gpu/model_runner.py:602-605``), and NCCL makes its own
        stream wait for the stream current at each collective: on the default stream every bucket waited behind a
        generation step (docs/gpu.md)."""
        if self._staging_stream is None:
            self._staging_stream = torch.cuda.Stream(device=self.device)
        return self._staging_stream

    def close(self) -> None:
        shutdown = getattr(self.process_group, "shutdown", None)
        if callable(shutdown):
            try:
                shutdown()
            except Exception:  # best effort at teardown: the learner may be gone already
                pass


def wait_bound_s(timeout_s: float, deadline: float | None, what: str) -> float:
    """How long a wait may take now: ``timeout_s``, or what is left before ``deadline`` (an absolute ``time.time()``,
    the engine's RPC's) when that is less; WeightSyncError when the deadline has passed."""
    if deadline is None:
        return timeout_s
    left = deadline - time.time()
    if left <= 0:
        raise WeightSyncError(f"weight sync: {what}: the engine's deadline for this call passed {-left:.1f} s ago")
    return min(timeout_s, left)


_STORAGE_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


def reusable_buffer(pool: list[torch.Tensor], nbytes: int, device: torch.device) -> torch.Tensor:
    """``nbytes`` of a buffer of ``pool`` that no tensor views any more, else of a new one added to it."""
    for buffer in pool:
        if buffer.numel() >= nbytes and _only_held_here(buffer):
            return buffer[:nbytes]
    buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
    if _STORAGE_USE_COUNT is not None:
        pool.append(buffer)
    return buffer[:nbytes]


class HostStaging:
    """How a staged version crosses between host memory (pageable) and a GPU: through one pinned buffer of
    :data:`PINNED_CHUNK_BYTES`, chunk by chunk, each copy waited for by an event on the current stream. Pinned
    memory is locked RAM the kernel cannot page: 64 MiB per process, where a pinned copy of the whole model per
    worker (and per tensor-parallel rank) was. On the CPU the copies are direct."""

    def __init__(self) -> None:
        self._pinned: torch.Tensor | None = None

    @property
    def pinned_bytes(self) -> int:
        return 0 if self._pinned is None else self._pinned.numel()

    def _bounce(self) -> torch.Tensor:
        if self._pinned is None:
            self._pinned = torch.empty(PINNED_CHUNK_BYTES, dtype=torch.uint8, pin_memory=True)
        return self._pinned

    def to_host(self, host: torch.Tensor, device_bytes: torch.Tensor) -> None:
        if device_bytes.device.type != "cuda":
            host.copy_(device_bytes)
            return
        bounce = self._bounce()
        for start in range(0, device_bytes.numel(), PINNED_CHUNK_BYTES):
            chunk = device_bytes[start: start + PINNED_CHUNK_BYTES]
            bounce[: chunk.numel()].copy_(chunk, non_blocking=True)
            _wait_for_current_stream()
            host[start: start + chunk.numel()].copy_(bounce[: chunk.numel()])

    def to_device(self, device_bytes: torch.Tensor, host: torch.Tensor) -> None:
        if device_bytes.device.type != "cuda":
            device_bytes.copy_(host)
            return
        bounce = self._bounce()
        for start in range(0, host.numel(), PINNED_CHUNK_BYTES):
            chunk = host[start: start + PINNED_CHUNK_BYTES]
            bounce[: chunk.numel()].copy_(chunk)
            device_bytes[start: start + chunk.numel()].copy_(bounce[: chunk.numel()], non_blocking=True)
            _wait_for_current_stream()  # the bounce buffer is free again


PINNED_CHUNK_BYTES = 64 << 20


def _wait_for_current_stream() -> None:
    """Wait for what was queued on the current CUDA stream so far, and for nothing on the others."""
    done = torch.cuda.Event()
    done.record()
    done.synchronize()


def _only_held_here(buffer: torch.Tensor) -> bool:
    """No tensor but ``buffer`` holds its memory. The count includes ``buffer`` and the storage object made to ask."""
    return _STORAGE_USE_COUNT is not None and _STORAGE_USE_COUNT(buffer.untyped_storage()._cdata) <= 2


def join_weight_hub(host: str, port: int, *, actor: int, run_id: str, timeout_s: float,
                    backend: str = "gloo", worker: int = 0, connect_timeout_s: float | None = None,
                    deadline: float | None = None) -> "WeightReceiver | IpcReceiver":
    """Join the learner's weight hub as ``actor``'s engine worker ``worker`` (WeightSyncError after the
    timeout). The learner answers with its newest version at once: receive it next. ``connect_timeout_s``
    (default ``timeout_s``) bounds reaching the hub's store: shorter where the hub is known to be up. ``deadline``
    (absolute, ``time.time()``): reaching the store and forming the group end by then too.

    ``backend``: ``gloo`` (CPU) or ``nccl`` — a two-rank group, a :class:`WeightReceiver`; ``cuda_ipc``
    (an engine on the learner's GPU, colocated mode) — an :class:`~horizonrl.actors.weight_ipc.IpcReceiver`."""
    if backend not in ("gloo", "nccl", "cuda_ipc"):
        raise ValueError(f"weight-sync backend must be 'gloo', 'nccl' or 'cuda_ipc', not {backend!r}")
    if backend == "cuda_ipc":
        return IpcReceiver.join(host, port, actor=actor, run_id=run_id, timeout_s=timeout_s, worker=worker,
                                connect_timeout_s=connect_timeout_s)
    if backend == "nccl":
        # Work.wait(timeout) must block the host and raise at the timeout, or the .item() after it hangs.
        os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
    timeout = timedelta(seconds=timeout_s)
    what = f"actor {actor} worker {worker} joining the hub at {host}:{port}"
    try:
        # The store's timeout bounds the group's forming (it waits for the learner there): the deadline's too.
        store, joins, number = announce_join(host, port, wait_bound_s(timeout_s, deadline, what), WeightJoin(
            run_id=run_id, actor=actor, pid=os.getpid(), worker=worker),
            wait_bound_s(timeout_s if connect_timeout_s is None else connect_timeout_s, deadline, what))
        member_store = dist.PrefixStore(member_prefix(number), joins)
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            group = dist.ProcessGroupNCCL(member_store, 1, 2, options)
        else:
            group = dist.ProcessGroupGloo(member_store, 1, 2, timeout)
    except RuntimeError as exc:
        raise WeightSyncError(
            f"weight hub at {host}:{port} ({backend}): actor {actor} worker {worker} could not join within "
            f"{timeout_s:.0f} s (is the learner up and hosting the hub at this address?): {exc}"
        ) from exc
    return WeightReceiver(number, backend, timeout_s, group, store, worker, stage_in_host=backend == "nccl")


class WeightStream:
    """One version on its way in: its layout at once, then ``(name, tensor)`` bucket by bucket.

    Iterating receives bucket ``i + 1`` only after every tensor of bucket ``i`` was handed out; the
    tensors are views into that bucket's buffer. With several buckets each comes into a buffer no tensor
    still views (``WeightReceiver.stream_bucket``: reused once the loader has dropped its tensors, else a new
    one), so a loader that keeps a reference never sees it overwritten, and one that copies and drops each
    tensor (vLLM's) keeps the extra memory at a few buckets. With one bucket the receiver's
    reused buffer serves (no page faults per version; the next version overwrites it).
    :meth:`finish` receives whatever was not iterated and acknowledges the version: call it after
    loading. A failure half-way raises :class:`WeightSyncError` saying the engine may now hold part
    of this version (the actor then joins again, which sends the whole newest version).
    """

    def __init__(self, receiver: WeightReceiver, layout: WeightLayout, plan: list[Bucket],
                 deadline: float | None = None) -> None:
        self.receiver = receiver
        self.deadline = deadline  # the engine's RPC's (absolute time.time()), None outside one
        self.layout = layout
        self.plan = plan
        self._next_bucket = 0
        self._finished = False
        self._prefetched: torch.Tensor | None = None
        self.receive_s = 0.0  # time inside the bucket collectives (waiting for the sender included)

    @property
    def version(self) -> int:
        return self.layout.version

    def prefetch(self) -> None:
        """Receive the first bucket now. The engine calls this before its loader starts, so that a
        model of one bucket is wholly here before anything in the engine changes."""
        if self._prefetched is None and self._next_bucket == 0 and self.plan:
            self._prefetched = self._receive(self.plan[0])

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for bucket, data in self.buckets():
            for entry in bucket.entries:
                yield entry.name, _view(data, entry)
            del data  # this frame's hold on the buffer: the next bucket may reuse it once the loader lets go

    def buckets(self) -> Iterator[tuple[Bucket, torch.Tensor]]:
        """Each bucket not yet handed out with its bytes, received when asked for (the tensor-parallel relay)."""
        while self._next_bucket < len(self.plan):
            bucket = self.plan[self._next_bucket]
            data = self._prefetched if self._prefetched is not None else self._receive(bucket)
            self._prefetched = None
            self._next_bucket += 1
            yield bucket, data
            del data

    def _receive(self, bucket: Bucket) -> torch.Tensor:
        if len(self.plan) == 1:
            data = self.receiver.flat_buffer(bucket.nbytes)
        else:
            data = self.receiver.stream_bucket(bucket.nbytes)
        what = f"bucket {bucket.index} of {len(self.plan)}"
        if bucket.index > 0:
            what += " (the engine may hold part of this version)"
        start = time.perf_counter()
        _broadcast(self.receiver, data, what, self.layout.version, self.deadline)
        self.receiver.received_bytes += bucket.nbytes
        self.receive_s += time.perf_counter() - start
        return data

    def finish(self) -> None:
        """Receive the buckets not iterated (none, after a full load), then acknowledge the version."""
        if self._finished:
            return
        for _ in self:
            pass
        ack = torch.ones(1, dtype=torch.int64, device=self.receiver.device)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.SUM
        _wait(self.receiver, lambda: self.receiver.process_group.allreduce([ack], options), "acknowledgement",
              self.layout.version, self.deadline)
        self._finished = True


def open_weight_stream(receiver: WeightReceiver, deadline: float | None = None) -> WeightStream:
    """Receive the header and layout of the next version; its buckets come as the stream is iterated. Every wait
    of the stream ends by ``deadline`` (absolute, ``time.time()``; None: the group's timeout alone)."""
    header = torch.zeros(2, dtype=torch.int64, device=receiver.device)
    _broadcast(receiver, header, "header", None, deadline)
    layout_bytes, bucket_bytes = (int(x) for x in header.tolist())  # bounded: the wait above completed
    receiver.bucket_bytes = bucket_bytes
    if layout_bytes <= 0 or bucket_bytes <= 0:
        raise WeightSyncError(f"weight sync (join {receiver.number}): malformed header {[layout_bytes, bucket_bytes]}")
    layout_buffer = torch.empty(layout_bytes, dtype=torch.uint8, device=receiver.device)
    _broadcast(receiver, layout_buffer, "layout", None, deadline)
    try:
        layout = decode_as(layout_buffer.cpu().numpy().tobytes(), WeightLayout)
        plan = plan_buckets(layout.names, layout.dtypes, layout.shapes, bucket_bytes)
    except (ProtocolError, ValueError) as exc:
        raise WeightSyncError(f"weight sync (join {receiver.number}): malformed weight layout: {exc}") from exc
    planned = sum(bucket.nbytes for bucket in plan)
    if planned != layout.total_bytes:
        raise WeightSyncError(f"weight sync (join {receiver.number}): layout of version {layout.version} says "
                              f"{layout.total_bytes} bytes, its buckets hold {planned}")
    return WeightStream(receiver, layout, plan, deadline)


def receive_weights(receiver: WeightReceiver, in_host: bool = False,
                    deadline: float | None = None) -> tuple[WeightLayout, list[tuple[str, torch.Tensor]]]:
    """Receive one whole version; returns its layout (version, epoch, ...) and ``[(name, tensor), ...]``.

    The tensors are views into the receiver's flat buffer, which the next receive overwrites:
    load or copy them before receiving again, and do not resize them. ``in_host`` (a receiver on a GPU): the
    flat buffer is in host memory and each bucket comes through one device buffer of a bucket's size, so the
    GPU holds one bucket whatever the model's size.

    On a GPU with ``in_host`` (the staged receive, beside a generating engine) every collective and copy runs on
    the receiver's own CUDA stream (:meth:`WeightReceiver.staging_stream`), ordered by events: NCCL's work makes
    that stream wait for its broadcast (``Work.wait``), the copy to host is recorded on it and waited for by its
    event alone. The engine's stream is in none of it, so a bucket no longer waits behind a generation step. The
    CPU's path is unchanged.
    """
    if in_host and receiver.device.type == "cuda":
        stream = receiver.staging_stream()
        with torch.cuda.stream(stream):
            return _receive_whole(receiver, in_host, deadline)
    return _receive_whole(receiver, in_host, deadline)


def _receive_whole(receiver: WeightReceiver, in_host: bool,
                   deadline: float | None) -> tuple[WeightLayout, list[tuple[str, torch.Tensor]]]:
    stream = open_weight_stream(receiver, deadline)
    total = stream.layout.total_bytes
    flat = receiver.host_buffer(total) if in_host else receiver.flat_buffer(total)
    named, start = [], 0
    for bucket in stream.plan:
        data = flat[start: start + bucket.nbytes]
        received = receiver.bucket_buffer(bucket.nbytes) if in_host else data
        _broadcast(receiver, received, f"bucket {bucket.index} of {len(stream.plan)}", stream.layout.version,
                   deadline)
        receiver.received_bytes += bucket.nbytes
        if received is not data:
            receiver.host_staging.to_host(data, received)  # done when it returns: the buffer serves the next bucket
        named.extend((entry.name, _view(data, entry)) for entry in bucket.entries)
        start += bucket.nbytes
    stream._next_bucket = len(stream.plan)  # all received: finish() only acknowledges
    stream.finish()
    return stream.layout, named


@dataclass
class StagedReceive:
    """:func:`receive_weights` in a thread of its own, so that the engine keeps generating meanwhile: the
    version lands in the receiver's flat buffer (reused by the next one) and is acknowledged to the learner
    as soon as it is here. On a GPU that buffer is host memory (pinned) and each bucket passes through one
    device buffer: a whole second copy of the model on every worker's GPU would sit outside vLLM's memory
    budget (a 7B model in bf16, ~15 GB, does not fit beside an engine at utilization 0.9 on 80 GB) and run it
    out of memory; the load then copies host to device, inside the swap (docs/gpu.md). When it ends (every
    collective is bounded by the group's timeout, so it always does), the thread tells the actor at
    ``notify_address`` (a ZMQ PULL socket of the actor's, a msgpack ``StageOutcome``,
    protocol/worker_replies.py): the actor waits for that message rather than asking the engine, whose
    worker would spin between such questions on the cores the receive needs.
    ``layout`` is set once it all arrived, ``error`` if it failed."""

    stage_id: int
    worker: int
    notify_address: str = ""
    thread: threading.Thread | None = None
    layout: WeightLayout | None = None
    named: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    error: Exception | None = None
    receive_s: float = 0.0
    # Guards stage_id/notify_address against the receive ending: the outcome goes to whichever stage owns it then.
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def start(cls, receiver: WeightReceiver, stage_id: int, notify_address: str) -> "StagedReceive":
        staged = cls(stage_id, receiver.worker, notify_address)
        # The device is read here: a new thread's current CUDA device is device 0, not the worker's.
        staged.thread = threading.Thread(target=staged._receive, args=(receiver, receiver.device),
                                         name="horizonrl-weight-staging", daemon=True)
        staged.thread.start()
        return staged

    @property
    def receiving(self) -> bool:
        """Still waiting for (or taking in) its version: no outcome yet."""
        return self.layout is None and self.error is None

    def adopt(self, stage_id: int, notify_address: str) -> bool:
        """Hand this receive, while it is still receiving, to a newer stage: it brings the next version the learner
        sends, which is what that stage asks for, and its outcome goes to that stage. False once it has an outcome
        (the version it brought is the older stage's)."""
        with self._lock:
            if not self.receiving:
                return False
            self.stage_id, self.notify_address = stage_id, notify_address
            return True

    def _receive(self, receiver: WeightReceiver, device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        start = time.perf_counter()
        named, layout, error = [], None, None
        try:
            layout, named = receive_weights(receiver, in_host=receiver.stage_in_host)
        except Exception as exc:  # noqa: BLE001 - reported to the actor (which joins the hub again)
            error = exc
        with self._lock:
            self.receive_s = time.perf_counter() - start
            self.named, self.layout, self.error = named, layout, error
            address, outcome = self.notify_address, self.outcome()
        _notify(address, outcome)

    def outcome(self) -> StageOutcome:
        """How it ended, for the stage that owns it now (version -1 unless it all arrived)."""
        if self.error is not None:
            error = f"{type(self.error).__name__}: {self.error}"
            return StageOutcome(self.stage_id, -1, -1, 0.0, 0.0, self.worker, error)
        if self.layout is None:
            return StageOutcome(self.stage_id, -1, -1, 0.0, 0.0, self.worker)
        return StageOutcome(self.stage_id, self.layout.version, self.layout.epoch, self.receive_s, 0.0, self.worker)


NOTIFY_TIMEOUT_MS = 5000
FORMING_MARGIN_S = 5.0  # past the group's timeout, how long the first NCCL collective may take to give up itself


def _notify(address: str, outcome: StageOutcome) -> None:
    """One small message to the actor; if it cannot be delivered, the actor asks the worker (it waits for this
    message a few seconds at a time: ``Engine.stage_weights``)."""
    import zmq

    context = zmq.Context()
    try:
        sock = context.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, NOTIFY_TIMEOUT_MS)
        sock.setsockopt(zmq.SNDTIMEO, NOTIFY_TIMEOUT_MS)
        sock.connect(address)
        try:
            sock.send(msgspec.msgpack.encode(outcome))
        except zmq.Again:  # the actor asks for it when it is late (Engine.stage_weights)
            log.warning("staged receive %d: could not tell the actor at %s within %.0f s that it ended",
                        outcome.stage_id, address, NOTIFY_TIMEOUT_MS / 1000)
        sock.close()
    finally:
        context.term()


def _view(data: torch.Tensor, entry) -> torch.Tensor:
    dtype = getattr(torch, entry.dtype)
    return data[entry.offset: entry.offset + entry.nbytes].view(dtype).view(entry.shape)


def _broadcast(receiver: WeightReceiver, tensor: torch.Tensor, what: str, version: int | None = None,
               deadline: float | None = None) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    _wait(receiver, lambda: receiver.process_group.broadcast([tensor], options), what, version, deadline)


def _wait(receiver: WeightReceiver, start_work, what: str, version: int | None, deadline: float | None = None) -> None:
    which = "the next version" if version is None else f"version {version}"
    where = f"weight sync (join {receiver.number}, worker {receiver.worker}, receiver): {what} of {which}"
    bound_s = wait_bound_s(receiver.timeout_s, deadline, where)
    failure = f"{where} did not complete within {bound_s:.0f} s ({receiver.backend})"

    def collective() -> bool:
        return start_work().wait(timedelta(seconds=bound_s))

    try:
        completed = collective() if receiver.formed or receiver.backend != "nccl" else _first_collective(
            receiver, collective, failure, bound_s)
    except RuntimeError as exc:
        raise WeightSyncError(f"{failure}: {exc}") from exc
    if completed is False:
        raise WeightSyncError(failure)
    receiver.formed = True


def _first_collective(receiver: WeightReceiver, collective, failure: str, bound_s: float | None = None) -> bool:
    """NCCL forms a group's communicator inside its first collective, waiting for the learner there with no
    time-out of its own: run that one in a thread given the group's timeout (and a margin). A learner that never
    comes leaves the thread behind and this raises, so the worker's RPC (a join) returns and the actor can join
    again."""
    outcome: dict = {}
    device = receiver.device

    def run() -> None:
        if device.type == "cuda":
            torch.cuda.set_device(device)  # a new thread starts on device 0
        try:
            outcome["completed"] = collective()
        except Exception as exc:  # noqa: BLE001 - raised again in the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="horizonrl-weight-group-forming", daemon=True)
    thread.start()
    thread.join((receiver.timeout_s if bound_s is None else bound_s) + FORMING_MARGIN_S)
    if thread.is_alive():
        raise WeightSyncError(f"{failure}: the NCCL communicator was not formed (is the learner's side frozen?)")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["completed"]
