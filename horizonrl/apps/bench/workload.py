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


def played_episodes(run_dir) -> list[list[list[int]]]:
    """The requests a finished training run's actors sent their engines: per episode the buffer accepted (its
    write-ahead log), the prompt of each generated turn (the context before it), in turn order; episodes in the
    order they arrived, so a group's members stay together.

    What a bare engine replays to serve the very workload a training run served: the trained policy's prompt
    lengths and turn counts, and the prefixes the members of a group share (their first prompt), which random
    replayed episodes (:func:`replay_prompts`) do not have."""
    from horizonrl.buffer.records import Accepted, decode_record
    from horizonrl.buffer.wal import WriteAheadLog
    from horizonrl.core.run_dirs import RunDir
    from horizonrl.protocol.arrays import TOKEN_DTYPE, unpack

    episodes = []
    for raw in WriteAheadLog(RunDir(run_dir).buffer_wal).replay():
        record = decode_record(raw)
        if not isinstance(record, Accepted):
            continue
        trajectory = record.trajectory
        ids = unpack(trajectory.token_ids, TOKEN_DTYPE).tolist()
        bounds = trajectory.sample_bounds()
        # a turn's prompt starts where its sample does (an episode whose template rewrites history is several)
        episodes.append([ids[max(s for s, _ in bounds if s <= start):start] for start, _ in trajectory.turn_spans])
    return [e for e in episodes if e]
