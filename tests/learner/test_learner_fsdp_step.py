"""One optimizer step on W=2 FSDP2 ranks (gloo) equals the same step on W=1."""

from __future__ import annotations

import json
import multiprocessing as mp
from datetime import timedelta
from pathlib import Path

import pytest

from horizonrl.protocol import Batch
from horizonrl.protocol.transport import free_port

from learner_fixtures import build_tiny_model, groups

pytestmark = pytest.mark.slow

MICRO_BATCH_SIZE = 3  # 7 trainable trajectories: W=1 runs 3 micro-batches; W=2 shares 4 + 3, so one rank pads with an empty one


def _one_step(rank: int, world_size: int, port: int, model_dir: str, out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    from horizonrl.learner.batching import micro_batches_for_rank, samples_from_batch
    from horizonrl.learner.model import gather_full_state_dict, load_model, shard_model, weights_to_send
    from horizonrl.learner.train_step import optimizer_step

    torch.manual_seed(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    try:
        model = shard_model(load_model(model_dir, "float32", torch.device("cpu")), "cpu")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        samples, failed = samples_from_batch(Batch(request_id=1, groups=groups()), norm_adv_by_std=True)
        assert failed == 1 and len(samples) == 7
        micro_batches = micro_batches_for_rank(samples, rank, world_size, MICRO_BATCH_SIZE)
        metrics = optimizer_step(
            model, optimizer, micro_batches, temperature=0.8, clip_ratio=0.2, grad_clip=1.0,
            num_loss_tokens=sum(s.num_loss_tokens for s in samples), device=torch.device("cpu"),
        )
        state_dict = gather_full_state_dict(model)
        if rank == 0:
            save_file({k: v.contiguous() for k, v in weights_to_send(model.config, state_dict)}, str(Path(out_dir) / "weights.safetensors"))
            (Path(out_dir) / "metrics.json").write_text(json.dumps({**metrics, "micro_batches": len(micro_batches)}))
    finally:
        dist.destroy_process_group()


def _run(world_size: int, model_dir: Path, out_dir: Path) -> dict:
    out_dir.mkdir()
    ctx = mp.get_context("spawn")
    port = free_port()
    processes = [ctx.Process(target=_one_step, args=(rank, world_size, port, str(model_dir), str(out_dir))) for rank in range(world_size)]
    for process in processes:
        process.start()
    try:
        for process in processes:
            process.join(120)
        assert all(process.exitcode == 0 for process in processes), [process.exitcode for process in processes]
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join(10)
    from safetensors.torch import load_file

    return {"weights": load_file(str(out_dir / "weights.safetensors")), "metrics": json.loads((out_dir / "metrics.json").read_text())}


def test_two_ranks_equal_one(tmp_path):
    import torch
    from safetensors.torch import load_file

    model_dir = build_tiny_model(tmp_path / "model")
    one = _run(1, model_dir, tmp_path / "w1")
    two = _run(2, model_dir, tmp_path / "w2")
    assert one["metrics"].pop("micro_batches") == 3 and two["metrics"].pop("micro_batches") == 2

    initial = load_file(str(model_dir / "model.safetensors"))
    assert set(one["weights"]) >= set(initial)
    for name, before in initial.items():
        assert not torch.equal(one["weights"][name], before), f"{name} did not change"
        torch.testing.assert_close(two["weights"][name], one["weights"][name], atol=1e-5, rtol=0, msg=name)
    for key, value in one["metrics"].items():
        assert two["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
