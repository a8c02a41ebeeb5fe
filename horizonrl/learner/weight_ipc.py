"""Learner rank 0's side of the colocated weight path: a version to an engine on the same GPU.

NCCL cannot put two ranks on one device, so when the learner and an engine share a GPU the weights
go through CUDA IPC instead: rank 0 gathers each bucket of the plan
(``protocol/weight_buckets.py``, the same buckets as over NCCL) into one staging buffer on the GPU
that the engine has mapped, and the engine copies each bucket into its model in place. The bytes
never leave the device; what travels over the ZeroMQ socket (PAIR, loopback) is small messages:

    learner -> engine   IpcWeights(layout, bucket_bytes, buffer handle)     once per version
    learner -> engine   IpcBucketReady(version, i)                           bucket i written, synced
    engine  -> learner  IpcBucketAck(version, i)                             bucket i read; the last: loaded

The buffer's handle is torch's own CUDA IPC (``torch.multiprocessing.reductions``): the producer
exports the allocation with a shared reference counter that keeps the memory alive while a consumer
holds it, and an event the consumer waits on before its first read. torch sends those fields pickled
through a ``multiprocessing`` queue; here they travel as :class:`CudaIpcBuffer`, plain bytes and
integers, in msgpack. Both processes must see the GPU under the same device index (colocated
processes get the same ``CUDA_VISIBLE_DEVICES``).

The staging buffer is rewritten with bucket i + 1 only after the ack of bucket i. Every wait is
bounded by ``timeout_s`` and fails with :class:`WeightSyncError`. :class:`IpcSender` is one engine's
link: it keeps its staging buffer (one bucket) from version to version, so the engine's mapping of it
is made once (a fresh buffer per version measured 24 ms against 16 ms for 1.1 GB on an H200). torch's
CUDA-IPC bookkeeping frees a shared block only once the consumer has released it, so a link whose
engine died may keep one bucket of GPU memory reserved in the learner (not measured). The engine's
side is ``actors/weight_ipc.py``.

In ``horizonrl train`` the weight hub (``learner/weight_broadcast.py``) holds an :class:`IpcSender` for
a member whose join names an ``ipc_address`` (the engine on the learner's GPU, colocated mode) and a
two-rank NCCL group for every other member; the buckets are the same. :func:`send_version_over_ipc`
sends one version over a bare socket (``scripts/gpu_check.py``).
"""

from __future__ import annotations

import time

import torch
import zmq
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from horizonrl.learner.weight_gather import gather_buckets
from horizonrl.protocol.codec import ProtocolError, decode_as, encode
from horizonrl.protocol.messages import CudaIpcBuffer, IpcBucketAck, IpcBucketReady, IpcWeights, WeightLayout
from horizonrl.protocol.weight_buckets import plan_buckets
from horizonrl.protocol.weights import WeightSyncError

__all__ = ["IpcSender", "send_version_over_ipc", "share_cuda_buffer"]


class IpcSender:
    """Rank 0's end of one colocated engine's link: the PAIR socket to it and the staging buffer it maps.

    A version is :meth:`begin`, then :meth:`send_bucket` for each bucket of the plan in order (each
    returns once the engine has read it; the last once it has loaded the version), then :meth:`finish`.
    The same three calls as a two-rank group's link in the weight hub."""

    def __init__(self, sock: zmq.Socket, device: torch.device, timeout_s: float) -> None:
        self.sock = sock
        self.device = device
        self.timeout_s = timeout_s
        self.staging: torch.Tensor | None = None  # one bucket, reused while versions fit in it
        self._shared: CudaIpcBuffer | None = None
        self._layout: WeightLayout | None = None
        self._buckets = 0

    def begin(self, layout_bytes: bytes, bucket_bytes: int, what: str = "", timeout_s: float | None = None) -> None:
        """Announce a version (its encoded :class:`WeightLayout`) and the buffer its buckets will come through.
        ``timeout_s`` (here and below): this call's bound instead of the sender's own."""
        try:
            layout = decode_as(layout_bytes, WeightLayout)
        except ProtocolError as exc:
            raise ValueError(f"not a weight layout: {exc}") from exc
        plan = plan_buckets(layout.names, layout.dtypes, layout.shapes, bucket_bytes)
        if sum(bucket.nbytes for bucket in plan) != layout.total_bytes:
            raise ValueError(f"layout of version {layout.version} says {layout.total_bytes} bytes, its buckets hold "
                             f"{sum(bucket.nbytes for bucket in plan)}")
        need = max((bucket.nbytes for bucket in plan), default=1)
        if self.staging is None or self.staging.numel() < need:
            self.staging, self._shared = None, None  # the engine's mapping of an old one ends with its next version
            self.staging = torch.empty(need, dtype=torch.uint8, device=self.device)
            self._shared = share_cuda_buffer(self.staging)
        self._layout, self._buckets = layout, len(plan)
        _send(self.sock, IpcWeights(run_id=layout.run_id, layout=layout, bucket_bytes=bucket_bytes,
                                    buffer=self._shared), timeout_s or self.timeout_s, layout.version)

    def send_bucket(self, index: int, data: torch.Tensor, what: str = "", timeout_s: float | None = None) -> None:
        """Bucket ``index`` (``data``: its bytes, on the GPU or in host memory; a view of the staging buffer
        is not copied) into the shared buffer; returns when the engine has acknowledged it."""
        layout = self._layout
        target = self.staging[: data.numel()]
        if data.data_ptr() != target.data_ptr():
            target.copy_(data)
        torch.cuda.current_stream(self.device).synchronize()  # the engine reads on its own stream
        _send(self.sock, IpcBucketReady(run_id=layout.run_id, version=layout.version, index=index),
              timeout_s or self.timeout_s, layout.version)
        _await_ack(self.sock, layout, index, self._buckets, timeout_s or self.timeout_s)

    def finish(self, what: str = "", timeout_s: float | None = None) -> None:
        """Nothing left to wait for: the last bucket's acknowledgement came after the engine loaded the version."""

    def close(self) -> None:
        self.sock.close(linger=0)


