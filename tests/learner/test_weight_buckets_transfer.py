"""Bucketed weight transfer between real processes over gloo: several buckets arrive bit-exact, in the
engine's dtype, whether the sender holds full tensors or gathers FSDP2 shards from two learner ranks."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

from horizonrl.protocol.transport import free_port, free_ports

pytestmark = pytest.mark.slow

RUN_ID = "test-run"
BUCKET_BYTES = 8 << 10  # 8 KiB: the dict below is ~90 KB, so a dozen buckets and one oversized tensor


def _model_sized_dict(version: int) -> dict[str, torch.Tensor]:
    """A Qwen2-shaped state dict in miniature: float32 master weights, an oversized embedding, odd sizes."""
    g = torch.Generator().manual_seed(version)
    tensors = {"model.embed_tokens.weight": torch.randn(97, 64, generator=g)}  # 24.8 KB: bigger than a bucket
    for layer in range(3):
        prefix = f"model.layers.{layer}."
        tensors[prefix + "self_attn.q_proj.weight"] = torch.randn(64, 64, generator=g)
        tensors[prefix + "self_attn.q_proj.bias"] = torch.randn(64, generator=g)
        tensors[prefix + "self_attn.k_proj.weight"] = torch.randn(17, 64, generator=g)
        tensors[prefix + "mlp.up_proj.weight"] = torch.randn(31, 64, generator=g)
        tensors[prefix + "input_layernorm.weight"] = torch.randn(64, generator=g)
    tensors["model.norm.weight"] = torch.randn(64, generator=g)
    tensors["model.counts"] = torch.arange(13, dtype=torch.int64) * (version + 1)  # not floating: kept as is
    return tensors


def _expected(version: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in _model_sized_dict(version).items()}


def _receiver(port: int, versions: int, queue, whole: bool) -> None:
    from horizonrl.actors.weight_receiver import join_weight_hub, open_weight_stream, receive_weights

    receiver = join_weight_hub("127.0.0.1", port, actor=0, run_id=RUN_ID, timeout_s=120)
    for _ in range(versions):
        if whole:
            layout, named = receive_weights(receiver)
            buckets = -1
        else:
            stream = open_weight_stream(receiver)
            stream.prefetch()
            named = [(name, tensor.clone()) for name, tensor in stream]  # a loader copies each tensor
            stream.finish()
            layout, buckets = stream.layout, len(stream.plan)
        queue.put((layout.version, buckets, [(name, tensor.clone()) for name, tensor in named]))
    # Stay alive until the test ends: torch passes the queued tensors' memory by file descriptor, which
    # the reader fetches from this process (a reader late after this process exited fails).
    time.sleep(60)


def _assert_bit_exact(named, expected: dict[str, torch.Tensor]) -> None:
    assert [name for name, _ in named] == list(expected)
    for name, tensor in named:
        want = expected[name]
        assert tensor.dtype == want.dtype and tensor.shape == want.shape, name
        assert torch.equal(tensor.view(torch.uint8) if tensor.dtype == torch.bfloat16 else tensor,
                           want.view(torch.uint8) if want.dtype == torch.bfloat16 else want), name


@pytest.mark.parametrize("whole", [False, True], ids=["bucket_by_bucket", "whole_version"])
def test_a_bucketed_publish_arrives_bit_exact_in_the_engine_dtype(whole):
    from horizonrl.learner.weight_broadcast import WeightHub

    port = free_port()
    hub = WeightHub("127.0.0.1", port, backend="gloo", timeout_s=60, run_id=RUN_ID, bucket_bytes=BUCKET_BYTES)
    hub.publish(0, 0, list(_model_sized_dict(0).items()), dtype=torch.bfloat16)  # no members yet
    hub.start()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(port, 3, queue, whole), daemon=True)
    proc.start()
    try:
        version, buckets, named = queue.get(timeout=120)  # the join: version 0 from the admission copy
        assert version == 0
        _assert_bit_exact(named, _expected(0, torch.bfloat16))
        for version in (1, 2):
            stats = hub.publish(version, 0, list(_model_sized_dict(version).items()), dtype=torch.bfloat16)
            assert stats["members"] == 1 and stats["dropped"] == 0
            assert stats["buckets"] >= 6  # several buckets, so the test can fail on bucket boundaries
            got, buckets, named = queue.get(timeout=60)
            assert got == version
            if not whole:
                assert buckets == stats["buckets"]
            _assert_bit_exact(named, _expected(version, torch.bfloat16))
        # the admission copy holds the newest version, in the engine's dtype
        assert hub.latest.version == 2 and hub.latest.nbytes == stats["bytes"]
    finally:
        hub.close()
        if proc.is_alive():
            proc.kill()
        proc.join(10)


def _learner_rank(rank: int, dist_port: int, hub_port: int, versions: int, queue) -> None:
    """One of two FSDP2 ranks: the model's weights are sharded; rank 0 hosts the hub."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from horizonrl.learner.weight_broadcast import WeightHub
    from horizonrl.learner.weight_gather import gather_without_sending

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{dist_port}", rank=rank, world_size=2)
    module = nn.Module()
    for name, tensor in _model_sized_dict(0).items():
        module.register_parameter(name.replace(".", "_"), nn.Parameter(tensor.clone(), requires_grad=False)) \
            if tensor.is_floating_point() else module.register_buffer(name.replace(".", "_"), tensor.clone())
    fully_shard(module, mesh=init_device_mesh("cpu", (2,)))
    names = dict(zip((n.replace(".", "_") for n in _model_sized_dict(0)), _model_sized_dict(0)))
    hub = None
    if rank == 0:
        hub = WeightHub("127.0.0.1", hub_port, backend="gloo", timeout_s=60, run_id=RUN_ID, bucket_bytes=BUCKET_BYTES)
    for version in range(versions):
        if version:  # a "training step": every shard changes to the next version's values
            with torch.no_grad():
                for key, tensor in _model_sized_dict(version).items():
                    local = module.state_dict()[key.replace(".", "_")]
                    if hasattr(local, "to_local"):
                        full = tensor
                        local.to_local().copy_(full.chunk(2)[rank] if full.shape[0] >= 2 else full)
                    else:
                        local.copy_(tensor)
        state = module.state_dict()
        named = [(names[key], state[key]) for key in names]
        if rank == 0:
            stats = hub.publish(version, 0, named, dtype=torch.bfloat16)
            if version == 0:
                hub.start()
                queue.put(("hub", None))
                while not hub.members:
                    time.sleep(0.05)
            else:
                queue.put(("stats", stats))
        else:
            gather_without_sending(named, bucket_bytes=BUCKET_BYTES, dtype=torch.bfloat16)
        dist.barrier()
    queue.put((f"done{rank}", None))
    time.sleep(30)  # keep the hub up while the test reads the queue


def test_two_fsdp_ranks_gather_buckets_and_the_engine_gets_the_full_weights():
    ctx = mp.get_context("spawn")
    queue, received = ctx.Queue(), ctx.Queue()
    dist_port, hub_port = free_ports(2)
    ranks = [ctx.Process(target=_learner_rank, args=(r, dist_port, hub_port, 3, queue), daemon=True) for r in (0, 1)]
    for proc in ranks:
        proc.start()
    receiver = None
    try:
        assert queue.get(timeout=120)[0] == "hub"
        receiver = ctx.Process(target=_receiver, args=(hub_port, 3, received, False), daemon=True)
        receiver.start()
        for version in range(3):
            got, buckets, named = received.get(timeout=120)
            assert got == version and buckets >= 6
            _assert_bit_exact(named, _expected(version, torch.bfloat16))
    finally:
        for proc in [*ranks, *([receiver] if receiver else [])]:
            if proc.is_alive():
                proc.kill()
            proc.join(10)
