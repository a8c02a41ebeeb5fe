"""TextCraft: format, deterministic tasks, the crafting-plan expert, bad input."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from horizonrl.envs.registry import make_env
from horizonrl.envs.textcraft import TextCraftEnv


@pytest.fixture(scope="module")
def env():
    return TextCraftEnv()


async def test_format_and_categories(env):
    obs = await env.reset(300)
    head, _, goal = obs.partition("\n\n")
    assert head.startswith("Crafting commands:\ncraft ") and goal.startswith("Goal: craft ") and goal.endswith(".")
    commands = head.splitlines()[1:]
    assert all(c.startswith("craft ") and " using " in c for c in commands)
    depths = [int(env.task_category(i).split("-")[1]) for i in range(env.num_tasks)]
    assert depths == sorted(depths) and depths[0] == 1 and depths[-1] == 4


def test_splits(env):
    train, test = set(env.task_ids("train")), set(env.task_ids("test"))
    assert not train & test and len(train | test) == env.num_tasks


async def test_max_depth_keeps_the_first_goals_under_their_ids(env):
    shallow = TextCraftEnv(max_depth=2)
    assert shallow.num_tasks == sum(1 for i in range(env.num_tasks) if env.task_category(i) in ("depth-1", "depth-2"))
    assert 0 < shallow.num_tasks < env.num_tasks
    assert {shallow.task_category(i) for i in range(shallow.num_tasks)} == {"depth-1", "depth-2"}
    for task in (0, shallow.num_tasks - 1):  # the same goal and text as without the limit
        assert await shallow.reset(task) == await env.reset(task)
    assert set(shallow.task_ids("test")) == {i for i in env.task_ids("test") if i < shallow.num_tasks}
    with pytest.raises(ValueError, match="task id"):
        await shallow.reset(shallow.num_tasks)  # a depth-3 goal is out of range, not silently another one
    with pytest.raises(ValueError, match="max_depth"):
        TextCraftEnv(max_depth=0)


async def test_expert_plan_succeeds(env):
    rng = random.Random(0)
    ids = rng.sample(range(env.num_tasks), 120)
    wins = 0
    for task_id in ids:
        await env.reset(task_id)
        for reply in env.expert_plan():
            result = await env.step(reply)
            if result.done:
                break
        wins += result.success and result.reward == 1.0
    assert wins / len(ids) >= 0.95


async def test_replies(env):
    await env.reset(0)
    assert (await env.step("Action: inventory")).observation == "Inventory: You are not carrying anything."
    plan = env.expert_plan()
    first = await env.step(plan[0])
    assert first.observation.startswith("Got ") and first.reward == 0
    assert (await env.step("Action: get 1 diamond pickaxe")).observation == "Could not find diamond pickaxe"
    bad = await env.step("Action: craft 1 diamond pickaxe using 3 diamond, 2 stick")
    assert bad.observation.startswith("Could not find enough items") and bad.info["invalid_action"]


async def test_bad_input(env):
    assert (await make_env("textcraft").step("Action: inventory")).done  # before reset
    await env.reset(3)
    for reply in ["", "no action here", "Action:", "Action: dance", "Action: craft using", "Action: get -3 stone",
                  "Action: get 999999999999 oak log", "Action: craft x using y", "\udcff\x00", "Action: " + "a" * 20000]:
        result = await env.step(reply)
        assert not result.done and result.reward == 0.0
    for bad_id in (-1, env.num_tasks, "1", None):
        with pytest.raises(ValueError):
            await env.reset(bad_id)


async def test_actions_after_done(env):
    await env.reset(10)
    for reply in env.expert_plan():
        result = await env.step(reply)
    assert result.done and result.success
    after = await env.step("Action: inventory")
    assert after.done and after.reward == 0.0


async def test_random_action_well_formed(env):
    rng = random.Random(1)
    await env.reset(42)
    for _ in range(20):
        reply = env.random_action(rng)
        assert reply.startswith("Action: ")
        await env.step(reply)


SCRIPT = """
import asyncio, hashlib
from horizonrl.envs.textcraft import TextCraftEnv
async def main():
    env, h = TextCraftEnv(), hashlib.sha256()
    for i in (0, 17, 250, 543):
        h.update((await env.reset(i)).encode())
    print(h.hexdigest())
asyncio.run(main())
"""


def test_deterministic_across_processes():
    digests = set()
    for hash_seed in ("1", "2"):
        environ = {**os.environ, "PYTHONHASHSEED": hash_seed}
        out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120,
                             check=True, env=environ)
        digests.add(out.stdout.strip())
    assert len(digests) == 1
