"""An engine worker's side of the weight transfer: join the learner's weight hub, receive versions.

Runs inside the vLLM worker process (see ``vllm_worker.py``), which already has a default
process group, so nothing here touches it. The join steps and the wire format are defined in
``protocol/weights.py``; the sending end is ``learner/weight_broadcast.py``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from horizonrl.protocol import ProtocolError, WeightJoin, WeightLayout, decode_as, encode
from horizonrl.protocol.weights import JOIN_COUNTER, STORE_PREFIX, WeightSyncError, join_key, layout_offsets, member_prefix

__all__ = ["WeightReceiver", "WeightSyncError", "join_weight_hub", "receive_weights"]


@dataclass
class WeightReceiver:
    """Rank 1 of a two-rank group with the learner (rank 0): one membership of the weight hub."""

    number: int  # the join number
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


def join_weight_hub(host: str, port: int, *, actor: int, run_id: str, timeout_s: float,
                    backend: str = "gloo") -> WeightReceiver:
    """Join the learner's weight hub as ``actor``'s engine (WeightSyncError after the timeout).

    The learner answers with its newest version at once: receive it next (:func:`receive_weights`)."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"weight-sync backend must be 'gloo' or 'nccl', not {backend!r}")
    timeout = timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(host, port, None, False, timeout)
        joins = dist.PrefixStore(STORE_PREFIX, store)
        number = joins.add(JOIN_COUNTER, 1)
        joins.set(join_key(number), encode(WeightJoin(run_id=run_id, actor=actor, pid=os.getpid())))
        member_store = dist.PrefixStore(member_prefix(number), joins)
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            group = dist.ProcessGroupNCCL(member_store, 1, 2, options)
        else:
            group = dist.ProcessGroupGloo(member_store, 1, 2, timeout)
    except RuntimeError as exc:
        raise WeightSyncError(
            f"weight hub at {host}:{port} ({backend}): actor {actor} could not join within {timeout_s:.0f} s "
            f"(is the learner up and hosting the hub at this address?): {exc}"
        ) from exc
    return WeightReceiver(number, backend, timeout_s, group, store)


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
        raise WeightSyncError(f"weight sync (join {receiver.number}): malformed weight layout: {exc}") from exc
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
            f"weight sync (join {receiver.number}): layout of version {layout.version} says {layout.total_bytes} bytes, "
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
            f"weight sync (join {receiver.number}, receiver): {what} of {which} did not complete within "
            f"{receiver.timeout_s:.0f} s ({receiver.backend}): {exc}"
        ) from exc


def _numel(shape: list[int]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count
