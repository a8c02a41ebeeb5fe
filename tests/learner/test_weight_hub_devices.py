"""Which memory the weight hub hands its links. NCCL moves device memory only (``ProcessGroupNCCL`` raises
"Tensors must be CUDA and dense" for a host tensor), while the hub keeps its newest version for joiners in host
memory (the admission copy): a join, and a send from that copy, must reach a link as device tensors. The
``meta`` device stands in for the GPU, and a link records the device of every tensor it is given; the real
transfer over gloo is tests/learner/test_learner_weight_sync.py's."""

from __future__ import annotations

import torch

import horizonrl.learner.weight_admission as weight_admission
from horizonrl.actors.weight_join import announce_join
from horizonrl.learner.weight_broadcast import WeightHub
from horizonrl.protocol import WeightJoin

RUN_ID = "devices"


class RecordingLink:
    """A member's link that takes everything and notes which device each bucket was on."""

    devices: list[str] = []

    def __init__(self, group, device, group_timeout_s=0.0) -> None:
        pass

    def begin(self, layout_bytes, bucket_bytes, what, timeout_s) -> None:
        pass

    def send_bucket(self, index, data, what, timeout_s) -> None:
        RecordingLink.devices.append(data.device.type)

    def finish(self, what, timeout_s) -> None:
        pass

    def close(self) -> None:
        pass


def weights(scale: float) -> list[tuple[str, torch.Tensor]]:
    return [(f"layer.{i}.weight", torch.full((64, 64), scale)) for i in range(5)]  # 16 KiB each


def test_a_hub_on_a_gpu_hands_its_links_device_memory_at_a_join_and_a_send(monkeypatch):
    hub = WeightHub("127.0.0.1", 0, backend="gloo", timeout_s=10, run_id=RUN_ID, bucket_bytes=40 << 10)
    try:
        hub.device = torch.device("meta")  # what a hub on a GPU has (NCCL), without one
        monkeypatch.setattr(weight_admission, "GroupLink", RecordingLink)
        monkeypatch.setattr(hub.desk, "_form_group", lambda number: object())
        RecordingLink.devices = []
        hub.pack(0, weights(1.0))  # the admission copy: host memory
        assert all(bucket.device.type == "cpu" for bucket in hub.latest.buckets) and len(hub.latest.plan) == 3
        _, _, number = announce_join("127.0.0.1", hub.port, 10, WeightJoin(run_id=RUN_ID, actor=0, pid=1, worker=0))
        hub.desk._take(number)  # what the door's thread does for that join
        assert list(hub.members) == [(0, 0)] and hub.counters["admitted"] == 1
        assert RecordingLink.devices == ["meta"] * 3  # the first version, from the admission copy
        stats = hub.send(hub.pack(1, weights(2.0)))
        assert stats["dropped"] == 0 and hub.members[(0, 0)].has == (0, 1)
        assert RecordingLink.devices == ["meta"] * 6
    finally:
        hub.close()
