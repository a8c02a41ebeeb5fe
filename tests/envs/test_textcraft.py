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


@pytest.fixture(scope="module")
def renamed():
    return TextCraftEnv(max_depth=1, max_distractors=2, renamed_variants=20)


async def test_renamed_variants_show_each_goal_under_other_names_and_hold_the_same_goals_out(renamed):
    plain = TextCraftEnv(max_depth=1, max_distractors=2)
    goals = len(plain.goals)
    assert renamed.num_tasks == 20 * goals
    # A task is goal task_id % goals; held-out goals are held out under every renaming.
    assert {renamed.goal_index(i) for i in renamed.task_ids("test")} == set(plain.task_ids("test"))
    assert {renamed.goal_index(i) for i in renamed.task_ids("train")} == set(plain.task_ids("train"))
    assert len(renamed.task_ids("test")) == 20 * len(plain.task_ids("test"))
    goal = plain.task_ids("train")[7]
    texts = set()
    for variant in range(4):
        text = await renamed.reset(variant * goals + goal)
        texts.add(text)
        plan = renamed.expert_plan()
        for reply in plan:  # the plan in this variant's words crafts the package's goal
            result = await renamed.step(reply)
        assert result.success and result.reward == 1.0
        assert renamed.goal == plain.goals[goal][0]
    package_text = await plain.reset(goal)
    assert len(texts) == 4 and package_text not in texts
    # Only item-name words change: the layout and the command words are the package's.
    shape = [line.split()[:1] for line in package_text.splitlines()]
    assert all([line.split()[:1] for line in text.splitlines()] == shape for text in texts)


async def test_renamed_replies_use_the_episode_words_both_ways(renamed):
    goal = len(renamed.goals) * 3 + 12
    observation = await renamed.reset(goal)
    plan = renamed.expert_plan()
    _, count, name = plan[0].removeprefix("Action: ").split(" ", 2)  # "get <count> <name>"
    plain = TextCraftEnv(max_depth=1, max_distractors=2)
    await plain.reset(renamed.goal_index(goal))
    assert name in observation and name not in plain.expert_plan()[0]  # renamed, and shown in the recipes
    assert (await renamed.step(plan[0])).observation == f"Got {count} {name}"  # echoed in the shown words
    assert (await renamed.step("Action: inventory")).observation == f"Inventory: [{name}] ({count})"
    # A name no variant word makes is refused as "Could not find", echoed as typed.
    missing = await renamed.step("Action: get 1 qqq zzz")
    assert missing.observation == "Could not find qqq zzz" and missing.info["invalid_action"]


@pytest.mark.parametrize("rename", ["words", "items"])
async def test_renamed_random_policy_succeeds_as_often_as_with_the_package_names(rename):
    async def random_success(env, tasks, seed):
        rng, wins = random.Random(seed), 0
        for task in tasks:
            await env.reset(task)
            for _ in range(6):
                result = await env.step(env.random_action(rng))
                if result.done:
                    break
            wins += result.success
        return wins / len(tasks)

    plain = TextCraftEnv(max_depth=1, max_distractors=2)
    renamed = TextCraftEnv(max_depth=1, max_distractors=2, renamed_variants=20, rename=rename)
    tasks = random.Random(0).sample(renamed.task_ids("train"), 300)
    renamed_rate = await random_success(renamed, tasks, 1)
    plain_rate = await random_success(plain, [renamed.goal_index(t) for t in tasks], 1)
    # Renaming changes the words (and draws the distractors and their order per variant), not the task's
    # difficulty: a random policy succeeds about as often (fixed seeds, so the figures are fixed too).
    assert abs(renamed_rate - plain_rate) < 0.1 and 0.15 < renamed_rate < 0.6


def test_renamed_variants_must_be_a_count_and_the_renaming_known():
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="renamed_variants"):
            TextCraftEnv(renamed_variants=bad)
    with pytest.raises(ValueError, match="rename must be one of words, items"):
        TextCraftEnv(renamed_variants=3, rename="letters")


