"""The synthetic trajectories the transport and buffer-intake benchmarks send: a prompt, then turns of generated
(mask 1, logprob < 0) and observation (mask 0) tokens, built once per size and seeded by it."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from horizonrl.protocol import Trajectory
from horizonrl.protocol.arrays import LOGPROB_DTYPE, MASK_DTYPE, TOKEN_DTYPE

BENCH_RUN_ID = "bench"
PROMPT_TOKENS = 256  # then turns of TURN_TOKENS generated + TURN_TOKENS observation tokens
TURN_TOKENS = 64
VOCAB = 151_000  # a Qwen2.5-sized vocabulary, so ids are not all small ints (pickle would favour them)

_BASE_CACHE: dict[int, Any] = {}


def synthetic_trajectory(num_tokens: int, trajectory_id: str):
    """Prompt, then turns of generated (mask 1, logprob < 0) and observation (mask 0) tokens; seeded by size."""
    if num_tokens not in _BASE_CACHE:
        rng = np.random.default_rng(num_tokens)
        prompt = min(PROMPT_TOKENS, num_tokens // 2)
        mask = np.zeros(num_tokens, dtype=MASK_DTYPE)
        spans = []
        for start in range(prompt, num_tokens, 2 * TURN_TOKENS):
            end = min(start + TURN_TOKENS, num_tokens)
            mask[start:end] = 1
            spans.append((start, end))
        logprobs = np.where(mask == 1, -rng.exponential(0.5, num_tokens), 0.0).astype(LOGPROB_DTYPE)
        _BASE_CACHE[num_tokens] = Trajectory(
            run_id=BENCH_RUN_ID, trajectory_id="", group_id=f"bench-{num_tokens}", group_size=8, env="signpost",
            task_id=7, actor_id=0,
            token_ids=rng.integers(0, VOCAB, num_tokens, dtype=TOKEN_DTYPE).tobytes(), loss_mask=mask.tobytes(),
            logprobs=logprobs.tobytes(), prompt_length=prompt, turn_spans=spans,
            turn_versions=[i // 4 for i in range(len(spans))], turn_epochs=[0] * len(spans),
            turn_rewards=[0.0] * len(spans), reward=1.0,
            success=True, score=1.0, num_turns=len(spans), max_turns=len(spans), stop_reason="done",
            timings={"generate_s": 1.5, "env_s": 0.25})
    return msgspec.structs.replace(_BASE_CACHE[num_tokens], trajectory_id=trajectory_id)
