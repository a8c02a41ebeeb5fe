"""An inline receive (a join, ``weight_staging: false``) reuses the buffers its buckets came in once the loader has
let go of their tensors, and never one whose tensors the loader still holds (vLLM's layer-wise reload keeps a
layer's tensors until the layer is complete, and a layer may straddle buckets). Before, every bucket of every
version came into a new buffer."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from horizonrl.actors.weight_receiver import WeightReceiver, open_weight_stream
from horizonrl.learner.weight_broadcast import WeightHub


class Done:
    def wait(self, timeout=None) -> bool:
        return True


class ServingGroup:
    """Rank 0 of a member's group: serves each packed version in turn; records what the receiver handed it."""

    def __init__(self, versions) -> None:
        self.pending = []
        for packed in versions:
            header = torch.tensor([len(packed.layout_bytes), packed.bucket_bytes], dtype=torch.int64)
            self.pending += [header, torch.frombuffer(bytearray(packed.layout_bytes), dtype=torch.uint8),
                             *packed.buckets]
        self.handed: list[tuple[int, int]] = []  # (address, bytes): no reference, which would hold the buffer

    def broadcast(self, tensors, options) -> Done:
        self.handed.append((tensors[0].untyped_storage().data_ptr(), tensors[0].numel()))
        tensors[0].copy_(self.pending.pop(0))
        return Done()

    def allreduce(self, tensors, options) -> Done:
        tensors[0].fill_(1)
        return Done()


def versions(count: int):
    """``count`` versions of six 16 KiB tensors in three buckets: (tensors, what the hub sends of each)."""
    hub = WeightHub("127.0.0.1", 0, backend="gloo", timeout_s=5, run_id="buffers", bucket_bytes=40 << 10)
    try:
        out = []
        for version in range(count):
            named = [(f"layer.{i}.weight", torch.full((64, 64), float(version * 10 + i))) for i in range(6)]
            packed = hub.pack(version, named)
            # copies: the hub packs the next version into the same buffers
            out.append((named, SimpleNamespace(layout_bytes=packed.layout_bytes, bucket_bytes=packed.bucket_bytes,
                                               buckets=[bucket.clone() for bucket in packed.buckets])))
        return out
    finally:
        hub.close()


def bucket_buffers(group: ServingGroup) -> list[int]:
    return [address for address, nbytes in group.handed if nbytes > 1024]


def test_buckets_reuse_buffers_the_loader_let_go_of():
    sent = versions(3)
    group = ServingGroup([packed for _, packed in sent])
    receiver = WeightReceiver(1, "gloo", 5.0, group, store=None)
    for named, packed in sent:
        stream = open_weight_stream(receiver)
        assert len(stream.plan) == 3
        for (name, got), (sent_name, tensor) in zip(stream, named):  # vLLM's in-place loader: copies, drops
            assert name == sent_name and torch.equal(got, tensor)
        stream.finish()
    buffers = bucket_buffers(group)
    assert len(buffers) == 9
    # The loop's variable holds the last tensor of a bucket while the next one comes: two buffers take turns.
    assert len(set(buffers)) == 2, buffers


def test_a_buffer_whose_tensors_the_loader_holds_is_never_reused():
    sent = versions(2)
    group = ServingGroup([packed for _, packed in sent])
    receiver = WeightReceiver(1, "gloo", 5.0, group, store=None)
    for named, packed in sent:
        stream = open_weight_stream(receiver)
        held = list(stream)  # a loader that keeps every tensor until the end (a layer straddling every bucket)
        stream.finish()
        assert [name for name, _ in held] == [name for name, _ in named]
        assert all(torch.equal(got, tensor) for (_, got), (_, tensor) in zip(held, named))
        del held
    buffers = bucket_buffers(group)
    assert len(set(buffers[:3])) == 3  # each bucket of a version in a buffer of its own while all are held
    assert set(buffers[3:]) <= set(buffers[:3])  # the next version reuses them once they were let go of
