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
bounded by ``timeout_s`` and fails with :class:`WeightSyncError`. Each version allocates and shares
a new staging buffer (the engine maps it anew: the first version measured 24 ms against 16 ms for
the next ones, 1.1 GB on an H200). torch's CUDA-IPC bookkeeping frees a shared block only once the
consumer has released it, so a version whose engine died before opening it may keep one bucket of
GPU memory reserved in the learner (not measured). The engine's side is
``actors/weight_ipc.py``. With several learner ranks, the others iterate
``gather_buckets(..., fill=False)`` in step, as for NCCL.

Not wired into ``horizonrl train`` yet: the engine's loader (vLLM's worker) and the memory split
of one GPU are the colocated mode's other parts (docs/gpu.md, "One GPU").
"""

from __future__ import annotations

import time

import torch
import zmq
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from horizonrl.learner.weight_broadcast import gather_buckets
from horizonrl.protocol.codec import ProtocolError, decode_as, encode
from horizonrl.protocol.messages import CudaIpcBuffer, IpcBucketAck, IpcBucketReady, IpcWeights, WeightLayout
from horizonrl.protocol.weight_buckets import plan_buckets
from horizonrl.protocol.weights import WeightSyncError

__all__ = ["send_version_over_ipc", "share_cuda_buffer"]


def send_version_over_ipc(sock: zmq.Socket, named: list[tuple[str, torch.Tensor]], layout: WeightLayout, *,
                          bucket_bytes: int, device: torch.device, timeout_s: float) -> float:
    """Send one version (``layout`` says which, and the names, dtypes and shapes ``named`` is sent in)
    to the engine at the other end of ``sock``; returns once the engine has loaded it (seconds taken).

    Raises :class:`WeightSyncError` if the engine does not answer a bucket within ``timeout_s``."""
    plan = plan_buckets(layout.names, layout.dtypes, layout.shapes, bucket_bytes)
    if sum(bucket.nbytes for bucket in plan) != layout.total_bytes:
        raise ValueError(f"layout of version {layout.version} says {layout.total_bytes} bytes, its buckets hold "
                         f"{sum(bucket.nbytes for bucket in plan)}")
    start = time.perf_counter()
    staging = torch.empty(max((bucket.nbytes for bucket in plan), default=1), dtype=torch.uint8, device=device)
    _send(sock, IpcWeights(run_id=layout.run_id, layout=layout, bucket_bytes=bucket_bytes,
                           buffer=share_cuda_buffer(staging)), timeout_s, layout.version)
    into = [staging[: bucket.nbytes] for bucket in plan]
    for bucket, _ in zip(plan, gather_buckets(named, plan, device=device, fill=True, into=into)):
        torch.cuda.current_stream(device).synchronize()  # the engine reads on its own stream
        _send(sock, IpcBucketReady(run_id=layout.run_id, version=layout.version, index=bucket.index), timeout_s,
              layout.version)
        _await_ack(sock, layout, bucket.index, len(plan), timeout_s)
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
