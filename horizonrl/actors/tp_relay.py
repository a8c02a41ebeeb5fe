"""One receive per tensor-parallel engine: TP rank 0 takes each version from the learner and relays it to the other
workers over the engine's own tensor-parallel group.

Before, every worker of an engine was a member of the weight hub and received the whole model: with
``tensor_parallel_size`` k, k times the bytes from the learner per engine and, staged, k copies of the model in
pinned host memory beside the learner's. Now only TP rank 0 joins (``vllm_worker.py``). When a version is loaded —
inside an RPC that every worker runs at the same point, between two engine steps — rank 0 broadcasts over the TP
group a header (layout size, bucket size), the layout, then each bucket; every rank hands the bucket's tensors to
its own loader, which keeps its shard. Within one engine the group is the GPUs of one node (NVLink on an
8-GPU server), on the CPU a gloo group. Never from a thread while the engine generates: the group is vLLM's,
and its collectives must come in the same order on every rank.

The wire order is ``protocol/weights.py``'s (header, layout, buckets), the buckets ``protocol/weight_buckets.py``'s
plan, so a follower computes the plan from the header as a hub member does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterable, Iterator

import torch
import torch.distributed as dist

from horizonrl.protocol import ProtocolError, WeightLayout, decode_as, encode
from horizonrl.protocol.weight_buckets import Bucket, plan_buckets
from horizonrl.protocol.weights import WeightSyncError


@dataclass(frozen=True)
class TensorParallelGroup:
    """The engine's tensor-parallel group as the relay uses it."""

    rank: int  # this worker's rank in the group (0 receives from the learner)
    size: int
    group: dist.ProcessGroup  # vLLM's device group (NCCL on GPUs, gloo on the CPU); rank 0 of it is TP rank 0
    device: torch.device
    timeout_s: float


def vllm_tensor_parallel_group(device: torch.device, timeout_s: float) -> TensorParallelGroup | None:
    """The running vLLM worker's tensor-parallel group; None without tensor parallelism (or outside vLLM)."""
    try:
        from vllm.distributed.parallel_state import get_tp_group
    except ImportError:
        return None
    try:
        tp = get_tp_group()
    except AssertionError:  # no group: not inside a vLLM worker
        return None
    if tp.world_size <= 1:
        return None
    return TensorParallelGroup(tp.rank_in_group, tp.world_size, tp.device_group, device, timeout_s)


def _broadcast(tp: TensorParallelGroup, tensor: torch.Tensor, what: str, deadline: float | None) -> None:
    bound = tp.timeout_s if deadline is None else min(tp.timeout_s, deadline - time.time())
    if bound <= 0:
        raise WeightSyncError(f"tensor-parallel relay: {what}: the engine's deadline for this call has passed")
    options = dist.BroadcastOptions()
    options.rootRank = 0  # the group's own rank numbers: TP rank 0
    options.rootTensor = 0
    work = tp.group.broadcast([tensor], options)
    try:
        completed = work.wait(timedelta(seconds=bound))
    except RuntimeError as exc:
        raise WeightSyncError(f"tensor-parallel relay (rank {tp.rank} of {tp.size}): {what}: {exc}") from exc
    if completed is False:
        raise WeightSyncError(f"tensor-parallel relay (rank {tp.rank} of {tp.size}): {what} did not complete "
                              f"within {bound:.0f} s")


# The other ranks wait this much past the call's deadline, so that TP rank 0, whose own waits end by the deadline,
# always gets to tell them (a version, or none): a collective given up on would leave vLLM's group out of step.
FOLLOWER_MARGIN_S = 10.0


