"""The episode loop with a scripted generator (the real engine runs in tests/integration)."""

import asyncio
import time

import pytest

from horizonrl.actors.episode_messages import to_trajectory
from horizonrl.actors.engine import Generation
from horizonrl.actors.episode import Episode, SamplingSettings, run_episode
from horizonrl.envs import EnvironmentFailure
from horizonrl.envs.signpost import SignpostEnv
from horizonrl.protocol import Trajectory, decode_as, encode
from horizonrl.protocol.arrays import LOGPROB_DTYPE, MASK_DTYPE, TOKEN_DTYPE, unpack

from helpers import EOT, CharChat


class ScriptedEngine:
    def __init__(self, replies):
        self.replies = list(replies)
        self.prompts = []

    async def generate(self, prompt_ids, *, max_tokens, temperature, top_p, stop_token_ids):
        self.prompts.append(list(prompt_ids))
        text = self.replies.pop(0)
        ids = [ord(c) + 100 for c in text][:max_tokens]
        if len(ids) < max_tokens:
            ids.append(EOT)
        return Generation(ids, [-0.1 * (k + 1) for k in range(len(ids))], "stop")


SAMPLING = SamplingSettings(temperature=1.0, top_p=1.0, max_tokens_per_turn=64, max_context_tokens=4096)


async def play(replies, env=None, max_turns=10, version=lambda: (2, 7)):
    env = env or SignpostEnv(length=2)
    engine = ScriptedEngine(replies)
    ep = await run_episode(engine, env, CharChat(), 3, max_turns=max_turns, sampling=SAMPLING, weights=version)
    return ep, engine


def signs(task_id=3, length=2):
    import random

    env = SignpostEnv(length=length)
    rng = random.Random(task_id)
    return rng.choices(("left", "right", "straight"), weights=env._sign_weights, k=length)


async def test_tokens_masks_and_logprobs_stay_aligned_and_append_only():
    s = signs()
    ep, engine = await play(["Action: go nowhere", f"Action: go {s[0]}", f"Thought: ok\nAction: go {s[1]}"])
    assert ep.success and ep.stop_reason == "done" and ep.num_turns == 3
    assert len(ep.token_ids) == len(ep.loss_mask) == len(ep.logprobs)
    # Each prompt the engine saw is a prefix of the final sequence: nothing was re-tokenized.
    for prompt in engine.prompts:
        assert ep.token_ids[: len(prompt)] == prompt
    for (start, end), version, epoch in zip(ep.turn_spans, ep.turn_versions, ep.turn_epochs):
        assert all(m == 1 for m in ep.loss_mask[start:end]) and (epoch, version) == (2, 7)
        assert ep.logprobs[start:end] == pytest.approx([-0.1 * (k + 1) for k in range(end - start)])
    assert sum(ep.loss_mask) == sum(e - s for s, e in ep.turn_spans)  # observations carry mask 0
    assert ep.turn_rewards == [0.0, 0.5, 0.5] and ep.reward == 1.0


async def test_unparseable_action_gets_a_helpful_observation_and_the_episode_goes_on():
    s = signs()
    ep, engine = await play(["I don't know", f"Action: go {s[0]}", f"Action: go {s[1]}"])
    assert ep.success and ep.num_turns == 3
    assert ep.invalid_actions == 1 and not ep.failure  # the agent's error: counted, not a failure
    second_prompt = CharChat().decode(engine.prompts[1])
    assert "Invalid action" in second_prompt and "go left" in second_prompt


async def test_turn_budget_ends_the_episode():
    ep, _ = await play(["Action: go up"] * 5, max_turns=3)
    assert ep.stop_reason == "max_turns" and ep.num_turns == 3 and not ep.success


class BrokenEnv(SignpostEnv):
    async def step(self, action_text):
        raise EnvironmentFailure("server went away")


async def test_environment_exception_marks_an_infrastructure_failure():
    ep, _ = await play(["Action: go left"], env=BrokenEnv(length=2))
    assert ep.failure == "environment" and "server went away" in ep.failure_message
    traj = to_trajectory(ep, run_id="r", trajectory_id="t", group_id="g", group_size=2, env="signpost", task_id=3, actor_id=0,
                         max_turns=10, category="x")
    back = decode_as(encode(traj), Trajectory)
    assert back.failure == "environment"
    assert len(unpack(back.token_ids, TOKEN_DTYPE)) == len(unpack(back.loss_mask, MASK_DTYPE)) == len(
        unpack(back.logprobs, LOGPROB_DTYPE))


async def test_context_limit_stops_before_overflow():
    sampling = SamplingSettings(1.0, 1.0, 64, max_context_tokens=120)
    ep = await run_episode(ScriptedEngine(["Action: go up"] * 10), SignpostEnv(length=3), CharChat(), 3,
                           max_turns=10, sampling=sampling)
    assert ep.stop_reason == "context_limit" and len(ep.token_ids) <= 120


class BuggyEnv(SignpostEnv):
    async def step(self, action_text):
        return {}["no such key"]  # a bug in the environment's own code


class FailingEngine(ScriptedEngine):
    async def generate(self, prompt_ids, **kwargs):
        raise RuntimeError("EngineCore died")


