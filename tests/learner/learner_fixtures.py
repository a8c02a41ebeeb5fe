"""A tiny random Qwen2 model with a word-level tokenizer, hand-made trajectories, and learner ranks as
processes (test helpers)."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import numpy as np

from horizonrl.protocol import Trajectory
from horizonrl.protocol.arrays import LOGPROB_DTYPE, MASK_DTYPE, TOKEN_DTYPE, pack

VOCAB = 300


def build_tiny_model(path: Path, seed: int = 0) -> Path:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        dtype="float32",
    )
    Qwen2ForCausalLM(config).save_pretrained(path)
    words = ["<pad>", "<eot>"] + [f"w{i}" for i in range(VOCAB - 2)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eot>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} <eot> {% endfor %}"
    fast.save_pretrained(path)
    return path


def trajectory(rng: np.random.Generator, group: str, index: int, reward: float, length: int, failure: str = "") -> Trajectory:
    """A prompt of 4 tokens, then alternating generated (mask 1) and observation (mask 0) runs."""
    tokens = rng.integers(2, VOCAB, size=length)
    mask = np.zeros(length, dtype=np.uint8)
    spans = []
    start = 4
    while start < length:
        end = min(start + 3, length)
        mask[start:end] = 1
        spans.append((start, end))
        start = end + 2
    logprobs = np.where(mask == 1, rng.normal(-5.7, 0.3, size=length), 0.0)
    return Trajectory(
        run_id="test-run",
        trajectory_id=f"{group}-{index}",
        group_id=group,
        group_size=4,
        env="fake",
        task_id=0,
        actor_id=0,
        token_ids=pack(tokens, TOKEN_DTYPE),
        loss_mask=pack(mask, MASK_DTYPE),
        logprobs=pack(logprobs, LOGPROB_DTYPE),
        prompt_length=4,
        turn_spans=spans,
        turn_versions=[0] * len(spans),
        turn_epochs=[0] * len(spans),
        turn_rewards=[0.0] * (len(spans) - 1) + [reward],
        reward=reward,
        success=reward > 0,
        score=reward,
        num_turns=len(spans),
        max_turns=8,
        stop_reason="done",
        failure=failure,
    )


def groups(seed: int = 0) -> list[list[Trajectory]]:
    """Two groups of four with different lengths, one failed trajectory (never trained on)."""
    rng = np.random.default_rng(seed)
    first = [trajectory(rng, "g0", i, r, n) for i, (r, n) in enumerate([(1.0, 20), (0.0, 13), (0.0, 17), (1.0, 9)])]
    second = [trajectory(rng, "g1", i, r, n) for i, (r, n) in enumerate([(0.5, 11), (0.0, 25), (1.0, 8)])]
    second.append(trajectory(rng, "g1", 3, 0.0, 15, failure="environment"))
    return [first, second]


def run_ranks(target, *args, world: int = 2, timeout_s: float = 180) -> None:
    """``target(rank, world, *args)`` in ``world`` spawned processes; every one must exit 0 within
    ``timeout_s`` (those still alive then are killed, by pid, before the assertion fails)."""
    ctx = mp.get_context("spawn")
    processes = [ctx.Process(target=target, args=(rank, world, *args)) for rank in range(world)]
    for process in processes:
        process.start()
    try:
        for process in processes:
            process.join(timeout_s)
        assert [process.exitcode for process in processes] == [0] * world
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join(10)