async def test_renamed_items_get_invented_names_of_their_own():
    """rename=items: every item of the episode shows as two invented words; no package name is left in the
    text, the plan in those names crafts the package's goal, and the names differ between renamings."""
    items = TextCraftEnv(max_depth=1, max_distractors=2, renamed_variants=20, rename="items")
    plain = TextCraftEnv(max_depth=1, max_distractors=2)
    package_words = plain._all_name_words() - {"a", "the", "crafting", "item"}
    goals = len(plain.goals)
    seen_goal_names = set()
    for goal in (plain.task_ids("train")[3], plain.task_ids("test")[4], 37):
        for variant in range(3):
            text = await items.reset(variant * goals + goal)
            head, _, goal_line = text.partition("\n\n")
            names = [goal_line.removeprefix("Goal: craft ").removesuffix(".")]
            for command in head.splitlines()[1:]:
                output, inputs = command.removeprefix("craft ").split(" using ")
                names += [output.split(" ", 1)[1]] + [part.split(" ", 1)[1] for part in inputs.split(", ")]
            assert all(len(name.split()) == 2 for name in names), text
            assert not package_words & set(" ".join(names).split()), text
            seen_goal_names.add(names[0])
            for reply in items.expert_plan():
                result = await items.step(reply)
            assert result.success and items.goal == plain.goals[goal][0]
            assert result.observation.startswith("Crafted ") and "minecraft:" + names[0].replace(" ", "_") in \
                result.observation
    assert len(seen_goal_names) == 9  # each renaming names the goal anew
    # a name this episode does not show stays as typed
    await items.reset(5)
    assert (await items.step("Action: get 1 qqq zzz")).observation == "Could not find qqq zzz"


SCRIPT = """
import asyncio, hashlib
from horizonrl.envs.textcraft import TextCraftEnv
async def main():
    env, renamed, h = TextCraftEnv(), TextCraftEnv(max_depth=1, renamed_variants=50), hashlib.sha256()
    for i in (0, 17, 250, 543):
        h.update((await env.reset(i)).encode())
    items = TextCraftEnv(max_depth=1, renamed_variants=50, rename="items")
    for i in (0, 17, 250, 6249):
        h.update((await renamed.reset(i)).encode() + repr(renamed.expert_plan()).encode())
        h.update((await items.reset(i)).encode() + repr(items.expert_plan()).encode())
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


async def play_expert(env: TextCraftEnv, task_id: int) -> list:
    await env.reset(task_id)
    results = []
    for action in env.expert_plan():
        results.append(await env.step(action))
        if results[-1].done:
            break
    return results


async def test_progress_reward_pays_each_milestone_once_and_sums_to_one():
    # polished andesite stairs (task 540): milestones andesite, diorite, polished andesite (M = 3), each worth
    # 1 / (M + 1) = 0.25 on the turn that first crafts it; obtaining the goal pays the remaining 0.25.
    env = TextCraftEnv(progress_reward=True)
    results = await play_expert(env, 540)
    assert [r.reward for r in results] == [0.0, 0.0, 0.25, 0.0, 0.0, 0.25, 0.0, 0.0, 0.0, 0.25, 0.0, 0.25]
    assert results[-1].success and [r.score for r in results if not r.done][-1] == 0.75
    # the same milestone again (get quartz, get cobblestone, craft diorite, twice) earns nothing more
    await env.reset(540)
    first = [await env.step(a) for a in env.expert_plan()[:3]]
    again = [await env.step(a) for a in env.expert_plan()[:3]]
    assert [r.reward for r in first] == [0.0, 0.0, 0.25] and [r.reward for r in again] == [0.0, 0.0, 0.0]
    # off (the default): the outcome only
    assert [r.reward for r in await play_expert(TextCraftEnv(), 540)] == [0.0] * 11 + [1.0]
