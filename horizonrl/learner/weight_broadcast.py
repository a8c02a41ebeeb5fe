"""Rank 0's side of the weight transfer: host the weight group, pack a version, send it.

The wire format (frames, layout, alignment) is defined in ``protocol/weights.py``; the
receiving end is ``actors/weight_receiver.py``. Nothing here touches the default process group
(the learner's FSDP group): the weight group is built directly on a ``TCPStore`` this process
hosts, wrapped in a ``PrefixStore``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterable

import torch
import torch.distributed as dist

from horizonrl.protocol import WeightLayout, encode
from horizonrl.protocol.weights import STORE_PREFIX, WeightSyncError, layout_offsets

__all__ = ["PackedWeights", "WeightSender", "WeightSyncError", "broadcast_weights", "host_weight_group",
           "pack_weights", "send_packed"]


@dataclass
class WeightSender:
    """Rank 0's handle on the weight group (ranks 1..K are the engines' workers)."""

    world_size: int
    backend: str
    timeout_s: float
    process_group: dist.ProcessGroup
    store: dist.Store  # kept alive: this process hosts the TCPStore the receivers talk to
    # The flat payload buffer, reused by every version of the same size: a fresh CPU buffer
    # each time costs its page faults inside the timed send (2-3x slower on 100 MB).
    _flat: torch.Tensor | None = None

    rank = 0  # the sender is always rank 0 of the weight group

    @property
    def device(self) -> torch.device:
        # NCCL moves device memory only; gloo moves host memory.
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    def flat_buffer(self, nbytes: int) -> torch.Tensor:
        if self._flat is None or self._flat.numel() != nbytes:
            self._flat = None  # free the old one before allocating the new one
            self._flat = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._flat

    def close(self) -> None:
        shutdown = getattr(self.process_group, "shutdown", None)
        if callable(shutdown):
            try:
                shutdown()
            except Exception:  # best effort at teardown: the receivers may be gone already
                pass


def host_weight_group(host: str, port: int, world_size: int, timeout_s: float, backend: str = "gloo") -> WeightSender:
    """Host the weight group as rank 0; blocks until all ``world_size - 1`` receivers joined.

    Raises WeightSyncError if the rendezvous does not complete within ``timeout_s``.
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"weight-sync backend must be 'gloo' or 'nccl', not {backend!r}")
    timeout = timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(host, port, world_size, True, timeout, wait_for_workers=False)
        prefix_store = dist.PrefixStore(STORE_PREFIX, store)
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            group = dist.ProcessGroupNCCL(prefix_store, 0, world_size, options)
        else:
            group = dist.ProcessGroupGloo(prefix_store, 0, world_size, timeout)
    except RuntimeError as exc:  # DistStoreError / DistNetworkError / DistBackendError
        raise WeightSyncError(
            f"weight group rank 0/{world_size} at {host}:{port} ({backend}): could not form the group within "
            f"{timeout_s:.0f} s (are all {world_size - 1} engines started and pointed at this address?): {exc}"
        ) from exc
    return WeightSender(world_size, backend, timeout_s, group, store)


@dataclass
class PackedWeights:
    """One version packed into the sender's flat buffer, ready for :func:`send_packed`."""

    version: int
    layout_bytes: bytes
    flat: torch.Tensor
    tensors: int
    pack_s: float


def pack_weights(sender: WeightSender, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                 epoch: int = 0, run_id: str = "") -> PackedWeights:
    """Copy ``named_tensors`` into the flat buffer (no communication).

    Split from the send so the learner can pack *before* it announces the version: the
    engines stop generating from the moment they enter the receive, so nothing the
    sender can do beforehand should happen while they wait.
    """
    start = time.perf_counter()
    names, tensors = [], []
    for name, tensor in named_tensors:
        names.append(name)
        tensors.append(tensor.detach())
    offsets, total_bytes = layout_offsets([t.numel() * t.element_size() for t in tensors])
    layout = WeightLayout(
        run_id=run_id,
        version=version,
        epoch=epoch,
        names=names,
        dtypes=[str(t.dtype).removeprefix("torch.") for t in tensors],
        shapes=[list(t.shape) for t in tensors],
        total_bytes=total_bytes,
    )
    flat = sender.flat_buffer(total_bytes)
    for tensor, offset in zip(tensors, offsets):
        raw = tensor.contiguous().reshape(-1)
        raw = raw.view(torch.uint8) if raw.dtype != torch.uint8 else raw
        flat[offset : offset + raw.numel()].copy_(raw)
    return PackedWeights(version, encode(layout), flat, len(tensors), time.perf_counter() - start)


def send_packed(sender: WeightSender, packed: PackedWeights) -> dict[str, float]:
    """Broadcast a packed version to every receiver and wait for all their acks.

    Returns ``{"pack_s", "send_s", "total_s", "bytes", "tensors"}``.
    """
    start = time.perf_counter()
    version = packed.version
    header = torch.tensor([len(packed.layout_bytes)], dtype=torch.int64, device=sender.device)
    _broadcast(sender, header, version, "header")
    layout = torch.frombuffer(bytearray(packed.layout_bytes), dtype=torch.uint8).to(sender.device)
    _broadcast(sender, layout, version, "layout")
    _broadcast(sender, packed.flat, version, "payload")
    ack = torch.zeros(1, dtype=torch.int64, device=sender.device)
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.SUM
    _wait(sender, lambda: sender.process_group.allreduce([ack], options), version, "acknowledgement")
    receivers = int(ack.item())
    if receivers != sender.world_size - 1:
        raise WeightSyncError(
            f"weight sync rank 0: version {version} acknowledged by {receivers} of {sender.world_size - 1} receivers"
        )
    send_s = time.perf_counter() - start
    return {
        "pack_s": packed.pack_s,
        "send_s": send_s,
        "total_s": packed.pack_s + send_s,
        "bytes": float(packed.flat.numel()),
        "tensors": float(packed.tensors),
    }


def broadcast_weights(sender: WeightSender, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                      epoch: int = 0, run_id: str = "") -> dict[str, float]:
    """Send ``named_tensors`` as weight ``version`` (of ``epoch``) to every receiver (pack, then send)."""
    return send_packed(sender, pack_weights(sender, version, named_tensors, epoch=epoch, run_id=run_id))


def _broadcast(sender: WeightSender, tensor: torch.Tensor, version: int, what: str) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    _wait(sender, lambda: sender.process_group.broadcast([tensor], options), version, what)


def _wait(sender: WeightSender, start_work, version: int, what: str) -> None:
    try:
        start_work().wait(timedelta(seconds=sender.timeout_s))
    except RuntimeError as exc:
        raise WeightSyncError(
            f"weight sync learner (sender): {what} of version {version} did not complete within "
            f"{sender.timeout_s:.0f} s ({sender.world_size} ranks, {sender.backend}): {exc}"
        ) from exc
