"""Where a staged version waits. On a GPU the staged receive used to allocate the whole model on every worker's
device, outside vLLM's memory budget (a 7B model in bf16 does not fit beside an engine at utilization 0.9 on
80 GB): out of memory, a failed receive, a rejoin, and the learner's send to that member blocked until its
time-out. Now a receiver on a GPU (``stage_in_host``) stages in host memory and only one bucket passes through
the device. The learner's side here is a process group that serves one packed version; what it was handed to
fill is what the receiver allocated for the collectives (on a GPU, device memory)."""

from __future__ import annotations

import torch
import zmq

from horizonrl.actors.weight_receiver import StagedReceive, WeightReceiver
from horizonrl.learner.weight_broadcast import WeightHub
from horizonrl.protocol.worker_replies import StageOutcome


class Done:
    def wait(self, timeout=None) -> bool:
        return True


class ServingGroup:
    """Rank 0 of a member's group for one version: header, layout, buckets, then the acknowledgement."""

    def __init__(self, packed) -> None:
        header = torch.tensor([len(packed.layout_bytes), packed.bucket_bytes], dtype=torch.int64)
        layout = torch.frombuffer(bytearray(packed.layout_bytes), dtype=torch.uint8)
        self.pending = [header, layout, *packed.buckets]
        self.handed: list[torch.Tensor] = []  # every tensor the receiver gave a collective to fill

    def broadcast(self, tensors, options) -> Done:
        (tensor,) = tensors
        self.handed.append(tensor)
        tensor.copy_(self.pending.pop(0))
        return Done()

    def allreduce(self, tensors, options) -> Done:
        tensors[0].fill_(1)
        return Done()


def test_a_staged_version_waits_in_host_memory_and_the_device_holds_one_bucket(tmp_path):
    named = [(f"layer.{i}.weight", torch.randn(64, 64)) for i in range(6)]  # 16 KiB each
    hub = WeightHub("127.0.0.1", 0, backend="gloo", timeout_s=5, run_id="staging", bucket_bytes=40 << 10)
    try:
        packed = hub.pack(3, named)
    finally:
        hub.close()
    largest = max(bucket.nbytes for bucket in packed.plan)
    assert len(packed.plan) == 3 and packed.nbytes > 2 * largest
    group = ServingGroup(packed)
    receiver = WeightReceiver(1, "gloo", 5.0, group, store=None)
    receiver.stage_in_host = True  # what a receiver on a GPU (NCCL) is
    context = zmq.Context()
    actor = context.socket(zmq.PULL)
    address = f"ipc://{tmp_path}/staged"
    actor.bind(address)
    try:
        staged = StagedReceive.start(receiver, stage_id=1, notify_address=address)
        staged.thread.join(30)
        assert actor.poll(10_000)
        outcome = StageOutcome.decode(actor.recv())
    finally:
        actor.close(linger=0)
        context.term()
    assert (outcome.stage_id, outcome.version, outcome.epoch, outcome.error) == (1, 3, 0, "")
    # The collectives filled nothing bigger than a bucket: the device holds one bucket, not the model.
    buckets = group.handed[2:]
    assert len(buckets) == 3 and all(t.untyped_storage().nbytes() <= largest for t in buckets)
    # The staged tensors are exact and live in memory of their own (the host buffer), not in what the
    # collectives fill with the next bucket.
    handed = {t.untyped_storage().data_ptr() for t in group.handed}
    assert [name for name, _ in staged.named] == [name for name, _ in named]
    for (_, got), (_, sent) in zip(staged.named, named):
        assert torch.equal(got, sent) and got.untyped_storage().data_ptr() not in handed
