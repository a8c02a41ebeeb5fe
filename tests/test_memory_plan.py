"""Memory defaults that follow the model and the machine (core/memory_plan.py, launcher/resolve.py
resolve_memory_defaults): each term against a hand computation, the choices as memory shrinks, and the launcher
writing them into the resolved config only where the user left "auto"."""

from __future__ import annotations

import json

import pytest

from horizonrl.core.config import load_config
from horizonrl.core.memory_plan import (GIB, KV_HEADROOM, RunShape, kv_cache_gib, learner_bytes_per_token,
                                        learner_fixed_bytes, lora_params, mem_available_bytes, plan_memory)
from horizonrl.core.model_shape import ModelShape
from horizonrl.launcher.resolve import resolve_memory_defaults

# SmolLM2-135M-Instruct's config.json (the keys the shape reads)
SMOLLM2 = {"model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
           "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
           "tie_word_embeddings": True, "attention_bias": False}
SHAPE = ModelShape.from_hf_config(SMOLLM2)


def demo_run(**changes) -> RunShape:
    """configs/smollm2_babyai.yaml: one actor, 2 groups of 8 in flight, 1,024-token contexts, 4 groups a step."""
    fields = dict(num_actors=1, learner_ranks=1, sequences_per_engine=16, context_tokens=1024,
                  step_tokens_per_rank=4 * 8 * 1024, engine_dtype_bytes=2, compute_bytes=2, trained_params=SHAPE.params)
    return RunShape(**{**fields, **changes})


def test_the_shape_of_a_hugging_face_config():
    assert SHAPE.params == 134_515_008  # what transformers counts for SmolLM2-135M (docs/learning.md)
    assert (SHAPE.kv_heads, SHAPE.head_dim, SHAPE.tied, SHAPE.qkv_bias) == (3, 64, True, False)
    assert SHAPE.kv_bytes_per_token(2) == 2 * 30 * 3 * 64 * 2
    no_head_dim = ModelShape.from_hf_config({**SMOLLM2, "head_dim": None, "num_key_value_heads": None})
    assert (no_head_dim.head_dim, no_head_dim.kv_heads) == (64, 9)  # hidden / heads; heads when not grouped


def test_lora_parameters_are_r_times_in_plus_out_per_adapted_layer():
    # measured: rank 16 on the 7 linear layers of each of SmolLM2's 30 layers (tests/integration/test_smollm2.py)
    assert lora_params(SHAPE, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]) \
        == 4_884_480
    assert lora_params(SHAPE, 4, ["q_proj"]) == 30 * 4 * (576 + 576)


def test_kv_cache_fits_the_concurrent_contexts_with_headroom():
    need = 16 * 1024 * 23_040 * KV_HEADROOM / GIB  # 0.44 GiB
    assert kv_cache_gib(SHAPE, dtype_bytes=2, sequences=16, context_tokens=1024) == 0.5 > need
    assert kv_cache_gib(SHAPE, dtype_bytes=2, sequences=64, context_tokens=1024) == 2.0  # 1.76 rounded up
    assert kv_cache_gib(SHAPE, dtype_bytes=2, sequences=1, context_tokens=64) == 0.25  # the floor


def test_learner_terms():
    # fp32 masters + grads + AdamW (16 B) of every weight, and the bf16 root and two layers FSDP2 gathers
    full = learner_fixed_bytes(SHAPE, world_size=1, trained_params=SHAPE.params, compute_bytes=2)
    assert full == 16 * SHAPE.params + 2 * (SHAPE.root_params + 2 * SHAPE.layer_params)
    lora = learner_fixed_bytes(SHAPE, world_size=1, trained_params=4_884_480, compute_bytes=2)
    assert lora == pytest.approx(full - 12 * (SHAPE.params - 4_884_480))  # frozen weights: fp32 weight only
    assert learner_fixed_bytes(SHAPE, world_size=2, trained_params=SHAPE.params, compute_bytes=4) == 8 * SHAPE.params
    off = learner_bytes_per_token(SHAPE, checkpointing=False, compute_bytes=2)
    on = learner_bytes_per_token(SHAPE, checkpointing=True, compute_bytes=2)
    assert on < off / 2
    assert learner_bytes_per_token(SHAPE, checkpointing=False, compute_bytes=4) > off  # fp32 activations


