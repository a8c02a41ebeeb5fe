"""A colocated engine's side of the weight path: versions from the learner on the same GPU, through
CUDA IPC. The exchange, its guarantees and the handle (:class:`CudaIpcBuffer`) are described in
``learner/weight_ipc.py``.

:func:`open_ipc_weight_stream` waits for a version's :class:`IpcWeights` and maps the learner's
staging buffer; iterating the stream yields ``(name, tensor)`` bucket by bucket, each tensor a view
into the learner's memory that is valid until the next bucket is asked for (a loader copies it into
the model, as vLLM's does). The ack of a bucket goes back when the next is asked for, the last one
from :meth:`IpcWeightStream.finish`, which means "loaded".

In ``horizonrl train`` the engine's worker joins the learner's weight hub with
:meth:`IpcReceiver.join` (``weight_receiver.join_weight_hub(backend="cuda_ipc")``): it listens on a
loopback PAIR socket, names it in its join, and the hub connects there.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterator

import torch
import zmq
from torch.multiprocessing.reductions import rebuild_cuda_tensor

from horizonrl.actors.weight_join import announce_join
from horizonrl.protocol.codec import ProtocolError, decode_as, encode
from horizonrl.protocol.messages import (CudaIpcBuffer, IpcBucketAck, IpcBucketReady, IpcWeights, WeightJoin,
                                         WeightLayout)
from horizonrl.protocol.weight_buckets import Bucket, plan_buckets
from horizonrl.protocol.weights import WeightSyncError

__all__ = ["IpcReceiver", "IpcWeightStream", "MappedBuffer", "open_cuda_buffer", "open_ipc_weight_stream"]


@dataclass
class IpcReceiver:
    """One membership of the weight hub through CUDA IPC (the engine on the learner's GPU): the PAIR
    socket the hub connected to. Versions arrive with :meth:`open_stream`."""

    number: int  # the join number
    run_id: str
    timeout_s: float
    sock: zmq.Socket
    context: zmq.Context
    store: object  # the hub's TCPStore client, kept open while a member
    worker: int = 0
    backend: str = "cuda_ipc"
    mapped: "MappedBuffer | None" = None  # the learner's staging buffer as this process maps it

    @classmethod
    def join(cls, host: str, port: int, *, actor: int, run_id: str, timeout_s: float, worker: int = 0,
             listen_host: str = "127.0.0.1", connect_timeout_s: float | None = None) -> "IpcReceiver":
        """Listen on ``listen_host`` (the learner is on this machine: loopback), then join the hub at
        ``host:port`` naming that address; WeightSyncError if the hub is not reachable within the timeout."""
        context = zmq.Context()
        sock = context.socket(zmq.PAIR)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(f"tcp://{listen_host}:*")  # a free port
            address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            store, _joins, number = announce_join(host, port, timeout_s, WeightJoin(
                run_id=run_id, actor=actor, pid=os.getpid(), worker=worker, ipc_address=address), connect_timeout_s)
        except (RuntimeError, zmq.ZMQError) as exc:
            sock.close(linger=0)
            context.term()
            raise WeightSyncError(f"weight hub at {host}:{port} (CUDA IPC): actor {actor} worker {worker} could not "
                                  f"join within {timeout_s:.0f} s (is the learner up and hosting the hub at this "
                                  f"address?): {exc}") from exc
        return cls(number, run_id, timeout_s, sock, context, store, worker)

    def open_stream(self, copy_buckets: bool = True) -> "IpcWeightStream":
        """The next version (bounded by the timeout): :func:`open_ipc_weight_stream` on this membership.
        ``copy_buckets``: see :class:`IpcWeightStream` (vLLM's loader needs it)."""
        if self.mapped is None:
            self.mapped = MappedBuffer()
        return open_ipc_weight_stream(self.sock, run_id=self.run_id, timeout_s=self.timeout_s,
                                      copy_buckets=copy_buckets, mapped=self.mapped)

    def close(self) -> None:
        self.mapped = None  # unmaps: the learner's buffer is released once nothing else here holds it
        self.sock.close(linger=0)
        self.context.term()


class MappedBuffer:
    """The learner's staging buffer mapped once per export, kept while versions come through the same one.

    Why: torch's CUDA-IPC bookkeeping counts references in a file both processes map. Each export
    (``share_cuda_buffer``: torch's ``_share_cuda_``) adds one; each mapping the consumer opens releases one
    when it is dropped, and torch's ``rebuild_cuda_tensor`` releases one at once when it finds the storage
    still mapped (it assumes a fresh export per message, as a ``multiprocessing`` queue does). The learner
    exports its buffer once and announces it with every version: opening it per version released a reference
    per version that was never added, so the count went below zero and the learner could free (and reuse) the
    block while this engine still read it, or the counter slot of another block. One open per export, one
    release (when the learner announces another buffer, or the membership ends) balances it."""

    def __init__(self) -> None:
        self.key: tuple[bytes, int] | None = None
        self.tensor: torch.Tensor | None = None
        self.opened = 0  # mappings opened: one per export of the learner's buffer

    def of(self, shared: CudaIpcBuffer) -> torch.Tensor:
        key = (shared.handle, shared.storage_offset)
        if key != self.key:
            self.tensor, self.key = None, None  # the old export's one reference goes back first
            self.tensor = open_cuda_buffer(shared)
            self.key = key
            self.opened += 1
        return self.tensor


class IpcWeightStream:
    """One version arriving through the learner's shared staging buffer.

    ``copy_buckets``: with several buckets, each is first copied out of the shared buffer into memory
    of this process's own, and the tensors are views of that copy, so a loader may keep a tensor past
    the next bucket (vLLM's layer-wise reload holds a layer's tensors until the layer is complete, and a
    layer can straddle two buckets). Without it the views are of the shared buffer itself, which the
    learner overwrites with the next bucket. One bucket is never copied: its acknowledgement is
    :meth:`finish`'s, after the load."""

    def __init__(self, sock: zmq.Socket, message: IpcWeights, plan: list[Bucket], buffer: torch.Tensor,
                 timeout_s: float, copy_buckets: bool = False) -> None:
        self.sock = sock
        self.layout: WeightLayout = message.layout
        self.run_id = message.run_id
        self.plan = plan
        self.buffer = buffer
        self.timeout_s = timeout_s
        self.copy_buckets = copy_buckets and len(plan) > 1
        self._next_bucket = 0
        self._announced = -1  # the bucket whose IpcBucketReady was received last
        self._finished = False

    @property
    def version(self) -> int:
        return self.layout.version

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        while self._next_bucket < len(self.plan):
            bucket = self.plan[self._next_bucket]
            if self._announced != bucket.index:  # (a stream iterated again after a partial read skips this)
                ready = _receive(self.sock, IpcBucketReady, self.run_id, self.timeout_s,
                                 f"bucket {bucket.index} of {len(self.plan)} of version {self.version}")
                if (ready.version, ready.index) != (self.version, bucket.index):
                    raise WeightSyncError(f"colocated weight sync: expected bucket {bucket.index} of version "
                                          f"{self.version}, the learner announced bucket {ready.index} of version "
                                          f"{ready.version}")
                self._announced = bucket.index
            data = self.buffer[: bucket.nbytes]
            if self.copy_buckets:
                data = data.clone()  # the loader may hold these tensors after the learner reuses the buffer
            for entry in bucket.entries:
                dtype = getattr(torch, entry.dtype)
                yield entry.name, data[entry.offset: entry.offset + entry.nbytes].view(dtype).view(entry.shape)
            torch.cuda.current_stream(self.buffer.device).synchronize()  # the loader's copies (or ours) are done
            self._next_bucket += 1
            if self._next_bucket < len(self.plan):
                self._ack(bucket.index)

    def finish(self) -> None:
        """Read whatever was not iterated, then acknowledge the last bucket: the version is loaded."""
        if self._finished:
            return
        for _ in self:
            pass
        if self.plan:
            self._ack(self.plan[-1].index)
        self._finished = True

    def _ack(self, index: int) -> None:
        if not self.sock.poll(int(self.timeout_s * 1000), zmq.POLLOUT):
            raise WeightSyncError(f"colocated weight sync: the learner took no acknowledgement of bucket {index} of "
                                  f"version {self.version} within {self.timeout_s:g} s")
        self.sock.send(encode(IpcBucketAck(run_id=self.run_id, version=self.version, index=index)), zmq.NOBLOCK)


def open_ipc_weight_stream(sock: zmq.Socket, *, run_id: str, timeout_s: float, copy_buckets: bool = False,
                           mapped: MappedBuffer | None = None) -> IpcWeightStream:
    """Wait (at most ``timeout_s``) for the next version's announcement and map its buffer (through
    ``mapped``, which keeps one mapping per export of the learner's buffer: :class:`MappedBuffer` says why; a
    one-off caller may leave it out)."""
    message = _receive(sock, IpcWeights, run_id, timeout_s, "the next version")
    layout = message.layout
    try:
        plan = plan_buckets(layout.names, layout.dtypes, layout.shapes, message.bucket_bytes)
    except ValueError as exc:
        raise WeightSyncError(f"colocated weight sync: malformed layout of version {layout.version}: {exc}") from exc
    planned = sum(bucket.nbytes for bucket in plan)
    if planned != layout.total_bytes or max((b.nbytes for b in plan), default=0) > message.buffer.nbytes:
        raise WeightSyncError(f"colocated weight sync: version {layout.version} says {layout.total_bytes} bytes in a "
                              f"buffer of {message.buffer.nbytes}; its buckets hold {planned}")
    buffer = (mapped or MappedBuffer()).of(message.buffer)
    return IpcWeightStream(sock, message, plan, buffer, timeout_s, copy_buckets)


def open_cuda_buffer(shared: CudaIpcBuffer) -> torch.Tensor:
    """The producer's buffer in this process: a ``uint8`` tensor on the same memory (writes are seen
    by both). Opening the same allocation again returns the cached mapping."""
    if not torch.cuda.is_available():
        raise RuntimeError("a CUDA-IPC buffer can only be opened in a process that sees a CUDA device "
                           "(the colocated engine runs on the learner's GPU)")
    if shared.device >= torch.cuda.device_count():
        raise RuntimeError(f"the buffer is on cuda:{shared.device}, this process sees {torch.cuda.device_count()} "
                           "GPU(s): colocated processes must see the GPU under the same index")
    return rebuild_cuda_tensor(
        torch.Tensor, torch.Size([shared.nbytes]), (1,), shared.tensor_offset, torch.storage.TypedStorage,
        torch.uint8, shared.device, shared.handle, shared.storage_bytes, shared.storage_offset, False,
        shared.ref_counter_handle, shared.ref_counter_offset, shared.event_handle, shared.event_sync_required)


def _receive(sock: zmq.Socket, expected: type, run_id: str, timeout_s: float, what: str):
    if not sock.poll(int(timeout_s * 1000), zmq.POLLIN):
        raise WeightSyncError(f"colocated weight sync: {what} did not arrive within {timeout_s:g} s")
    try:
        return decode_as(sock.recv(zmq.NOBLOCK), expected, run_id=run_id)
    except ProtocolError as exc:
        raise WeightSyncError(f"colocated weight sync: {what}: {exc}") from exc
