"""A LoRA learner step under FSDP2 (learner.lora; build_trainables, train_on_batch, the training-state checkpoint):
on W=2 gloo ranks it equals the step on W=1, it moves the adapters and nothing else, its training state saves and
restores exactly, and the merged export computes what the adapted model does.

Why the comparison holds to float32 rounding: see tests/learner/test_learner_fsdp_step.py (the same argument, SGD so
that the update is linear in the gradient). Each rank builds the model as the learner does: meta device, adapters
added, rank 0 reads the checkpoint and gives the adapters their seeded first values, FSDP2 shards both.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest

from horizonrl.protocol import Batch
from horizonrl.protocol.transport import free_port

from learner_fixtures import build_tiny_model, groups, run_ranks

pytestmark = pytest.mark.slow

SGD_LR = 0.5


def _step(rank: int, world_size: int, port: int, model_dir: str, out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    from horizonrl.core.config import load_config
    from horizonrl.core.runtime import exit_skipping_finalization
    from horizonrl.learner.batching import samples_from_batch
    from horizonrl.learner.checkpoint import TrainState, load_train_state, save_train_state
    from horizonrl.learner.lora import LoraSettings, merged_state_dict
    from horizonrl.learner.main import build_trainables
    from horizonrl.learner.model import gather_full_state_dict
    from horizonrl.learner.policy_loss import ClipSettings
    from horizonrl.learner.algorithm import LossSettings, UpdateSettings, train_on_batch

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    try:
        config = load_config(None, [f"model.path={model_dir}", "envs=[{name: signpost}]", "learner.lora.rank=4",
                                    "learner.lora.alpha=8", "learner.lora.target_modules=[q_proj,v_proj,up_proj]"])
        cpu = torch.device("cpu")
        tr = build_trainables(config, cpu)
        # copies: on one CPU rank the gathered tensors are the parameters themselves, which the step updates in place
        initial = {name: tensor.clone() for name, tensor in gather_full_state_dict(tr.model).items()}
        trained = [name for name, p in tr.model.named_parameters() if p.requires_grad]
        optimized = [p for group in tr.optimizer.param_groups for p in group["params"]]
        sgd = torch.optim.SGD([p for p in tr.model.parameters() if p.requires_grad], lr=SGD_LR)
        samples, _ = samples_from_batch(Batch(run_id="test-run", request_id=1, groups=groups()), True)
        metrics = train_on_batch(tr.model, sgd, samples, rank=rank, world_size=world_size,
                                 settings=LossSettings(temperature=0.8, clip=ClipSettings(0.2, 0.2)),
                                 update=UpdateSettings(micro_batch_size=3, grad_clip=1.0), device=cpu)
        after = {name: tensor.clone() for name, tensor in gather_full_state_dict(tr.model).items()}
        grads = {name: p.grad.full_tensor() for name, p in tr.model.named_parameters() if p.grad is not None}
        # the training state: one AdamW step (moments for the adapters), saved, then restored into a fresh model
        train_on_batch(tr.model, tr.optimizer, samples, rank=rank, world_size=world_size,
                       settings=LossSettings(temperature=0.8), update=UpdateSettings(micro_batch_size=3), device=cpu)
        saved = {name: tensor.clone() for name, tensor in gather_full_state_dict(tr.model).items()}
        checkpoint = Path(out_dir) / "state"
        save_train_state(checkpoint, model=tr.model, optimizer=tr.optimizer, scheduler=tr.scheduler, state=TrainState(step=2))
        fresh = build_trainables(config, cpu)
        load_train_state(checkpoint, model=fresh.model, optimizer=fresh.optimizer, scheduler=fresh.scheduler)
        restored = gather_full_state_dict(fresh.model)
        moments = {name: sorted(state) for name, state in fresh.optimizer.state_dict()["state"].items()}
        if rank == 0:
            report = {"trained": trained, "optimized": len(optimized), "metrics": metrics,
                      "restored_exact": all(torch.equal(restored[k], v) for k, v in saved.items()),
                      "restored_moments": len(moments), "moment_keys": sorted({k for v in moments.values() for k in v})}
            (Path(out_dir) / "report.json").write_text(json.dumps(report))
            for name, state in (("initial", initial), ("after", after)):  # lm_head.weight is the tied embedding
                save_file({k: v.contiguous() for k, v in state.items() if k != "lm_head.weight"},
                          str(Path(out_dir) / f"{name}.safetensors"))
            save_file({k: v.contiguous() for k, v in grads.items()}, str(Path(out_dir) / "grads.safetensors"))
            merged = merged_state_dict(after, LoraSettings.from_config(config))
            save_file({k: v.contiguous() for k, v in merged.items() if k != "lm_head.weight"},
                      str(Path(out_dir) / "merged.safetensors"))
            ids = torch.arange(2, 26).reshape(2, 12)
            with torch.no_grad():
                tr.model.eval()
                save_file({"logits": tr.model(input_ids=ids, use_cache=False).logits.contiguous()},
                          str(Path(out_dir) / "adapted_logits.safetensors"))
        else:
            with torch.no_grad():  # rank 0's forward above is a collective under FSDP2
                tr.model.eval()
                tr.model(input_ids=torch.arange(2, 26).reshape(2, 12), use_cache=False)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_skipping_finalization(0)


def _run(world: int, model_dir: Path, out_dir: Path) -> dict:
    from safetensors.torch import load_file

    out_dir.mkdir()
    run_ranks(_step, free_port(), str(model_dir), str(out_dir), world=world)
    return {"report": json.loads((out_dir / "report.json").read_text()),
            **{name: load_file(str(out_dir / f"{name}.safetensors"))
               for name in ("initial", "after", "grads", "merged", "adapted_logits")}}


def test_a_lora_step_on_two_ranks_equals_one_and_moves_only_the_adapters(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model(tmp_path / "model")
    one, two = _run(1, model_dir, tmp_path / "w1"), _run(2, model_dir, tmp_path / "w2")
    report = one["report"]
    adapters = {f"model.layers.{i}.{m}.{f}.weight" for i in range(2)
                for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.up_proj") for f in ("lora_A", "lora_B")}
    assert set(report["trained"]) == adapters and report["optimized"] == len(adapters)  # AdamW holds them alone
    assert set(one["grads"]) == adapters  # no gradient for a frozen weight
    for run in (one, two):
        for name, before in run["initial"].items():
            moved = not torch.equal(run["after"][name], before)
            # B starts at 0 (ΔW = 0), so the first step's gradient reaches B alone: ∂L/∂A = s·Bᵀ(∂L/∂h)xᵀ = 0
            assert moved == (name in adapters and "lora_B" in name), f"{name} moved: {moved}"
        assert all(not run["initial"][n].any() for n in adapters if "lora_B" in n)
        assert all(run["initial"][n].abs().max() > 0 for n in adapters if "lora_A" in n)
    # both ranks built the same first adapters (rank 0's, broadcast), and made the same update
    for name in adapters:
        torch.testing.assert_close(two["initial"][name], one["initial"][name], rtol=0, atol=0)
        update_one = one["after"][name] - one["initial"][name]
        update_two = two["after"][name] - two["initial"][name]
        scale = float(update_one.abs().max())
        torch.testing.assert_close(update_two, update_one, rtol=0, atol=1e-4 * scale + 1e-7, msg=name)
    for key, value in report["metrics"].items():
        assert two["report"]["metrics"][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    # the training state restores exactly, AdamW's moments of the adapters with it
    assert report["restored_exact"] and two["report"]["restored_exact"]
    assert report["restored_moments"] == len(adapters) and {"exp_avg", "exp_avg_sq"} <= set(report["moment_keys"])
    # the merged export is a plain model computing what the adapted one computes
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    plain.load_state_dict(one["merged"], strict=False)
    plain.tie_weights()
    with torch.no_grad():
        logits = plain(torch.arange(2, 26).reshape(2, 12)).logits
    torch.testing.assert_close(logits, one["adapted_logits"]["logits"], rtol=1e-4, atol=1e-4)