def test_the_plan_trades_checkpointing_and_micro_batch_size_for_memory():
    roomy = plan_memory(SHAPE, demo_run(), 64 * GIB)
    assert not roomy.activation_checkpointing and roomy.max_tokens_per_micro_batch == 4 * 8 * 1024  # the whole step
    assert roomy.fits and roomy.kv_cache_gib == 0.5
    tighter = plan_memory(SHAPE, demo_run(), 12 * GIB)  # smaller micro-batches before checkpointing
    assert not tighter.activation_checkpointing and 2 * 1024 <= tighter.max_tokens_per_micro_batch < 8 * 1024
    tight = plan_memory(SHAPE, demo_run(), 10 * GIB)
    assert tight.activation_checkpointing and tight.max_tokens_per_micro_batch > tighter.max_tokens_per_micro_batch
    too_small = plan_memory(SHAPE, demo_run(), 8 * GIB)
    assert not too_small.fits and too_small.max_tokens_per_micro_batch == 1024  # at least one context, and a warning
    two_actors = plan_memory(SHAPE, demo_run(num_actors=2), 12 * GIB)
    assert two_actors.learner_budget_gib < tighter.learner_budget_gib
    with_lora = plan_memory(SHAPE, demo_run(trained_params=4_884_480), 10 * GIB)
    assert not with_lora.activation_checkpointing  # AdamW over the adapters only leaves room
    small_step = plan_memory(SHAPE, demo_run(step_tokens_per_rank=3000), 24 * GIB)
    assert small_step.max_tokens_per_micro_batch == 3000  # no micro-batch needs more than the step


def test_mem_available():
    text = "MemTotal:       24683772 kB\nMemFree:         1000 kB\nMemAvailable:   13502772 kB\n"
    assert mem_available_bytes(text) == 13502772 * 1024
    assert mem_available_bytes("MemFree: 10 kB\n") == 10240
    with pytest.raises(ValueError):
        mem_available_bytes("nothing here")


def test_the_launcher_fixes_what_was_left_auto(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2))
    meminfo = f"MemAvailable: {12 * GIB // 1024} kB\n"
    base = [f"model.path={tmp_path}", "envs=[{name: babyai}]", "rollout.num_actors=1", "rollout.n=8",
            "rollout.groups_in_flight=2", "rollout.max_context_tokens=1024", "learner.groups_per_step=4",
            "learner.compute_dtype=bfloat16", "rollout.engine.dtype=bfloat16"]
    config = load_config(None, base)
    assert config.learner.activation_checkpointing == "auto" and config.rollout.engine.kv_cache_gib == "auto"
    resolved = resolve_memory_defaults(config, gpus=0, meminfo=meminfo)
    plan = plan_memory(SHAPE, demo_run(), 12 * GIB)
    assert resolved.learner.activation_checkpointing is plan.activation_checkpointing
    assert resolved.learner.max_tokens_per_micro_batch == plan.max_tokens_per_micro_batch
    assert resolved.rollout.engine.kv_cache_gib == plan.kv_cache_gib == 0.5
    explicit = load_config(None, base + ["learner.activation_checkpointing=true", "rollout.engine.kv_cache_gib=2"])
    kept = resolve_memory_defaults(explicit, gpus=0, meminfo=meminfo)
    assert kept.learner.activation_checkpointing is True and kept.rollout.engine.kv_cache_gib == 2
    assert kept.learner.max_tokens_per_micro_batch == resolved.learner.max_tokens_per_micro_batch
    assert resolve_memory_defaults(config, gpus=1, meminfo=meminfo) == config  # GPUs: auto stays
    # auto read by a process nobody resolved it for (a learner or engine started by hand): the earlier defaults
    assert (config.learner.checkpointing, config.learner.micro_batch_token_cap,
            config.rollout.engine.kv_cache_gib_or_default) == (False, None, 1.0)