class EmptyEngine(ScriptedEngine):
    async def generate(self, prompt_ids, *, max_tokens, **kwargs):
        return Generation([], [], "abort")


class BrokenTemplateChat(CharChat):
    def continuation_ids(self, observation, generated_ids):
        raise ValueError("the chat template is not append-only")


async def test_a_bug_in_the_environment_is_an_environment_failure():
    ep, _ = await play(["Action: go left"], env=BuggyEnv(length=2))
    assert ep.failure == "environment" and "KeyError" in ep.failure_message and ep.stop_reason == "failure"


@pytest.mark.parametrize("engine, message", [(FailingEngine([]), "RuntimeError: EngineCore died"),
                                             (EmptyEngine([]), "no tokens")])
async def test_a_generation_failure_is_an_engine_failure(engine, message):
    ep = await run_episode(engine, SignpostEnv(length=2), CharChat(), 3, max_turns=4, sampling=SAMPLING)
    assert ep.failure == "engine" and message in ep.failure_message and ep.num_turns == 0


async def test_our_own_bug_crashes_loudly():
    """A failure of this code (here the chat layout) is neither the environment's nor the engine's."""
    with pytest.raises(ValueError, match="append-only"):
        await run_episode(ScriptedEngine(["Action: go up"] * 3), SignpostEnv(length=3), BrokenTemplateChat(), 3,
                          max_turns=3, sampling=SAMPLING)


async def test_a_prompt_that_fills_the_context_is_dropped_not_played():
    """Zero turns would enter the group's baseline with reward 0; it is a counted failure instead."""
    sampling = SamplingSettings(1.0, 1.0, 64, max_context_tokens=20)  # Signpost's first prompt is longer
    engine = ScriptedEngine(["Action: go up"])
    ep = await run_episode(engine, SignpostEnv(length=2), CharChat(), 3, max_turns=4, sampling=sampling)
    assert ep.failure == "prompt_too_long" and ep.num_turns == 0 and engine.prompts == []
    assert "max_context_tokens is 20" in ep.failure_message


async def test_the_transcript_is_what_the_agent_saw_and_said_and_reads_as_markdown():
    from horizonrl.actors.episode_messages import episode_sample
    from horizonrl.coordinator import episode_markdown

    s = signs()
    ep, engine = await play(["Action: go nowhere", f"Action: go {s[0]}", f"Action: go {s[1]}"])
    roles = [role for role, _ in ep.transcript()]
    assert roles == ["observation", "reply"] * 3 + ["observation"]  # the final observation too
    assert ep.transcript()[0][1] == CharChat().decode(engine.prompts[0])[2:]  # the task, as the prompt showed it
    assert [text for role, text in ep.transcript() if role == "reply"] == ep.replies
    sample = episode_sample(ep, run_id="r", env="signpost", task_id=3, actor_id=1, max_turns=10)
    assert decode_as(encode(sample), type(sample)) == sample
    markdown = episode_markdown(sample)
    assert markdown.startswith("**signpost task 3** · actor 1 · weights v7 · success")
    assert markdown.count("~~~~text") == 7 and "*reply 2*" in markdown and "*observation after reply 3*" in markdown


class HangingEnv(SignpostEnv):
    async def step(self, action_text):
        await asyncio.sleep(3600)  # a step that never returns


class NeverEndingEngine(ScriptedEngine):
    async def generate(self, prompt_ids, **kwargs):
        await asyncio.sleep(3600)  # a generation that never ends


async def test_a_hung_environment_step_ends_the_episode_at_its_limit():
    sampling = SamplingSettings(1.0, 1.0, 64, 4096, episode_timeout_s=0.3)
    start = time.monotonic()
    ep = await run_episode(ScriptedEngine(["Action: go left"] * 3), HangingEnv(length=2), CharChat(), 3,
                           max_turns=3, sampling=sampling)
    assert ep.failure == "timeout" and "environment call" in ep.failure_message and ep.num_turns == 1
    assert time.monotonic() - start < 5


async def test_a_generation_that_never_ends_ends_the_episode_at_the_turn_limit():
    sampling = SamplingSettings(1.0, 1.0, 64, 4096, turn_timeout_s=0.2, episode_timeout_s=60)
    start = time.monotonic()
    ep = await run_episode(NeverEndingEngine([]), SignpostEnv(length=2), CharChat(), 3, max_turns=3, sampling=sampling)
    assert ep.failure == "timeout" and "a generation took longer than 0.2 s" in ep.failure_message
    assert ep.num_turns == 0 and time.monotonic() - start < 5


def test_a_turn_generated_by_two_weight_versions_is_tagged_per_span():
    ep = Episode()
    ep.append_context([1, 2, 3])
    ep.append_generated([4, 5], [-0.1, -0.2], (0, 3))  # no spans from the generator: the turn's start weights
    ep.append_context([6])
    ep.append_generated([7, 8, 9, 10], [-0.1] * 4, (0, 3), [(1, 0, 3), (4, 0, 4)])
    assert ep.turn_spans == [(3, 5), (6, 10)]
    assert ep.version_spans == [(3, 5, 0, 3), (6, 7, 0, 3), (7, 10, 0, 4)]
    assert ep.turn_versions == [3, 3] and ep.turn_epochs == [0, 0]  # a turn's oldest weights
