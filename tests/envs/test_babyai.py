"""BabyAI: AgentGym's format and id mapping, the bot as oracle, bad input, determinism."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from horizonrl.envs.babyai import BOT_UNSUPPORTED_LEVELS, LEVELS, BabyAIEnv
from horizonrl.envs.registry import make_env

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

EASY = "BabyAI-GoToRedBallNoDists-v0"


async def run_bot(env: BabyAIEnv, task_id: int, max_turns: int = 400):
    await env.reset(task_id)
    bot, result = None, None
    for _ in range(max_turns):
        reply, bot = env.expert_action(bot)
        result = await env.step(reply)
        if result.done:
            break
    return result


def test_registry_and_id_mapping():
    env = make_env("babyai", {})
    assert env.name == "babyai" and len(LEVELS) == 40
    assert env.level_and_seed(0) == (LEVELS[0], 0)
    assert env.level_and_seed(93) == (LEVELS[13], 2)  # AgentGym: level 93 % 40 + 1 = 14, seed 93 // 40
    restricted = BabyAIEnv(levels=[EASY, "BabyAI-Pickup-v0"])
    assert restricted.level_and_seed(5) == ("BabyAI-Pickup-v0", 2)
    assert restricted.task_category(4) == EASY


def test_splits_disjoint_by_seed():
    env = BabyAIEnv(levels=[EASY], num_seeds=100)
    train, test = set(env.task_ids("train")), set(env.task_ids("test"))
    assert train and test and not train & test and len(train | test) == 100
    assert all(env.level_and_seed(i)[1] % 5 == 0 for i in test)
    with pytest.raises(ValueError):
        env.task_ids("valid")


def test_unknown_level_rejected():
    with pytest.raises(ValueError):
        BabyAIEnv(levels=["BabyAI-NoSuchLevel-v0"])


async def test_agentgym_observation_format():
    env = BabyAIEnv()
    obs = await env.reset(2)
    goal, description, actions = obs.split("\n")
    assert goal == "Your goal: go to the red ball"
    assert "There is a red ball 1" in description and "You are not carrying anything." in description
    assert actions.startswith("Available actions: ")
    listed = json.loads(actions[len("Available actions: "):])
    assert {"turn left", "turn right", "go to red ball 1", "check available actions"} <= set(listed)
    result = await env.step("Thought: it is there.\nAction: check available actions")
    assert result.observation.startswith("You can take the following actions:") and not result.done


async def test_high_level_go_to_solves_goto_level_with_minigrid_reward():
    env = BabyAIEnv(levels=[EASY])
    solved = 0
    for task_id in range(10):
        obs = await env.reset(task_id)
        if "go to red ball 1" not in obs:
            continue
        result = await env.step("Action: go to red ball 1")
        assert result.done and result.success
        max_steps = env._env.unwrapped.max_steps
        assert result.reward == pytest.approx(1 - 0.9 * result.info["steps"] / max_steps)
        assert result.score == result.reward
        solved += 1
    assert solved >= 3


async def test_high_level_pickup():
    env = BabyAIEnv(levels=["BabyAI-PickupLoc-v0"])
    for task_id in range(20):
        await env.reset(task_id)
        target = env._env.unwrapped.mission.replace("pick up the ", "").replace("pick up a ", "")
        action = next((a for a in env.available_actions() if a.startswith(f"pickup {target} ")), None)
        if action is None:
            continue
        result = await env.step(f"Action: {action.replace('pickup', 'pick up')}")
        assert "You are carrying a" in result.observation
        return
    pytest.fail("no task with the target in view")


@pytest.mark.parametrize("start", [0, 40])
async def test_bot_oracle_succeeds_through_text_actions(start):
    env = BabyAIEnv()
    results = []
    for task_id in range(start, start + 40):
        if env.task_category(task_id) in BOT_UNSUPPORTED_LEVELS:
            continue
        results.append((await run_bot(env, task_id)).success)
    assert sum(results) / len(results) >= 0.95


async def test_max_steps_override_ends_episode_unsuccessfully():
    env = BabyAIEnv(levels=[EASY], max_steps=3)
    await env.reset(0)
    for _ in range(3):
        result = await env.step("Action: turn left")
    assert result.done and not result.success and result.reward == 0.0
    assert "ran out of steps" in result.observation


async def test_bad_input_is_an_observation():
    env = BabyAIEnv(levels=[EASY])
    before = await env.step("Action: turn left")  # before any reset
    assert before.done
    await env.reset(0)
    for reply in ["", "I think I will turn", "Action:", "Action: fly away", "Action: drop", "\x00" * 50,
                  "Action: " + "x" * 10_000]:
        result = await env.step(reply)
        assert not result.done and result.info["invalid_action"]
        assert "Available actions" in result.observation
    assert "not carrying anything" in (await env.step("Action: drop")).observation
    with pytest.raises(ValueError):
        await env.reset(-1)
    with pytest.raises(ValueError):
        await env.reset("3")  # type: ignore[arg-type]


async def test_actions_after_done():
    env = BabyAIEnv(levels=[EASY])
    for task_id in range(20):
        if "go to red ball 1" in await env.reset(task_id):
            break
    final = await env.step("Action: go to red ball 1")
    assert final.done
    after = await env.step("Action: turn left")
    assert after.done and after.reward == 0.0 and after.success == final.success


async def test_random_action_is_always_valid():
    env = BabyAIEnv(levels=[EASY, "BabyAI-GoToLocalS8N7-v0", "BabyAI-Open-v0"])
    rng = random.Random(0)
    for task_id in range(6):
        await env.reset(task_id)
        for _ in range(15):
            reply = env.random_action(rng)
            assert reply.startswith("Action: ")
            result = await env.step(reply)
            assert not result.info["invalid_action"]
            if result.done:
                break


async def test_compact_observation_for_small_models():
    env = BabyAIEnv(levels=[EASY], high_level_actions=False, observation="compact")
    obs = await env.reset(5)
    assert obs.splitlines()[0] == "Goal: go to the red ball"
    assert obs.splitlines()[-1].startswith("Actions: turn left, turn right")
    assert "go to" not in obs.splitlines()[-1] and len(obs) < 150
    assert set(env.available_actions()) <= {"turn left", "turn right", "move forward", "pickup red ball 1"}


DIGEST_SCRIPT = """
import asyncio, hashlib, random, sys, warnings
warnings.filterwarnings("ignore")
from horizonrl.envs.babyai import BabyAIEnv
async def main():
    env, h = BabyAIEnv(), hashlib.sha256()
    for task_id in (0, 7, 45, 123, 519):
        h.update((await env.reset(task_id)).encode())
        rng = random.Random(task_id)
        for _ in range(8):
            r = await env.step(env.random_action(rng))
            h.update(r.observation.encode() + repr(r.reward).encode())
            if r.done:
                break
    print(h.hexdigest())
asyncio.run(main())
"""


def test_deterministic_across_processes():
    digests = {
        subprocess.run([sys.executable, "-c", DIGEST_SCRIPT], capture_output=True, text=True, timeout=120,
                       check=True).stdout.strip()
        for _ in range(2)
    }
    assert len(digests) == 1 and len(digests.pop()) == 64