class RankZeroRelay:
    """TP rank 0's side of one call: :meth:`stream` relays a version; :meth:`abort`, where no version came (the hub
    failed before its layout), tells the other ranks so with an empty header. Either way every collective the other
    ranks wait for is made, so none is left pending on the group."""

    def __init__(self, tp: TensorParallelGroup, deadline: float | None) -> None:
        self.tp, self.deadline, self.opened = tp, deadline, False

    def abort(self) -> None:
        if not self.opened:
            self.opened = True
            _broadcast(self.tp, torch.zeros(2, dtype=torch.int64, device=self.tp.device), "header (no version)",
                       self.deadline)

    def stream(self, layout: WeightLayout, bucket_bytes: int, plan: list[Bucket],
               buckets: Iterable[tuple[Bucket, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The header and layout, then each ``(bucket, its bytes on the group's device)`` of ``plan`` as ``buckets``
        yields it; yields each bucket's named tensors (views into those bytes) for rank 0's own loader after the
        bucket went out. Consume it to the end (the other ranks wait for every bucket). Should ``buckets`` fail
        half-way (the learner gone), the rest of the plan goes out as zeros, and the error is raised: the engine
        then holds part of a version and rejoins, as a single worker does."""
        tp, deadline = self.tp, self.deadline
        self.opened = True
        layout_bytes = encode(layout)
        header = torch.tensor([len(layout_bytes), bucket_bytes], dtype=torch.int64, device=tp.device)
        _broadcast(tp, header, "header", deadline)
        _broadcast(tp, torch.frombuffer(bytearray(layout_bytes), dtype=torch.uint8).to(tp.device), "layout", deadline)
        sent = 0
        try:
            for bucket, data in buckets:
                _broadcast(tp, data, f"bucket {bucket.index} of version {layout.version}", deadline)
                sent += 1
                yield from ((entry.name, view(data, entry)) for entry in bucket.entries)
        except Exception:
            for bucket in plan[sent:]:  # keep the other ranks' collectives matched
                filler = torch.zeros(bucket.nbytes, dtype=torch.uint8, device=tp.device)
                _broadcast(tp, filler, f"bucket {bucket.index} (filler: rank 0 lost the version)", deadline)
            raise


def follow(tp: TensorParallelGroup, buffer_for, deadline: float | None) -> tuple[WeightLayout, Iterator]:
    """TP rank > 0: the version rank 0 relays; returns its layout and ``(name, tensor)`` bucket by bucket, each
    bucket received into ``buffer_for(nbytes)`` when the loader has taken the previous one's tensors."""
    deadline = None if deadline is None else deadline + FOLLOWER_MARGIN_S
    header = torch.zeros(2, dtype=torch.int64, device=tp.device)
    _broadcast(tp, header, "header", deadline)
    layout_size, bucket_bytes = (int(x) for x in header.tolist())
    if layout_size == 0 and bucket_bytes == 0:
        raise WeightSyncError(f"tensor-parallel relay (rank {tp.rank}): TP rank 0 got no version to relay (its own "
                              "error says why)")
    if layout_size <= 0 or bucket_bytes <= 0:
        raise WeightSyncError(f"tensor-parallel relay: malformed header {[layout_size, bucket_bytes]}")
    layout_buffer = torch.empty(layout_size, dtype=torch.uint8, device=tp.device)
    _broadcast(tp, layout_buffer, "layout", deadline)
    try:
        layout = decode_as(layout_buffer.cpu().numpy().tobytes(), WeightLayout)
        plan = plan_buckets(layout.names, layout.dtypes, layout.shapes, bucket_bytes)
    except (ProtocolError, ValueError) as exc:
        raise WeightSyncError(f"tensor-parallel relay: malformed weight layout: {exc}") from exc

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for bucket in plan:
            data = buffer_for(bucket.nbytes)
            _broadcast(tp, data, f"bucket {bucket.index} of version {layout.version}", deadline)
            yield from ((entry.name, view(data, entry)) for entry in bucket.entries)
            del data  # the next bucket may reuse this buffer once the loader has let go of its tensors

    return layout, tensors()


def host_plan(layout: WeightLayout, bucket_bytes: int) -> list[Bucket]:
    return plan_buckets(layout.names, layout.dtypes, layout.shapes, bucket_bytes)


def host_buckets(layout: WeightLayout, named: list[tuple[str, torch.Tensor]], bucket_bytes: int, buffer_for,
                 staging) -> Iterator[tuple[Bucket, torch.Tensor]]:
    """A staged version (``named``: views into host memory) bucket by bucket on ``buffer_for``'s device: each
    bucket's tensors copied into a buffer of one bucket, through ``staging`` (a ``HostStaging``: one pinned
    bucket on a GPU) where the device is a GPU."""
    by_name = dict(named)
    for bucket in host_plan(layout, bucket_bytes):
        data = buffer_for(bucket.nbytes)
        for entry in bucket.entries:
            staging.to_device(data[entry.offset: entry.offset + entry.nbytes], _bytes_of(by_name[entry.name]))
        yield bucket, data
        del data


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def view(data: torch.Tensor, entry) -> torch.Tensor:
    dtype = getattr(torch, entry.dtype)
    return data[entry.offset: entry.offset + entry.nbytes].view(dtype).view(entry.shape)
