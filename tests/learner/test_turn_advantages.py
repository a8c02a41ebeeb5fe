"""GiGPO's turn-level advantages (adv_estimator=gigpo) against a hand computation, on the path training runs
(samples_from_batch -> collate), and its config."""

from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from horizonrl.core.config import ConfigError, load_config
from horizonrl.learner.algorithm import AlgorithmSettings
from horizonrl.learner.batching import collate, samples_from_batch
from horizonrl.learner.turn_advantages import (
    EpisodeTurns,
    GiGPOSettings,
    anchor_state_keys,
    discounted_turn_returns,
    gigpo_turn_advantages,
    step_group_advantages,
)
from horizonrl.protocol import Batch, Trajectory
from horizonrl.protocol.arrays import LOGPROB_DTYPE, MASK_DTYPE, TOKEN_DTYPE, pack

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "signpost_long.yaml"

# Two observations, as token ids: A is also the task's prompt, so every episode's first turn is taken in A.
A, B = [1, 2, 3], [4, 5]

# The hand example (γ = 0.5, ω = 1): three episodes of one task, (anchor state, reward) per turn.
HAND = [
    [(A, 1.0), (B, 1.0)],
    [(A, 0.0), (A, 1.0), (B, 1.0)],
    [(A, 0.0), (A, 0.0), (A, 1.0)],
]
# Worked out by hand:
#   returns R = [2, 2, 1], mean 5/3            -> A^E = [1/3, 1/3, -2/3]            (mean-norm, no std)
#   G_k = r_k + 0.5 G_{k+1}:  ep 1 [1.5, 1];  ep 2 [0.75, 1.5, 1];  ep 3 [0.25, 0.5, 1]
#   step group A = {1.5, 0.75, 1.5, 0.25, 0.5, 1}: mean 5.5 / 6 = 11/12
#       A^S = [7/12, -2/12, 7/12, -8/12, -5/12, 1/12]
#   step group B = {1, 1}: mean 1 -> A^S = [0, 0]
#   A = A^E + A^S:  ep 1 [1/3 + 7/12, 1/3 + 0] = [11/12, 4/12]
#                   ep 2 [1/3 - 2/12, 1/3 + 7/12, 1/3 + 0] = [2/12, 11/12, 4/12]
#                   ep 3 [-2/3 - 8/12, -2/3 - 5/12, -2/3 + 1/12] = [-16/12, -13/12, -7/12]
HAND_ADVANTAGES = [[11 / 12, 4 / 12], [2 / 12, 11 / 12, 4 / 12], [-16 / 12, -13 / 12, -7 / 12]]


def hand_episodes() -> list[EpisodeTurns]:
    keys = {tuple(A): b"A", tuple(B): b"B"}
    return [EpisodeTurns(sum(r for _, r in turns), [r for _, r in turns], [keys[tuple(s)] for s, _ in turns])
            for turns in HAND]


def test_discounted_turn_returns_by_hand():
    # G_2 = 1, G_1 = 0 + 0.5·1 = 0.5, G_0 = 2 + 0.5·0.5 = 2.25
    torch.testing.assert_close(discounted_turn_returns([2.0, 0.0, 1.0], 0.5), torch.tensor([2.25, 0.5, 1.0],
                                                                                            dtype=torch.float64))
    assert discounted_turn_returns([], 0.9).numel() == 0


def test_gigpo_matches_the_hand_computation():
    got = gigpo_turn_advantages(hand_episodes(), GiGPOSettings(gamma=0.5, step_weight=1.0, norm_by_std=False))
    for advantages, expected in zip(got, HAND_ADVANTAGES):
        torch.testing.assert_close(advantages, torch.tensor(expected))


def test_step_groups_normalised_by_std_and_singletons_give_zero():
    # state X: returns {1, 0}: mean 0.5, unbiased std sqrt(0.5) -> ±0.5 / (sqrt(0.5) + 1e-6); state Y alone -> 0
    got = step_group_advantages([torch.tensor([1.0, 3.0]), torch.tensor([0.0])], [[b"X", b"Y"], [b"X"]])
    a = 0.5 / (0.5 ** 0.5 + 1e-6)
    torch.testing.assert_close(got[0], torch.tensor([a, 0.0]))
    torch.testing.assert_close(got[1], torch.tensor([-a]))


def test_anchor_state_is_the_observation_before_the_turn():
    # prompt [1,2,3] | turn (mask 1) 9,9 | observation [4,5] | turn 9 | observation [1,2,3] | turn 9
    tokens = np.array([1, 2, 3, 9, 9, 4, 5, 9, 1, 2, 3, 9])
    keys = anchor_state_keys(tokens, [(3, 5), (7, 8), (11, 12)])
    assert keys[0] == keys[2] != keys[1]  # the same observation text is the same state, wherever it comes


def episode_trajectory(index: int, turns: list[tuple[list[int], float]]) -> Trajectory:
    """Turn k: the observation ``turns[k][0]`` (turn 0's is the prompt), then two generated tokens (mask 1)."""
    tokens, mask, spans = [], [], []
    for observation, _ in turns:
        tokens += observation
        mask += [0] * len(observation)
        spans.append((len(tokens), len(tokens) + 2))
        tokens += [20 + index, 30 + index]
        mask += [1, 1]
    rewards = [r for _, r in turns]
    logprobs = np.where(np.array(mask) == 1, -1.0, 0.0)
    return Trajectory(
        run_id="test-run", trajectory_id=f"t-{index}", group_id="t", group_size=len(HAND), env="signpost", task_id=0,
        actor_id=0, token_ids=pack(np.array(tokens), TOKEN_DTYPE), loss_mask=pack(np.array(mask), MASK_DTYPE),
        logprobs=pack(logprobs, LOGPROB_DTYPE), prompt_length=len(turns[0][0]), turn_spans=spans,
        turn_versions=[0] * len(spans), turn_epochs=[0] * len(spans), turn_rewards=rewards, reward=sum(rewards),
        success=True, score=sum(rewards), num_turns=len(spans), max_turns=10, stop_reason="done")


