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


def _one_step(rank: int, world_size: int, port: int, model_dir: str, out_dir: str, variant: str) -> None:
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    from horizonrl.learner.batching import micro_batches_for_rank, samples_from_batch
    from horizonrl.learner.model import gather_full_state_dict, load_critic, load_model, load_reference, shard_model, weights_to_send
    from horizonrl.learner.policy_loss import ClipSettings
    from horizonrl.learner.train_step import AdvantageSettings, LossSettings, optimizer_step

    torch.manual_seed(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    try:
        model = shard_model(load_model(model_dir, "float32", torch.device("cpu")), "cpu")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        cpu = torch.device("cpu")
        estimator, extra = "grpo", {}
        settings = LossSettings(temperature=0.8, clip=ClipSettings(0.2, 0.2))
        if variant == "gae_kl_entropy":
            # the critic, the frozen reference, asymmetric clip, entropy bonus, seq-mean: all under FSDP
            estimator = "gae"
            critic = shard_model(load_critic(model_dir, "float32", cpu), "cpu")
            extra = dict(
                advantage=AdvantageSettings("gae", gamma=0.95, lam=0.9),
                reference=shard_model(load_reference(model_dir, "float32", cpu), "cpu"),
                critic=critic, critic_optimizer=torch.optim.AdamW(critic.parameters(), lr=1e-3),
            )
            settings = LossSettings(temperature=0.8, clip=ClipSettings(0.1, 0.3), loss_agg_mode="seq-mean-token-mean",
                                    entropy_coeff=0.01, kl_loss_coef=0.1, kl_loss_type="low_var_kl")
        elif variant == "reinforce_plus_plus":
            estimator, extra = variant, dict(advantage=AdvantageSettings(variant, gamma=0.99))
        samples, failed = samples_from_batch(Batch(request_id=1, groups=groups()), True, estimator)
        assert failed == 1 and len(samples) == 7
        micro_batches = micro_batches_for_rank(samples, rank, world_size, MICRO_BATCH_SIZE)
        metrics = optimizer_step(
            model, optimizer, micro_batches, settings=settings, grad_clip=1.0,
            num_loss_tokens=sum(s.num_loss_tokens for s in samples), num_sequences=len(samples), device=cpu, **extra,
        )
        if variant == "gae_kl_entropy":  # a second step: the critic has learned, the KL is no longer 0
            metrics = optimizer_step(
                model, optimizer, micro_batches_for_rank(samples, rank, world_size, MICRO_BATCH_SIZE), settings=settings,
                grad_clip=1.0, num_loss_tokens=sum(s.num_loss_tokens for s in samples), num_sequences=len(samples),
                device=cpu, **extra,
            )
        state_dict = gather_full_state_dict(model)
        if rank == 0:
            save_file({k: v.contiguous() for k, v in weights_to_send(model.config, state_dict)}, str(Path(out_dir) / "weights.safetensors"))
            (Path(out_dir) / "metrics.json").write_text(json.dumps({**metrics, "micro_batches": len(micro_batches)}))
        # Tear down together: one run saw rank 1 abort at exit ("terminate called without an active
        # exception") after it destroyed the group while rank 0 was still writing its files.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _run(world_size: int, model_dir: Path, out_dir: Path, variant: str = "grpo") -> dict:
    out_dir.mkdir()
    ctx = mp.get_context("spawn")
    port = free_port()
    processes = [ctx.Process(target=_one_step, args=(rank, world_size, port, str(model_dir), str(out_dir), variant)) for rank in range(world_size)]
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


@pytest.mark.parametrize("variant", ["grpo", "reinforce_plus_plus", "gae_kl_entropy"])
def test_two_ranks_equal_one(tmp_path, variant):
    import torch
    from safetensors.torch import load_file

    model_dir = build_tiny_model(tmp_path / "model")
    one = _run(1, model_dir, tmp_path / "w1", variant)
    two = _run(2, model_dir, tmp_path / "w2", variant)
    assert one["metrics"].pop("micro_batches") == 3 and two["metrics"].pop("micro_batches") == 2
    if variant == "gae_kl_entropy":
        assert one["metrics"]["loss/kl_ref"] > 0 and "loss/value" in one["metrics"]
        assert one["metrics"]["grad/critic_norm"] > 0

    initial = load_file(str(model_dir / "model.safetensors"))
    assert set(one["weights"]) >= set(initial)
    for name, before in initial.items():
        assert not torch.equal(one["weights"][name], before), f"{name} did not change"
        torch.testing.assert_close(two["weights"][name], one["weights"][name], atol=1e-5, rtol=0, msg=name)
    for key, value in one["metrics"].items():
        assert two["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
