"""SciWorld: AgentGym's ids and exclusions, disjoint splits, gold sequences, bad input, JVM pool."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from horizonrl.envs import sciworld
from horizonrl.envs.base import EnvironmentFailure
from horizonrl.envs.sciworld import POOL, SciWorldEnv, canonical_listing, task_table

pytestmark = pytest.mark.system  # Java 17 (SciWorld's JVM)


@pytest.fixture
def java():
    """SciWorld runs a JVM; without Java these tests fail (never skip): `make venv` installs it."""
    if shutil.which("java") is None:
        pytest.fail("SciWorld needs Java 17 and `java` is not on PATH: `make venv` installs Debian's "
                    "openjdk-17-jre-headless (as root), or install it yourself")


def test_ids_exclusions_and_disjoint_splits():
    env = SciWorldEnv()
    rows = task_table()
    assert not {r["key"] for r in rows} & sciworld.EXCLUDED_TASKS
    assert len({r["key"] for r in rows}) == 23
    train, test = set(env.task_ids("train")), set(env.task_ids("test"))
    assert train and test and not train & test
    assert env.task_category(0) == "boil"


def test_canonical_listing_sorts_siblings_with_their_children():
    text = "Room:\n\tb thing\n\t\tz child\n\t\ta child\n\ta thing\nYou also see:\n\tdoor"
    assert canonical_listing(text) == "Room:\n\ta thing\n\tb thing\n\t\ta child\n\t\tz child\nYou also see:\n\tdoor"


async def test_java_missing_is_a_clear_environment_failure(monkeypatch):
    monkeypatch.setattr(sciworld.shutil, "which", lambda name: None)
    monkeypatch.setattr(sciworld, "POOL", sciworld._JVMPool())
    with pytest.raises(EnvironmentFailure, match="Java 17"):
        await SciWorldEnv().reset(0)


@pytest.fixture(scope="module")
def gold_env():
    env = SciWorldEnv(gold_path=True)
    yield env
    POOL.clear()


@pytest.mark.usefixtures("java")
@pytest.mark.parametrize("task", ["find-living-thing", "lifespan-longest-lived", "chemistry-mix", "power-component"])
async def test_gold_sequence_scores_100(gold_env, task):
    task_id = next(i for i in gold_env.task_ids("test") if gold_env.task_category(i) == task)
    obs = await gold_env.reset(task_id)
    assert obs.startswith("Your task is") and "This room is called" in obs
    total = 0.0
    for reply in gold_env.expert_plan():
        result = await gold_env.step(f"Thought: next.\n{reply}")
        total += result.reward
        if result.done:
            break
    assert result.done and result.success and result.score == 100.0 and total == pytest.approx(1.0)
    after = await gold_env.step("Action: look around")
    assert after.done and after.reward == 0.0


@pytest.mark.usefixtures("java")
async def test_bad_input(gold_env):
    await gold_env.reset(gold_env.task_ids("test")[0])
    assert (await gold_env.step("no action")).observation == "Invalid Action."
    for reply in ["Action: fly to the moon", "Action: " + "x" * 5000, "Action: \x00\udcff", "Action: focus on"]:
        result = await gold_env.step(reply)
        assert not result.done and result.reward == 0.0
    for bad in (-1, 10**6, "2"):
        with pytest.raises(ValueError):
            await gold_env.reset(bad)


@pytest.mark.usefixtures("java")
async def test_jvm_is_pooled_across_instances():
    first = SciWorldEnv()
    await first.reset(5)
    jvm = first._jvm
    await first.close()
    second = SciWorldEnv()
    await second.reset(6)
    assert second._jvm is jvm
    await second.close()


SCRIPT = """
import asyncio, hashlib
from horizonrl.envs.sciworld import SciWorldEnv, POOL

async def main():
    env, h = SciWorldEnv(), hashlib.sha256()
    for i in (3761, 4195, 1321):
        h.update((await env.reset(i)).encode())
        h.update((await env.step("Action: open door to hallway")).observation.encode())
    await env.close(); POOL.clear()
    print(h.hexdigest())
asyncio.run(main())
"""


@pytest.mark.usefixtures("java")
@pytest.mark.slow
def test_deterministic_across_processes():
    outs = {subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=180,
                           check=True).stdout.strip() for _ in range(2)}
    assert len(outs) == 1