def test_each_turn_carries_its_advantage_on_its_generated_tokens_only():
    batch = Batch(run_id="test-run", request_id=1, groups=[[episode_trajectory(i, t) for i, t in enumerate(HAND)]])
    samples, accounting = samples_from_batch(batch, norm_adv_by_std=False, estimator="gigpo",
                                             gigpo=GiGPOSettings(gamma=0.5, step_weight=1.0, norm_by_std=False))
    assert accounting.trained == 3 and accounting.zero_signal == 0
    # 8 turns: state A 6 times, B twice, so every turn has a step group of two or more
    assert accounting.metrics()["batch/turns_in_step_groups"] == 1.0
    micro = collate(samples)
    for row, (trajectory, expected) in enumerate(zip(batch.groups[0], HAND_ADVANTAGES)):
        want = torch.zeros(micro.advantages.shape[1])
        for (start, end), advantage in zip(trajectory.turn_spans, expected):
            want[start:end] = advantage  # observation tokens and padding stay 0
        torch.testing.assert_close(micro.advantages[row], want)


def test_step_weight_zero_is_grpo():
    batch = Batch(run_id="test-run", request_id=1, groups=[[episode_trajectory(i, t) for i, t in enumerate(HAND)]])
    turn_level, _ = samples_from_batch(batch, True, "gigpo", gigpo=GiGPOSettings(gamma=0.5, step_weight=0.0))
    outcome, _ = samples_from_batch(batch, True, "grpo")
    torch.testing.assert_close(collate(turn_level).advantages, collate(outcome).advantages)


def test_equal_returns_keep_a_group_with_turn_level_signal_and_drop_one_without():
    # Kept: both returns are 1 (A^E = 0), but in state A one episode got 1 at once and the other only a turn later:
    # G (γ = 0.5) = [1, 0] and [0.5, 1]; step group A = {1, 0.5, 1} is not constant.
    timing = [[(A, 1.0), (B, 0.0)], [(A, 0.0), (A, 1.0)]]
    # Dropped: nothing rewarded anywhere, every advantage is 0.
    nothing = [[(A, 0.0), (B, 0.0)], [(A, 0.0), (A, 0.0)]]
    batch = Batch(run_id="test-run", request_id=1, groups=[[episode_trajectory(i, t) for i, t in enumerate(timing)],
                                                          [episode_trajectory(i, t) for i, t in enumerate(nothing)]])
    samples, accounting = samples_from_batch(batch, True, "gigpo", gigpo=GiGPOSettings(gamma=0.5))
    assert (accounting.trained, accounting.zero_signal, accounting.groups_trained) == (2, 2, 1)
    assert accounting.metrics()["batch/turns_in_step_groups"] == 3 / 4  # the kept group: A 3 times, B once
    assert all(bool(s.token_advantages.any()) for s in samples)


def test_config_selects_gigpo_and_names_the_estimators_on_a_typo():
    config = load_config(CONFIG, ["algorithm.adv_estimator=gigpo", "algorithm.gigpo_gamma=0.9"])
    settings = AlgorithmSettings.from_config(config).advantage.gigpo
    assert (config.algorithm.adv_estimator, settings.gamma, settings.step_weight) == ("gigpo", 0.9, 1.0)
    with pytest.raises(ConfigError, match="gigpo"):
        load_config(CONFIG, ["algorithm.adv_estimator=gipgo"])
    with pytest.raises(ConfigError, match="gigpo_gamma"):
        load_config(CONFIG, ["algorithm.gigpo_gamma=1.5"])
    with pytest.raises(ConfigError, match="gigpo_step_weight"):
        load_config(CONFIG, ["algorithm.gigpo_step_weight=-1"])


def test_an_episode_of_several_samples_keeps_each_turns_advantage():
    # Episode 2 of the hand example, cut into two samples where the observation before its last turn begins:
    # the pieces carry [2/12, 11/12] and [4/12] on their turns' tokens, as the uncut episode does.
    episodes = [episode_trajectory(i, t) for i, t in enumerate(HAND)]
    cut = episodes[1].turn_spans[1][1]
    episodes[1] = msgspec.structs.replace(episodes[1], sample_starts=[cut])
    batch = Batch(run_id="test-run", request_id=1, groups=[episodes])
    samples, accounting = samples_from_batch(batch, False, "gigpo",
                                             gigpo=GiGPOSettings(gamma=0.5, step_weight=1.0, norm_by_std=False))
    assert accounting.samples_trained == 4 and len(samples) == 4
    joined = torch.cat([samples[1].token_advantages, samples[2].token_advantages])
    want = torch.zeros(joined.numel())
    for (start, end), advantage in zip(episodes[1].turn_spans, HAND_ADVANTAGES[1]):
        want[start:end] = advantage
    torch.testing.assert_close(joined, want)
