"""Record lines for the viewer's fast tests: synthetic episodes, and BabyAI / TextCraft episodes
played in the real environments with scripted replies (no model), so replays have real states."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import msgspec
from helpers import BABYAI_SETTINGS, make_trajectory

from horizonrl.core.environment import extract_action
from horizonrl.core.episode_records import episode_record
from horizonrl.envs import make_env
from horizonrl.protocol import EpisodeText


def synthetic_record(group: str, index: int, *, env: str = "signpost", task_id: int = 1, success: bool = False,
                     failure: str = "", turns: int = 1, versions: list[int] | None = None, evaluation: bool = False,
                     rewards: list[float] | None = None, reply: str = "Action: go left",
                     first_observation: str = "Find the exit.") -> dict:
    versions = versions or [0] * turns
    rewards = rewards if rewards is not None else [1.0 if success and i == turns - 1 else 0.0 for i in range(turns)]
    t = msgspec.structs.replace(
        make_trajectory(group, index, task_id=task_id, failure=failure), env=env, turn_versions=versions,
        turn_epochs=[0] * turns, turn_rewards=rewards, num_turns=turns, success=success, reward=sum(rewards),
        score=sum(rewards), stop_reason="failure" if failure else "done",
        failure_message="went wrong" if failure else "",
        text=EpisodeText(first_observation=first_observation, replies=[f"{reply} ({i + 1})" for i in range(turns)],
                         actions=[extract_action(reply)] * turns,
                         observations=[f"observation {i + 1} of {group}-{index}" for i in range(turns)]))
    return episode_record(t, evaluation=evaluation)


async def _play(env_name: str, settings: dict, task_id: int, replies: list[str]) -> tuple[str, list[str], list]:
    env = make_env(env_name, settings)
    try:
        first = await env.reset(task_id)
        steps = [await env.step(reply) for reply in replies]
    finally:
        await env.close()
    return first, [s.observation for s in steps], steps


def played_record(env_name: str, task_id: int, replies: list[str], *, group: str, index: int = 0, version: int = 0,
                  settings: dict | None = None) -> dict:
    """An episode of the real environment whose replies are ``replies``, recorded as the buffer would."""
    settings = BABYAI_SETTINGS if settings is None and env_name == "babyai" else (settings or {})
    # in a thread of its own: async tests call this with their event loop running
    with ThreadPoolExecutor(1) as pool:
        first, observations, steps = pool.submit(asyncio.run, _play(env_name, settings, task_id, replies)).result(60)
    n = len(replies)
    rewards = [s.reward for s in steps]
    t = msgspec.structs.replace(
        make_trajectory(group, index, task_id=task_id), env=env_name, turn_versions=[version] * n,
        turn_epochs=[0] * n, turn_rewards=rewards, num_turns=n, success=bool(steps and steps[-1].success),
        reward=sum(rewards), score=steps[-1].score if steps else 0.0, max_turns=max(n, 1),
        text=EpisodeText(first_observation=first, replies=list(replies),
                         actions=[extract_action(r) for r in replies], observations=observations))
    return episode_record(t)
