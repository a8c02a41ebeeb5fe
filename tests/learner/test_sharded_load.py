"""Meta-device init + sharded loading (model.build_sharded_model) on 2 gloo ranks.

Rank 1 is given a model directory that holds config.json and nothing else, so it cannot have read
any weights: whatever it ends up with came from rank 0's broadcast. The sharded model must equal the
model loaded whole (every tensor, and its logits), keep its embeddings tied, and a checkpoint that
lacks a weight must fail with one clear error on every rank (not hang the others), and a bf16
checkpoint must load into float32 master weights.
"""

from __future__ import annotations

import json
import shutil
from datetime import timedelta
from pathlib import Path

import pytest

from horizonrl.protocol.transport import free_port

from learner_fixtures import build_tiny_model, run_ranks

pytestmark = pytest.mark.slow


def _load(rank: int, world_size: int, port: int, full_dir: str, config_only_dir: str, broken_dir: str,
          bf16_dir: str, out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    from horizonrl.core.precision import resolve_precision
    from horizonrl.core.runtime import exit_skipping_finalization
    from horizonrl.learner.model import build_sharded_model, gather_full_state_dict

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    try:
        policy = resolve_precision("float32", "float32", "auto", None, learner_on_cuda=False, engine_on_gpu=False,
                                   flash_attn_installed=False)
        cpu = torch.device("cpu")
        # rank 0 reads the real directory; rank 1 a directory without weight files
        model = build_sharded_model(full_dir if rank == 0 else config_only_dir, kind="policy", policy=policy, device=cpu)
        report = {"tied": model.lm_head.weight is model.model.embed_tokens.weight,
                  "sharded": type(model.model.layers[0].mlp.up_proj.weight).__name__}
        input_ids = torch.arange(2, 26).reshape(2, 12)
        with torch.no_grad():
            logits = model(input_ids=input_ids, use_cache=False).logits
        critic = build_sharded_model(full_dir if rank == 0 else config_only_dir, kind="critic", policy=policy, device=cpu)
        critic_state = gather_full_state_dict(critic)
        # a bf16 checkpoint (as Qwen2.5's are) becomes float32 master weights
        from_bf16 = build_sharded_model(bf16_dir if rank == 0 else config_only_dir, kind="policy", policy=policy,
                                        device=cpu)
        report["bf16_checkpoint_param_dtypes"] = sorted({str(p.dtype) for p in from_bf16.parameters()})
        from_bf16_state = gather_full_state_dict(from_bf16)
        try:
            build_sharded_model(broken_dir if rank == 0 else config_only_dir, kind="policy", policy=policy, device=cpu)
            report["broken"] = "loaded"
        except RuntimeError as exc:
            report["broken"] = str(exc)
        state_dict = gather_full_state_dict(model)
        (Path(out_dir) / f"report_{rank}.json").write_text(json.dumps(report))
        if rank == 0:
            save_file({k: v.contiguous() for k, v in state_dict.items()}, str(Path(out_dir) / "sharded.safetensors"))
            save_file({"logits": logits, "value_head": critic_state["value_head.weight"],
                       "critic_embed": critic_state["model.embed_tokens.weight"],
                       "bf16_q_proj": from_bf16_state["model.layers.1.self_attn.q_proj.weight"]},
                      str(Path(out_dir) / "outputs.safetensors"))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_skipping_finalization(0)


def test_rank0_reads_the_sharded_model_equals_the_whole_one(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    from horizonrl.learner.model import load_model

    full_dir = build_tiny_model(tmp_path / "model")
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    shutil.copy2(full_dir / "config.json", config_only / "config.json")
    broken = tmp_path / "broken"
    broken.mkdir()
    shutil.copy2(full_dir / "config.json", broken / "config.json")
    tensors = load_file(str(full_dir / "model.safetensors"))
    tensors.pop("model.norm.weight")
    save_file(tensors, str(broken / "model.safetensors"))
    bf16 = tmp_path / "bf16"
    bf16.mkdir()
    shutil.copy2(full_dir / "config.json", bf16 / "config.json")
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(str(full_dir / "model.safetensors")).items()},
              str(bf16 / "model.safetensors"))

    run_ranks(_load, free_port(), str(full_dir), str(config_only), str(broken), str(bf16), str(tmp_path))

    whole = load_model(str(full_dir), "float32", torch.device("cpu"))
    sharded = load_file(str(tmp_path / "sharded.safetensors"))
    expected = whole.state_dict()
    assert set(sharded) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(sharded[name], tensor), name
    outputs = load_file(str(tmp_path / "outputs.safetensors"))
    with torch.no_grad():
        logits = whole(input_ids=torch.arange(2, 26).reshape(2, 12), use_cache=False).logits
    torch.testing.assert_close(outputs["logits"], logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(outputs["critic_embed"], expected["model.embed_tokens.weight"])
    assert torch.count_nonzero(outputs["value_head"]) == 0  # the critic's head starts at 0, as load_critic's does
    q_proj = expected["model.layers.1.self_attn.q_proj.weight"]
    assert outputs["bf16_q_proj"].dtype == torch.float32
    assert torch.equal(outputs["bf16_q_proj"], q_proj.to(torch.bfloat16).float())
    for rank in range(2):
        report = json.loads((tmp_path / f"report_{rank}.json").read_text())
        assert report["tied"] is True and report["sharded"] == "DTensor"
        assert report["bf16_checkpoint_param_dtypes"] == ["torch.float32"]
        assert "loading" in report["broken"] and "model.norm.weight" in report["broken"], report["broken"]
