"""Benchmark workloads: replayable multi-turn prompts, and the heavy-tailed environment
(``envs/heavy_tail.py``) the rollout and training parts play.
"""

from __future__ import annotations


async def replay_prompts(chat, env_name: str, settings: dict, episodes: int, max_turns: int,
                         seed: int = 0) -> list[list[int]]:
    """Every turn's prompt (the context before each reply) of ``episodes`` random-policy episodes.

    Realistic multi-turn prompts for the bare engine, built without an engine: the same
    template and the same append-only layout the actor produces.
    """
    from horizonrl.apps.tiny_model import episode_ids, random_episodes_async

    prompts = []
    for ep in await random_episodes_async(env_name, settings, episodes, seed=seed, max_turns=max_turns):
        ids, mask = episode_ids(chat, ep.messages)
        prompts += [ids[:i] for i in range(1, len(ids)) if mask[i] == 1 and mask[i - 1] == 0]
    return prompts
