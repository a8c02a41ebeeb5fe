"""Evaluation with the actor's own machinery: the same engine wrapper, the same
token-in/token-out episode loop, no learner and no sockets.

Metrics (definitions in docs/evaluation.md): ``success_rate`` = successful episodes / episodes
that did not fail for infrastructure reasons; ``mean_score`` (the environment's own scale),
``mean_reward`` and ``mean_turns`` over the same episodes; ``pass@k`` = the unbiased estimator of
Chen et al. 2021 from ``samples`` episodes per task, averaged over tasks; all of them also per
category (BabyAI level, TextCraft depth, SciWorld task type, SearchQA hops).
Task ids are the given ``task_ids``, else the first ``episodes`` ids of ``split``
(deterministic), so before/after comparisons see the same tasks.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Callable

from horizonrl.actors.context import ContextPolicy
from horizonrl.actors.episode import SamplingSettings, run_episode
from horizonrl.actors.episode_messages import to_trajectory
from horizonrl.core.chat import load_chat_tokenizer
from horizonrl.core.config import EngineConfig
from horizonrl.core.environment import EnvFactory
from horizonrl.core.schedule import TurnBudgetSchedule
from horizonrl.protocol import STOP_CONTEXT

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
    task_ids: tuple[int, ...] | None = None  # overrides split/episodes
    k: int = 1  # pass@k is reported for k = 1 and this k
    samples: int | None = None  # episodes per task (n >= k); default k
    system_prompt: str | None = None  # as in training (rollout.system_prompt)
    turn_timeout_s: float | None = None  # a generation taking longer ends the episode as a timeout failure
    episode_timeout_s: float | None = None
    context: ContextPolicy = ContextPolicy()  # as in training (rollout.context): what happens past the context

    @classmethod
    def for_run(cls, config, env, *, episodes: int, **more) -> "EvalSpec":
        """Held-out tasks of one of the run's environments (``config.envs``), sampled as in training: its system
        prompt, token limits, context policy and timeouts, at ``eval.temperature`` and ``eval.max_turns``
        (default: the schedule's last budget)."""
        r = config.rollout
        max_turns = (config.eval.max_turns
                     or TurnBudgetSchedule.from_config(config.algorithm.rounds_ctrl).final_max_turns)
        return cls(env=env.name, env_settings=dict(env.settings), split="test", episodes=episodes,
                   max_turns=max_turns, temperature=config.eval.temperature, max_tokens_per_turn=r.max_tokens_per_turn,
                   max_context_tokens=r.max_context_tokens, seed=config.run.seed, system_prompt=r.system_prompt,
                   turn_timeout_s=r.turn_timeout_s, episode_timeout_s=r.episode_timeout_s,
                   context=ContextPolicy.from_config(r.context), **more)

    @property
    def samples_per_task(self) -> int:
        return max(self.k, self.samples or self.k)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c succeed (Chen et al. 2021, arXiv 2107.03374, eq. 1):

        pass@k = 1 − C(n − c, k) / C(n, k) = 1 − Π_{i = n−c+1}^{n} (1 − k / i)    (their numerically stable form)
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def evaluate(model_path: str, spec: EvalSpec, make_env: EnvFactory, engine_config: EngineConfig | None = None,
             record_dir: str | None = None) -> dict:
    """Start an engine on ``model_path``, play the episodes, return the metrics (needs a __main__ guard).
    With ``record_dir`` every episode is also recorded there (core/episode_records.py)."""
    from horizonrl.actors.engine import RolloutEngine  # vLLM: only where an engine starts
    from tqdm import tqdm

    # dtype=None: the engine's dtype as in training (rollout.engine.dtype: bf16 on a GPU, fp32 on the CPU),
    # so a checkpoint is evaluated at the precision its rollouts were generated in.
    engine = RolloutEngine.start(model_path, dtype=None, engine=engine_config or EngineConfig(),
                                 max_model_len=spec.max_context_tokens, seed=spec.seed)
    try:
        with tqdm(desc=f"{spec.env} episodes", unit="ep", leave=False) as bar:
            def progress(total: int) -> None:
                bar.total = total
                bar.update(1)

            return asyncio.run(evaluate_with(engine, load_chat_tokenizer(model_path), spec, make_env, record_dir,
                                             on_episode=progress))
    finally:
        engine.shutdown()


async def evaluate_with(engine, chat, spec: EvalSpec, make_env: EnvFactory, record_dir: str | None = None,
                        weights: Callable[[], tuple[int, int]] | None = None,
                        on_episode: Callable[[int], None] | None = None) -> dict:
    """Play the spec's episodes on a running engine. ``weights`` (the actor's, during training) says which
    (epoch, version) generates each turn; the result then names the oldest and newest version in
    ``weight_versions``. ``on_episode(episodes)`` is called as each of the ``episodes`` ends (a progress bar)."""
    probe = make_env(spec.env, spec.env_settings)
    task_ids = list(spec.task_ids) if spec.task_ids is not None else probe.task_ids(spec.split)[: spec.episodes]
    plays = [t for t in task_ids for _ in range(spec.samples_per_task)]
    sampling = SamplingSettings(spec.temperature, 1.0, spec.max_tokens_per_turn, spec.max_context_tokens,
                                spec.system_prompt, spec.turn_timeout_s, spec.episode_timeout_s, spec.context)
    semaphore = asyncio.Semaphore(MAX_CONCURRENT_EPISODES)

    async def play(task_id: int):
        async with semaphore:
            env = make_env(spec.env, spec.env_settings)
            try:
                return task_id, await run_episode(engine, env, chat, task_id, max_turns=spec.max_turns,
                                                  sampling=sampling, weights=weights or (lambda: (0, 0)))
            finally:
                await env.close()
                if on_episode is not None:
                    on_episode(len(plays))

    start = time.perf_counter()
    results = await asyncio.gather(*(play(t) for t in plays))
    wall = time.perf_counter() - start
    if record_dir is not None:
        record_episodes(record_dir, spec, probe, results)
    valid = [(t, ep) for t, ep in results if not ep.failure]
    categories: dict[str, list] = defaultdict(list)
    for t, ep in valid:
        categories[probe.task_category(t)].append((t, ep))
    per_category = {c: summarise(v, spec.k) for c, v in sorted(categories.items())}
    versions = [v for _, ep in results for v in ep.turn_versions]
    extra = {"weight_versions": [min(versions), max(versions)] if versions else [-1, -1]} if weights else {}
    return {
        "env": spec.env,
        "split": spec.split if spec.task_ids is None else "ids",
        "tasks": len(task_ids),
        "samples_per_task": spec.samples_per_task,
        "episodes": len(results),
        "infra_failures": len(results) - len(valid),
        "failures_by_kind": dict(Counter(ep.failure for _, ep in results if ep.failure)),
        **summarise(valid, spec.k),
        "max_turns": spec.max_turns,
        "generated_tokens_per_s": sum(ep.generated_tokens for _, ep in results) / max(wall, 1e-9),
        "wall_s": wall,
        "by_category": {c: m["success_rate"] for c, m in per_category.items()},
        "categories": per_category,
        **extra,
    }


def record_episodes(record_dir: str, spec: EvalSpec, probe, results: list) -> None:
    """Every evaluation episode as a record line (``evaluation: true``), for ``horizonrl view``."""
    from horizonrl.core.episode_records import EpisodeRecordWriter, episode_record

    writer = EpisodeRecordWriter(record_dir)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    try:
        for i, (task_id, ep) in enumerate(results):
            t = to_trajectory(ep, run_id=f"eval-{stamp}", trajectory_id=f"eval-{stamp}-{i}",
                              group_id=f"eval-{stamp}-t{task_id}", group_size=spec.samples_per_task, env=spec.env,
                              task_id=task_id, actor_id=0, max_turns=spec.max_turns,
                              category=probe.task_category(task_id), with_text=True)
            writer.write(episode_record(t, evaluation=True))
    finally:
        writer.close()


def summarise(played: list, k: int) -> dict:
    """Metrics of (task_id, episode) pairs without infrastructure failures; see docs/evaluation.md.

    pass@k per task uses that task's own n (its valid samples); tasks with fewer than k valid
    samples are left out of pass@k (and counted in ``pass_at_k_tasks``).
    """
    n = max(1, len(played))
    per_task: dict[int, list[bool]] = defaultdict(list)
    for t, ep in played:
        per_task[t].append(bool(ep.success))
    out = {
        "episodes_valid": len(played),
        "success_rate": sum(ep.success for _, ep in played) / n,
        "mean_score": sum(ep.score for _, ep in played) / n,
        "mean_reward": sum(ep.reward for _, ep in played) / n,
        "mean_turns": sum(ep.env_turns for _, ep in played) / n,  # the environment's (summaries are not)
        # replies that named no valid action, per turn: how well the model keeps the action format
        "invalid_action_rate": (sum(ep.invalid_actions for _, ep in played)
                                / max(1, sum(ep.env_turns for _, ep in played))),
        # how the episodes met the context: ended at it, or went on in windows (rollout.context)
        "context_limit_rate": sum(ep.stop_reason == STOP_CONTEXT for _, ep in played) / n,
        "context_windows": sum(len(ep.hidden_turns_at) for _, ep in played) / n,
    }
    for kk in sorted({1, k}):
        values = [pass_at_k(len(s), sum(s), kk) for s in per_task.values() if len(s) >= kk]
        out[f"pass@{kk}"] = sum(values) / len(values) if values else 0.0
    out["pass_at_k_tasks"] = sum(1 for s in per_task.values() if len(s) >= k)
    return out


def format_table(result: dict) -> str:
    """The overall row and one row per category, aligned, for the terminal."""
    passes = [key for key in result if key.startswith("pass@")]
    cols = ["episodes_valid", "success_rate", "mean_score", "mean_reward", "mean_turns", *passes]
    rows = [("all", result)] + list(result.get("categories", {}).items())
    width = max(8, *(len(name) for name, _ in rows))
    lines = [f"{result['env']}: {result['tasks']} tasks x {result['samples_per_task']} samples, "
             f"max {result['max_turns']} turns, {result['infra_failures']} failed episodes (not the agent's doing)",
             f"{'category':<{width}}  " + "  ".join(f"{c.replace('episodes_valid', 'episodes'):>12}" for c in cols)]
    for name, r in rows:
        lines.append(f"{name:<{width}}  " + "  ".join(
            f"{r[c]:>12d}" if isinstance(r[c], int) else f"{r[c]:>12.3f}" for c in cols))
    return "\n".join(lines)
