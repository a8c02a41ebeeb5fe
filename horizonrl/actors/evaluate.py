"""Evaluation with the actor's own machinery: the same engine wrapper, the same
token-in/token-out episode loop, no learner and no sockets.

Metrics: ``success_rate`` = successful episodes / episodes that did not fail for
infrastructure reasons; ``mean_reward`` and ``mean_turns`` over the same episodes.
Task ids are the first ``episodes`` ids of ``split`` (deterministic), so before/after
comparisons see the same tasks.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from dataclasses import dataclass, field

from horizonrl.actors.episode import SamplingSettings, run_episode
from horizonrl.config import EngineConfig
from horizonrl.envs import make_env

MAX_CONCURRENT_EPISODES = 64


@dataclass(frozen=True)
class EvalSpec:
    env: str
    env_settings: dict = field(default_factory=dict)
    split: str = "test"
    episodes: int = 100
    max_turns: int = 20
    temperature: float = 1.0
    max_tokens_per_turn: int = 64
    max_context_tokens: int = 2048
    seed: int = 0


def evaluate(model_path: str, spec: EvalSpec, engine_config: EngineConfig | None = None) -> dict:
    """Start an engine on ``model_path``, play the episodes, return the metrics (needs a __main__ guard)."""
    from horizonrl.actors.actor import load_chat_tokenizer
    from horizonrl.actors.engine import RolloutEngine

    engine = RolloutEngine.start(model_path, dtype="float32", engine=engine_config or EngineConfig(),
                                 max_model_len=spec.max_context_tokens, seed=spec.seed)
    try:
        return asyncio.run(evaluate_with(engine, load_chat_tokenizer(model_path), spec))
    finally:
        engine.shutdown()


async def evaluate_with(engine, chat, spec: EvalSpec) -> dict:
    probe = make_env(spec.env, spec.env_settings)
    task_ids = probe.task_ids(spec.split)[: spec.episodes]
    sampling = SamplingSettings(spec.temperature, 1.0, spec.max_tokens_per_turn, spec.max_context_tokens)
    semaphore = asyncio.Semaphore(MAX_CONCURRENT_EPISODES)

    async def play(task_id: int):
        async with semaphore:
            env = make_env(spec.env, spec.env_settings)
            try:
                return task_id, await run_episode(engine, env, chat, task_id, max_turns=spec.max_turns,
                                                  sampling=sampling, weight_version=lambda: 0)
            finally:
                await env.close()

    start = time.perf_counter()
    results = await asyncio.gather(*(play(t) for t in task_ids))
    wall = time.perf_counter() - start
    valid = [(t, ep) for t, ep in results if not ep.failure]
    by_category: dict[str, list[bool]] = defaultdict(list)
    for t, ep in valid:
        by_category[probe.task_category(t)].append(ep.success)
    n = max(1, len(valid))
    return {
        "env": spec.env,
        "split": spec.split,
        "episodes": len(results),
        "infra_failures": len(results) - len(valid),
        "success_rate": sum(ep.success for _, ep in valid) / n,
        "mean_reward": sum(ep.reward for _, ep in valid) / n,
        "mean_turns": sum(ep.num_turns for _, ep in valid) / n,
        "max_turns": spec.max_turns,
        "generated_tokens_per_s": sum(ep.generated_tokens for _, ep in results) / max(wall, 1e-9),
        "wall_s": wall,
        "by_category": {k: sum(v) / len(v) for k, v in sorted(by_category.items())},
    }