def send_version_over_ipc(sock: zmq.Socket, named: list[tuple[str, torch.Tensor]], layout: WeightLayout, *,
                          bucket_bytes: int, device: torch.device, timeout_s: float,
                          sender: IpcSender | None = None) -> float:
    """Send one version (``layout`` says which, and the names, dtypes and shapes ``named`` is sent in)
    to the engine at the other end of ``sock``; returns once the engine has loaded it (seconds taken).
    Pass the ``sender`` of the previous version to reuse its staging buffer.

    Raises :class:`WeightSyncError` if the engine does not answer a bucket within ``timeout_s``."""
    start = time.perf_counter()
    sender = sender or IpcSender(sock, device, timeout_s)
    sender.begin(encode(layout), bucket_bytes)
    plan = plan_buckets(layout.names, layout.dtypes, layout.shapes, bucket_bytes)
    into = [sender.staging[: bucket.nbytes] for bucket in plan]  # the gathers write into the shared buffer
    for bucket, data in zip(plan, gather_buckets(named, plan, device=device, fill=True, into=into)):
        sender.send_bucket(bucket.index, data)
    sender.finish()
    return time.perf_counter() - start


def share_cuda_buffer(buffer: torch.Tensor) -> CudaIpcBuffer:
    """The handle of ``buffer`` (1-D, contiguous, ``uint8``, on a CUDA device) for another process.

    The producer must keep ``buffer`` alive, and unchanged while the consumer reads it: the handle
    maps the same memory, it is not a copy."""
    if buffer.device.type != "cuda":
        raise ValueError(f"only a CUDA buffer can be shared through CUDA IPC, not one on {buffer.device}")
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
        raise ValueError(f"share a flat contiguous uint8 buffer, not {buffer.dtype} of shape {tuple(buffer.shape)}")
    rebuild, args = reduce_tensor(buffer)
    if rebuild is not rebuild_cuda_tensor:  # torch's CUDA reduction changed: fail loudly, not with garbage
        raise RuntimeError(f"torch {torch.__version__} reduced a CUDA tensor with {rebuild.__name__}, "
                           "not rebuild_cuda_tensor: its CUDA-IPC fields are not the ones this code reads")
    (_cls, _size, _stride, tensor_offset, _storage_cls, _dtype, device, handle, storage_bytes, storage_offset,
     _requires_grad, ref_counter_handle, ref_counter_offset, event_handle, event_sync_required) = args
    return CudaIpcBuffer(
        device=int(device), handle=bytes(handle), storage_bytes=int(storage_bytes), storage_offset=int(storage_offset),
        ref_counter_handle=bytes(ref_counter_handle), ref_counter_offset=int(ref_counter_offset),
        event_handle=None if event_handle is None else bytes(event_handle),
        event_sync_required=bool(event_sync_required), tensor_offset=int(tensor_offset), nbytes=int(buffer.numel()))


def _send(sock: zmq.Socket, message, timeout_s: float, version: int) -> None:
    if not sock.poll(int(timeout_s * 1000), zmq.POLLOUT):
        raise WeightSyncError(f"colocated weight sync: the engine took no message of version {version} "
                              f"within {timeout_s:g} s")
    sock.send(encode(message), zmq.NOBLOCK)


def _await_ack(sock: zmq.Socket, layout: WeightLayout, index: int, buckets: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not sock.poll(int(left * 1000), zmq.POLLIN):
            raise WeightSyncError(f"colocated weight sync: no acknowledgement of bucket {index} of {buckets} of "
                                  f"version {layout.version} within {timeout_s:g} s (the engine may hold part "
                                  "of this version)")
        try:
            ack = decode_as(sock.recv(zmq.NOBLOCK), IpcBucketAck, run_id=layout.run_id)
        except ProtocolError as exc:
            raise WeightSyncError(f"colocated weight sync: {exc}") from exc
        if (ack.version, ack.index) == (layout.version, index):
            return
        if ack.version > layout.version or (ack.version == layout.version and ack.index > index):
            raise WeightSyncError(f"colocated weight sync: the engine acknowledged bucket {ack.index} of version "
                                  f"{ack.version} while bucket {index} of version {layout.version} was in flight")
        # an older acknowledgement (of a version abandoned after a timeout): skip it
