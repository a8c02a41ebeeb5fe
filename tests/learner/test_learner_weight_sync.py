"""The weight broadcast between two plain processes over gloo (no default process group)."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

from horizonrl.protocol.transport import free_port
from horizonrl.actors.weight_receiver import join_weight_group, receive_weights
from horizonrl.learner.weight_broadcast import broadcast_weights, host_weight_group
from horizonrl.protocol.weights import WeightSyncError

pytestmark = pytest.mark.slow


def _state_dict() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(7, 5, generator=generator),
        "model.layers.0.mlp.weight": torch.randn(3, 5, generator=generator).to(torch.bfloat16),
        "model.norm.weight": torch.randn(5, generator=generator).to(torch.float16),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "counts": torch.arange(11, dtype=torch.int32),
        "flags": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4),
    }


def _receiver(port: int, versions: int, queue) -> None:
    group = join_weight_group("127.0.0.1", port, rank=1, world_size=2, timeout_s=30)
    for _ in range(versions):
        layout, named = receive_weights(group)
        version = layout.version
        queue.put((version, [(name, tensor.clone()) for name, tensor in named]))


def _idle_member(port: int) -> None:
    join_weight_group("127.0.0.1", port, rank=1, world_size=2, timeout_s=30)
    time.sleep(60)  # joined, but never receives


def _stop(process: mp.Process) -> None:
    if process.is_alive():
        process.kill()
    process.join(10)


def test_round_trip_is_exact():
    ctx = mp.get_context("spawn")
    port = free_port()
    queue = ctx.Queue()
    receiver = ctx.Process(target=_receiver, args=(port, 2, queue), daemon=True)
    receiver.start()
    try:
        group = host_weight_group("127.0.0.1", port, world_size=2, timeout_s=30)
        sent = _state_dict()
        for version in (1, 2):
            stats = broadcast_weights(group, version, ((k, v * version if v.is_floating_point() else v) for k, v in sent.items()))
            assert stats["bytes"] >= sum(t.numel() * t.element_size() for t in sent.values())
            got_version, named = queue.get(timeout=30)
            assert got_version == version
            assert [name for name, _ in named] == list(sent)
            for name, tensor in named:
                expected = sent[name] * version if sent[name].is_floating_point() else sent[name]
                assert tensor.dtype == expected.dtype and tensor.shape == expected.shape, name
                assert torch.equal(tensor, expected), name
        group.close()
    finally:
        _stop(receiver)


def test_missing_receiver_fails_within_timeout():
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match="could not form the group"):
        host_weight_group("127.0.0.1", free_port(), world_size=2, timeout_s=2)
    assert time.monotonic() - start < 15


def test_receiver_that_never_receives_fails_the_sender():
    ctx = mp.get_context("spawn")
    port = free_port()
    member = ctx.Process(target=_idle_member, args=(port,), daemon=True)
    member.start()
    try:
        group = host_weight_group("127.0.0.1", port, world_size=2, timeout_s=30)
        group.timeout_s = 2  # the rendezvous may be slow (a spawned child); the broadcast must not
        start = time.monotonic()
        with pytest.raises(WeightSyncError, match="version 7"):
            broadcast_weights(group, 7, _state_dict().items())
        assert time.monotonic() - start < 15
    finally:
        _stop(member)
