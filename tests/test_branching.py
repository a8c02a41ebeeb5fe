"""Episodes with a chat template that rewrites history (Qwen3 drops earlier think blocks): each turn's prompt is
rendered in full; where it does not extend the current sample the episode branches into a new sample. Checked on
the tiny model's tokenizer, with a scripted engine that records every prompt it was given: the sequences the
learner trains on are, token for token, what the engine was prompted with and generated."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from horizonrl.actors.episode_messages import to_trajectory
from horizonrl.actors.engine import Generation
from horizonrl.actors.episode import SamplingSettings, run_episode
from horizonrl.apps.tiny_model import THINKING_CHAT_TEMPLATE, build_tokenizer
from horizonrl.core.chat import ChatTokenizer
from horizonrl.envs.signpost import SignpostEnv
from horizonrl.learner.advantages import discounted_returns, place_token_rewards
from horizonrl.learner.batching import samples_from_batch, trajectory_samples
from horizonrl.learner.mismatch import MISMATCH_TURNS, TurnMismatch
from horizonrl.protocol import Batch, Trajectory, decode_as, encode
from horizonrl.protocol.arrays import MASK_DTYPE, unpack
from horizonrl.protocol.validation import REJECT_SAMPLES, REJECT_TOO_LONG, trajectory_problem

# Qwen3 with thinking on: no think block in the generation prompt (the model writes one), and earlier turns'
# think blocks dropped. A turn without a think block extends the sample; a turn with one makes the next branch.
THINKING_ON_TEMPLATE = THINKING_CHAT_TEMPLATE.replace("<think>\\n\\n</think>\\n\\n", "")

TEXTS = ["Follow the signs to the exit. Actions: go left, go right, go straight.\nA sign points left.",
         "Action: go left", "Thought: the sign points right.\nAction: go right", "<think>\nthe sign\n</think>\n\n",
         "Dead end. You walk back. A sign points straight."] * 20
TASK = 3
SAMPLING = SamplingSettings(temperature=1.0, top_p=1.0, max_tokens_per_turn=64, max_context_tokens=4096,
                            system_prompt="Follow the signs.")


@pytest.fixture(scope="module")
def base_tokenizer():
    return build_tokenizer(TEXTS, vocab_size=400)


def chat_with(tokenizer, template: str) -> ChatTokenizer:
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = template
    return ChatTokenizer(tokenizer)


class RecordingEngine:
    """Generates the scripted replies as the model would (their ids, then end-of-turn unless cut by max_tokens)
    and records every prompt and generation."""

    def __init__(self, chat: ChatTokenizer, replies: list[str], cut: int | None = None):
        self.chat, self.replies, self.cut = chat, list(replies), cut
        self.prompts: list[list[int]] = []
        self.generated: list[list[int]] = []

    async def generate(self, prompt_ids, *, max_tokens, temperature, top_p, stop_token_ids):
        self.prompts.append(list(prompt_ids))
        ids = self.chat.assistant_ids(self.replies.pop(0))
        if self.cut is not None and len(self.generated) == 0:
            ids = ids[:self.cut]  # the first turn cut by max_tokens: no end-of-turn token
        self.generated.append(ids)
        return Generation(ids, [-0.01 * (k + 1) for k in range(len(ids))], "stop")


def correct_moves(length: int = 3) -> list[str]:
    env = SignpostEnv(length=length)
    return random.Random(TASK).choices(("left", "right", "straight"), weights=env._sign_weights, k=length)


async def play(chat: ChatTokenizer, replies: list[str], max_turns: int = 10, cut: int | None = None):
    engine = RecordingEngine(chat, replies, cut)
    ep = await run_episode(engine, SignpostEnv(length=3), chat, TASK, max_turns=max_turns, sampling=SAMPLING,
                           weights=lambda: (0, 4))
    trajectory = to_trajectory(ep, run_id="r", trajectory_id="t0", group_id="g", group_size=2, env="signpost",
                               task_id=TASK, actor_id=0, max_turns=max_turns, category="")
    return ep, engine, decode_as(encode(trajectory), Trajectory)


def learner_sequences(trajectory: Trajectory):
    """What the learner trains on: the Samples of a batch holding the trajectory (and a worse group mate)."""
    mate = copy.deepcopy(trajectory)
    mate.trajectory_id, mate.reward = "t1", trajectory.reward - 1.0
    mate.turn_rewards = [*mate.turn_rewards[:-1], mate.turn_rewards[-1] - 1.0]
    samples, accounting = samples_from_batch(Batch(run_id="r", request_id=1, groups=[[trajectory, mate]]), True,
                                             current_weights=(0, 4))
    return samples, accounting


def assert_token_exact(engine: RecordingEngine, trajectory: Trajectory) -> list:
    """Each learner sequence starts with the prompt of its first turn; every turn of it is exactly the engine's
    prompt then the engine's generation, at the place the learner has it, with the engine's logprobs."""
    samples, accounting = learner_sequences(trajectory)
    ours = samples[:len(trajectory.sample_bounds())]  # the group mate's samples follow
    assert accounting.trained == 2 and accounting.samples_trained == 2 * len(ours)
    turn = 0
    for sample, (start, end) in zip(ours, trajectory.sample_bounds()):
        ids = sample.token_ids.tolist()
        assert ids[:len(engine.prompts[turn])] == engine.prompts[turn]
        while turn < len(engine.prompts) and trajectory.turn_spans[turn][1] <= end:
            prompt, generated = engine.prompts[turn], engine.generated[turn]
            assert ids[:len(prompt) + len(generated)] == prompt + generated, f"turn {turn}"
            span = slice(len(prompt), len(prompt) + len(generated))
            assert sample.loss_mask[span].tolist() == [1.0] * len(generated)
            assert sample.behaviour_logprobs[span].tolist() == pytest.approx([-0.01 * (k + 1) for k in
                                                                              range(len(generated))])
            assert sample.turn_of_token[span].tolist() == [turn + 1] * len(generated)
            turn += 1
        assert int(sample.loss_mask.sum()) == sum(len(g) for g, (s, e) in zip(engine.generated, trajectory.turn_spans)
                                                  if start <= s < end)
    assert turn == len(engine.prompts)  # every turn the engine played is in one of the sequences
    return ours


async def test_a_qwen3_style_template_branches_every_turn_and_the_learner_gets_what_the_engine_saw(base_tokenizer):
    chat = chat_with(base_tokenizer, THINKING_CHAT_TEMPLATE)
    assert chat.append_only is False
    moves = correct_moves()
    ep, engine, trajectory = await play(chat, ["Action: go nowhere"] + [f"Action: go {m}" for m in moves])
    assert ep.success and ep.num_turns == 4
    # The empty think block of each generation prompt is gone from the next prompt: every turn starts a sample.
    assert len(trajectory.sample_starts) == 3 and trajectory_problem(trajectory, 400, max_tokens=4096) is None
    for earlier, later in zip(engine.prompts, engine.prompts[1:]):
        assert later[:len(earlier)] != earlier
    samples = assert_token_exact(engine, trajectory)
    assert [s.token_ids.tolist() for s in samples] == [p + g for p, g in zip(engine.prompts, engine.generated)]
    # One episode: one reward, one advantage on every sample; the mate's samples all carry the opposite one.
    all_samples, _ = learner_sequences(trajectory)
    # GRPO on rewards (r, r − 1): A = ±0.5 / std = ±1/√2.
    assert [s.advantage for s in all_samples] == pytest.approx([2 ** -0.5] * 4 + [-(2 ** -0.5)] * 4, abs=1e-5)


async def test_turns_without_a_think_block_extend_the_sample_and_turns_with_one_branch(base_tokenizer):
    chat = chat_with(base_tokenizer, THINKING_ON_TEMPLATE)
    assert chat.append_only is False
    moves = correct_moves()
    replies = [f"Action: go {moves[0]}", f"<think>\nI ponder\n</think>\n\nAction: go {moves[1]}",
               f"Action: go {moves[2]}"]
    ep, engine, trajectory = await play(chat, replies)
    assert ep.success and ep.num_turns == 3
    # Turn 1 → 2 appends (no think block to drop); turn 2's think block is dropped from turn 3's prompt: a branch.
    assert engine.prompts[1][:len(engine.prompts[0])] == engine.prompts[0]
    assert len(trajectory.sample_starts) == 1
    samples = assert_token_exact(engine, trajectory)
    assert len(samples) == 2 and "ponder" not in chat.decode(samples[1].token_ids.tolist())


async def test_a_reply_cut_by_max_tokens_is_closed_and_the_turn_budget_leaves_no_empty_sample(base_tokenizer):
    chat = chat_with(base_tokenizer, THINKING_CHAT_TEMPLATE)
    ep, engine, trajectory = await play(chat, ["Action: go nowhere"] * 3, max_turns=2, cut=4)
    assert ep.stop_reason == "max_turns" and ep.num_turns == 2
    assert engine.generated[0][-1] != chat.end_of_turn_id
    # The sample the third turn would have started is not sent: it would be a prompt alone.
    assert len(trajectory.sample_starts) == 1 and trajectory.sample_bounds()[-1][1] == trajectory.turn_spans[-1][1]
    assert trajectory_problem(trajectory, 400, max_tokens=4096) is None
    assert_token_exact(engine, trajectory)


async def test_the_context_limit_applies_to_each_sample_not_to_the_episode(base_tokenizer):
    chat = chat_with(base_tokenizer, THINKING_CHAT_TEMPLATE)
    moves = correct_moves()
    _, engine, trajectory = await play(chat, ["Action: go nowhere"] + [f"Action: go {m}" for m in moves])
    longest = max(e - s for s, e in trajectory.sample_bounds())
    assert trajectory.num_tokens > longest + 20  # the samples repeat the history
    assert trajectory_problem(trajectory, 400, max_tokens=longest) is None
    assert trajectory_problem(trajectory, 400, max_tokens=longest - 1)[0] == REJECT_TOO_LONG
    assert max(len(p) + len(g) for p, g in zip(engine.prompts, engine.generated)) == longest


def test_malformed_sample_starts_are_rejected(base_tokenizer):
    from helpers import make_trajectory

    good = make_trajectory("g", 0, tokens=12)  # prompt 0..6, one turn 6..12
    for starts in ([3], [12], [7], [8, 8]):
        bad = copy.deepcopy(good)
        bad.sample_starts = starts
        assert trajectory_problem(bad, 400)[0] == REJECT_SAMPLES, starts


async def test_reinforce_plus_plus_returns_cross_the_samples_exactly(base_tokenizer):
    """With per-turn rewards, a token's return in its sample equals its return in the whole episode: each
    sample's last generated token carries γ·G of the next sample's first."""
    chat = chat_with(base_tokenizer, THINKING_CHAT_TEMPLATE)
    moves = correct_moves()
    _, _, trajectory = await play(chat, ["Action: go nowhere"] + [f"Action: go {m}" for m in moves])
    gamma = 0.9
    mask = torch.from_numpy(unpack(trajectory.loss_mask, MASK_DTYPE).astype("float32"))
    whole = discounted_returns(place_token_rewards(mask, trajectory.turn_spans, trajectory.turn_rewards,
                                                   trajectory.reward)[None], mask[None], gamma)[0]
    pieces = trajectory_samples(trajectory, 0.0, 0, gamma)
    for sample, (start, end) in zip(pieces, trajectory.sample_bounds()):
        returns = discounted_returns(sample.token_rewards[None], sample.loss_mask[None], gamma)[0]
        on = sample.loss_mask.bool()
        assert returns[on].tolist() == pytest.approx(whole[start:end][on].tolist())


def test_the_mismatch_metric_is_per_turn_mean_and_max_over_measured_tokens():
    m = TurnMismatch()
    turns = torch.tensor([1, 1, 2, -1, MISMATCH_TURNS + 5])
    m.add(turns, torch.tensor([-1.0, -2.0, -3.0, -9.0, -1.0]), torch.tensor([-1.5, -2.0, -2.0, 0.0, -1.25]))
    out = m.all_reduce().metrics()
    assert out["mismatch/turn_1_mean"] == pytest.approx(0.25) and out["mismatch/turn_1_max"] == pytest.approx(0.5)
    assert out["mismatch/turn_2_mean"] == pytest.approx(1.0)
    assert out[f"mismatch/turn_{MISMATCH_TURNS}_max"] == pytest.approx(0.25)  # later turns share the last key
    assert out["mismatch/tokens"] == 4 and out["mismatch/max"] == pytest.approx(1.0)
    assert out["mismatch/mean"] == pytest.approx((0.5 + 0 + 1 + 0.25) / 4)
    assert TurnMismatch().metrics() == {}


async def test_only_tokens_of_the_learners_weights_are_measured(base_tokenizer):
    chat = chat_with(base_tokenizer, THINKING_CHAT_TEMPLATE)
    _, _, trajectory = await play(chat, ["Action: go nowhere"] * 2, max_turns=2)
    assert all((s.turn_of_token == -1).all() for s in trajectory_samples(trajectory, 0.0, 0, current_weights=(0, 5)))
    assert all((s.turn_of_token == -1).all() for s in trajectory_samples(trajectory, 0.0, 0, current_weights=(1, 4)))
