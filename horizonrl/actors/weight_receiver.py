"""An engine worker's side of the weight transfer: join the learner's weight group, receive versions.

Runs inside the vLLM worker process (see ``vllm_worker.py``), which already has a default
process group, so nothing here touches it. The wire format is defined in
``protocol/weights.py``; the sending end is ``learner/weight_broadcast.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from horizonrl.protocol import ProtocolError, WeightLayout, decode_as
from horizonrl.protocol.weights import STORE_PREFIX, WeightSyncError, layout_offsets

__all__ = ["WeightReceiver", "WeightSyncError", "join_weight_group", "receive_weights"]


@dataclass
class WeightReceiver:
    """Rank ``rank`` (> 0) of the weight group."""

    rank: int
    world_size: int
    backend: str
    timeout_s: float
    process_group: dist.ProcessGroup
    store: dist.Store
    # The flat payload buffer, reused by every version of the same size (no page faults per receive).
    _flat: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    def flat_buffer(self, nbytes: int) -> torch.Tensor:
        if self._flat is None or self._flat.numel() != nbytes:
            self._flat = None
            self._flat = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._flat

    def close(self) -> None:
        shutdown = getattr(self.process_group, "shutdown", None)
        if callable(shutdown):
            try:
                shutdown()
            except Exception:  # best effort at teardown: the learner may be gone already
                pass


def join_weight_group(host: str, port: int, rank: int, world_size: int, timeout_s: float,
                      backend: str = "gloo") -> WeightReceiver:
    """Join the learner's weight group as ``rank``; blocks until all ranks joined (WeightSyncError after the timeout)."""
    if not 0 < rank < world_size:
        raise ValueError(f"receiver rank must be in 1..{world_size - 1}, got {rank}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"weight-sync backend must be 'gloo' or 'nccl', not {backend!r}")
    timeout = timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(host, port, world_size, False, timeout)
        prefix_store = dist.PrefixStore(STORE_PREFIX, store)
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            group = dist.ProcessGroupNCCL(prefix_store, rank, world_size, options)
        else:
            group = dist.ProcessGroupGloo(prefix_store, rank, world_size, timeout)
    except RuntimeError as exc:
        raise WeightSyncError(
            f"weight group rank {rank}/{world_size} at {host}:{port} ({backend}): could not join within "
            f"{timeout_s:.0f} s (is the learner up and hosting the group at this address?): {exc}"
        ) from exc
    return WeightReceiver(rank, world_size, backend, timeout_s, group, store)


def receive_weights(receiver: WeightReceiver) -> tuple[WeightLayout, list[tuple[str, torch.Tensor]]]:
    """Receive one version; returns its layout (version, epoch, ...) and ``[(name, tensor), ...]``.

    The tensors are views into the receiver's flat buffer, which the next receive overwrites:
    load or copy them before receiving again, and do not resize them.
    """
    header = torch.zeros(1, dtype=torch.int64, device=receiver.device)
    _broadcast(receiver, header, "header")
    layout_buffer = torch.empty(int(header.item()), dtype=torch.uint8, device=receiver.device)
    _broadcast(receiver, layout_buffer, "layout")
    try:
        layout = decode_as(layout_buffer.cpu().numpy().tobytes(), WeightLayout)
    except ProtocolError as exc:
        raise WeightSyncError(f"weight sync rank {receiver.rank}: malformed weight layout: {exc}") from exc
    flat = receiver.flat_buffer(layout.total_bytes)
    _broadcast(receiver, flat, "payload", layout.version)
    ack = torch.ones(1, dtype=torch.int64, device=receiver.device)
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.SUM
    _wait(receiver, lambda: receiver.process_group.allreduce([ack], options), "acknowledgement", layout.version)

    dtypes = [getattr(torch, name) for name in layout.dtypes]
    sizes = [_numel(shape) * torch.empty(0, dtype=dtype).element_size() for shape, dtype in zip(layout.shapes, dtypes)]
    offsets, total_bytes = layout_offsets(sizes)
    if total_bytes != layout.total_bytes:
        raise WeightSyncError(
            f"weight sync rank {receiver.rank}: layout of version {layout.version} says {layout.total_bytes} bytes, "
            f"its tensors need {total_bytes}"
        )
    named = [
        (name, flat[offset : offset + size].view(dtype).view(shape))
        for name, dtype, shape, offset, size in zip(layout.names, dtypes, layout.shapes, offsets, sizes)
    ]
    return layout, named


def _broadcast(receiver: WeightReceiver, tensor: torch.Tensor, what: str, version: int | None = None) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    _wait(receiver, lambda: receiver.process_group.broadcast([tensor], options), what, version)


def _wait(receiver: WeightReceiver, start_work, what: str, version: int | None) -> None:
    which = "the next version" if version is None else f"version {version}"
    try:
        start_work().wait(timedelta(seconds=receiver.timeout_s))
    except RuntimeError as exc:
        raise WeightSyncError(
            f"weight sync engine rank {receiver.rank} (receiver): {what} of {which} did not complete within "
            f"{receiver.timeout_s:.0f} s ({receiver.world_size} ranks, {receiver.backend}): {exc}"
        ) from exc


def _numel(shape: list[int]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count
