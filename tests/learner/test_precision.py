"""The dtype policy (core/precision.py) and what it does to a real FSDP2 step.

The step test runs two gloo ranks with float32 master weights and bfloat16 compute and checks the
three things the policy exists for: the forward ran in bfloat16, the parameters and AdamW's moments
stayed float32, and an lr-1e-6 update of weights of size ~1 survived — the same update applied to a
bfloat16 parameter rounds to nothing (checked on the same numbers). Dropping the MixedPrecisionPolicy
fails the first check; building the model in bfloat16 fails the second and third.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest

from horizonrl.core.precision import learner_attention, resolve_engine_dtype, resolve_precision
from horizonrl.protocol.transport import free_port

from learner_fixtures import build_tiny_model, groups, run_ranks

TINY_LR = 1e-6


def _policy(**overrides):
    args = dict(param_dtype="float32", compute_dtype="auto", engine_dtype="auto", legacy_model_dtype=None,
                learner_on_cuda=False, engine_on_gpu=False, flash_attn_installed=False)
    args.update(overrides)
    return resolve_precision(args.pop("param_dtype"), args.pop("compute_dtype"), args.pop("engine_dtype"),
                             args.pop("legacy_model_dtype"), **args)


def test_auto_is_bf16_compute_on_cuda_and_fp32_on_cpu():
    gpu = _policy(learner_on_cuda=True, engine_on_gpu=True)
    assert (gpu.param_dtype, gpu.compute_dtype, gpu.reduce_dtype, gpu.engine_dtype) == (
        "float32", "bfloat16", "float32", "bfloat16")
    assert gpu.mixed
    cpu = _policy()
    assert (cpu.param_dtype, cpu.compute_dtype, cpu.engine_dtype) == ("float32", "float32", "float32")
    assert not cpu.mixed


def test_flash_attention_only_with_a_dtype_it_supports():
    assert learner_attention("bfloat16", learner_on_cuda=True, flash_attn_installed=True) == "flash_attention_2"
    assert learner_attention("float16", learner_on_cuda=True, flash_attn_installed=True) == "flash_attention_2"
    assert learner_attention("float32", learner_on_cuda=True, flash_attn_installed=True) == "sdpa"
    assert learner_attention("bfloat16", learner_on_cuda=True, flash_attn_installed=False) == "sdpa"
    assert learner_attention("bfloat16", learner_on_cuda=False, flash_attn_installed=True) == "sdpa"
    assert _policy(compute_dtype="float32", learner_on_cuda=True, flash_attn_installed=True).attention == "sdpa"


def test_the_legacy_model_dtype_is_the_engine_default_only():
    assert resolve_engine_dtype("auto", "float32", engine_on_gpu=True) == "float32"  # old configs keep their engine
    assert resolve_engine_dtype("auto", "auto", engine_on_gpu=True) == "bfloat16"  # model.dtype's default: unset
    assert resolve_engine_dtype("auto", None, engine_on_gpu=False) == "float32"
    assert resolve_engine_dtype("bfloat16", None, engine_on_gpu=False) == "bfloat16"
    assert resolve_engine_dtype("bfloat16", "bfloat16", engine_on_gpu=False) == "bfloat16"
    with pytest.raises(ValueError, match="disagree"):
        resolve_engine_dtype("bfloat16", "float32", engine_on_gpu=True)
    # the learner keeps fp32 master weights whatever model.dtype says
    assert _policy(legacy_model_dtype="bfloat16", learner_on_cuda=True).param_dtype == "float32"


def test_bf16_master_weights_under_fp32_compute_are_refused():
    with pytest.raises(ValueError, match="param_dtype"):
        _policy(param_dtype="bfloat16", compute_dtype="float32")


def test_the_config_names_reach_the_policy():
    from horizonrl.core.config import load_config
    from horizonrl.core.precision import precision_from_config

    config = load_config(None, ["model.path=/nowhere", "envs=[{name: signpost}]", "learner.compute_dtype=float16", "rollout.engine.dtype=bfloat16"])
    policy = precision_from_config(config, learner_on_cuda=True, engine_on_gpu=True, flash_attn_installed=False)
    assert (policy.compute_dtype, policy.engine_dtype) == ("float16", "bfloat16")


def _mixed_step(rank: int, world_size: int, port: int, model_dir: str, out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    from horizonrl.core.runtime import exit_skipping_finalization
    from horizonrl.learner.batching import samples_from_batch
    from horizonrl.learner.model import build_sharded_model, gather_full_state_dict
    from horizonrl.learner.algorithm import LossSettings, UpdateSettings, train_on_batch
    from horizonrl.protocol import Batch

    torch.manual_seed(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    try:
        policy = resolve_precision("float32", "bfloat16", "auto", None, learner_on_cuda=False, engine_on_gpu=False,
                                   flash_attn_installed=False)
        model = build_sharded_model(model_dir, kind="policy", policy=policy, device=torch.device("cpu"))
        seen = {}

        def record(module, args):
            seen["weight"] = str(module.weight.dtype)
            seen["input"] = str(args[0].dtype)

        model.model.layers[0].mlp.down_proj.register_forward_pre_hook(record)
        optimizer = torch.optim.AdamW(model.parameters(), lr=TINY_LR, weight_decay=0.0)
        samples, _ = samples_from_batch(Batch(run_id="test-run", request_id=1, groups=groups()), True, "grpo")
        train_on_batch(model, optimizer, samples, rank=rank, world_size=world_size, settings=LossSettings(),
                       update=UpdateSettings(micro_batch_size=4), device=torch.device("cpu"))
        moments = [value for state in optimizer.state.values() for key, value in state.items()
                   if key in ("exp_avg", "exp_avg_sq")]
        report = {
            "compute": seen,
            "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
            "moment_dtypes": sorted({str(m.dtype) for m in moments}),
            "moments": len(moments),
        }
        state_dict = gather_full_state_dict(model)
        if rank == 0:
            save_file({k: v.contiguous() for k, v in state_dict.items()}, str(Path(out_dir) / "after.safetensors"))
            (Path(out_dir) / "report.json").write_text(json.dumps(report))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_skipping_finalization(0)


@pytest.mark.slow
def test_fsdp2_bf16_compute_keeps_fp32_masters_and_tiny_updates(tmp_path):
    import torch
    from safetensors.torch import load_file

    model_dir = build_tiny_model(tmp_path / "model")
    run_ranks(_mixed_step, free_port(), str(model_dir), str(tmp_path))
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["compute"] == {"weight": "torch.bfloat16", "input": "torch.bfloat16"}  # the policy was applied
    assert report["param_dtypes"] == ["torch.float32"]
    assert report["moments"] > 0 and report["moment_dtypes"] == ["torch.float32"]

    before = load_file(str(model_dir / "model.safetensors"))
    after = load_file(str(tmp_path / "after.safetensors"))
    # RMSNorm weights start at exactly 1.0: bf16's spacing there is 2^-7, so an update of ~1e-6 is
    # 4 orders of magnitude below what a bf16 weight can represent.
    norms = [name for name in before if name.endswith("norm.weight")]
    assert norms
    for name in norms:
        delta = after[name] - before[name]
        assert float(delta.abs().max()) < 10 * TINY_LR
        changed = (delta != 0).float().mean()
        assert changed > 0.9, f"{name}: only {changed:.0%} of the fp32 master weights moved"
        as_bf16 = (before[name].to(torch.bfloat16) + delta.to(torch.bfloat16)).float()
        assert torch.equal(as_bf16, before[name].to(torch.bfloat16).float()), "bf16 would have kept this update"
