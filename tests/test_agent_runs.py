"""The actor's agent episodes (``rollout.agent``): a real agent program per episode against the endpoint, with a
scripted generator in place of the engine: the example agent plays a Signpost episode to its end; a program that
crashes, or hangs past the episode's timeout, makes a failed episode (never trained on) and is ended."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest

from horizonrl.actors.openai_endpoint.agent_runs import AgentRunner, agent_command
from horizonrl.apps.tiny_model import build_tokenizer
from horizonrl.core.agent_config import AgentConfig
from horizonrl.core.chat import ChatTokenizer
from horizonrl.envs.registry import make_env
from openai_endpoint_helpers import ScriptedGenerator

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def chat():
    tokenizer = copy.deepcopy(build_tokenizer(["Follow the signs.", "Action: go left", "A sign points"] * 20, 400))
    return ChatTokenizer(tokenizer)


async def runner_for(chat, command: list[str], tmp_path, timeout_s: float = 60.0) -> tuple[AgentRunner, list]:
    generator = ScriptedGenerator(chat, [], version=3)  # its tokens say which weights sampled them
    runner = await AgentRunner.start(AgentConfig(command=command, stop_grace_s=2.0), generator=generator, chat=chat,
                                     weights=lambda: (0, 3), model_name="tiny", temperature=1.0, top_p=1.0,
                                     max_tokens_per_turn=64, max_context_tokens=2048, turn_timeout_s=30.0,
                                     episode_timeout_s=timeout_s, log_path=tmp_path / "agents.log")
    return runner, generator


async def test_the_example_agent_plays_an_episode_through_its_session(chat, tmp_path):
    runner, generator = await runner_for(chat, ["python", str(REPO / "examples" / "babyai_agent.py")], tmp_path)
    env = make_env("signpost", {"length": 2})
    first = await env.reset(0)
    signs = [first.rsplit("points ", 1)[1].rstrip(".")]
    # the model: read the sign the agent will show it (task 0's signs are fixed by its seed)
    twin = make_env("signpost", {"length": 2})
    await twin.reset(0)
    step = await twin.step(f"Action: go {signs[0]}")
    signs.append(step.observation.rsplit("points ", 1)[1].rstrip("."))
    generator.replies = [f"Thought: follow it.\nAction: go {s}" for s in signs]
    try:
        episode = await runner.play(env, "signpost", 0, max_turns=5)
    finally:
        await runner.stop()
    assert not episode.failure and episode.success and episode.stop_reason == "done"
    assert episode.num_turns == 2 and episode.turn_rewards == [0.5, 0.5] and episode.turn_versions == [3, 3]
    assert chat.decode(generator.prompts[0]).count('"name": "act"') == 1  # the agent's tools, in the hermes prompt
    assert (tmp_path / "agents.log").read_text() == ""


async def test_a_crashing_program_is_an_environment_failure(chat, tmp_path):
    runner, _ = await runner_for(chat, [sys.executable, "-c", "import sys; print('boom', file=sys.stderr); "
                                                              "sys.exit(3)"], tmp_path)
    try:
        episode = await runner.play(make_env("signpost"), "signpost", 0, max_turns=5)
    finally:
        await runner.stop()
    assert episode.failure == "environment" and "exited with 3" in episode.failure_message
    assert "boom" in (tmp_path / "agents.log").read_text() and not runner.endpoint.sessions


async def test_a_hung_program_is_killed_and_its_episode_a_timeout(chat, tmp_path):
    runner, _ = await runner_for(chat, [sys.executable, "-c", "import time; time.sleep(600)"], tmp_path,
                                 timeout_s=1.5)
    try:
        episode = await runner.play(make_env("signpost"), "signpost", 0, max_turns=5)
    finally:
        await runner.stop()
    assert episode.failure == "timeout" and not runner.endpoint.sessions


def test_python_is_the_interpreter_running_horizonrl():
    assert agent_command(["python", "a.py"]) == [sys.executable, "a.py"]
    assert agent_command(["./agent", "--x"]) == ["./agent", "--x"]
