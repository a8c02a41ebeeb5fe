"""Every advantage estimator against small multi-turn examples computed by hand.

The running example: one trajectory of 10 tokens

    position  0 1 2 | 3 4 | 5 6 | 7 8 | 9
    role      prompt | gen | obs | gen | obs        (ENDS on an observation, as most episodes do)
    mask      0 0 0  | 1 1 | 0 0 | 1 1 | 0

with turn rewards [0.5, 1.0]: r_4 = 0.5 (last generated token of turn 1), r_8 = 1.0 (of turn 2).
AgentGym-RL put the outcome on position 9, which the mask removes: all advantages 0.
"""

import math

import numpy as np
import pytest
import torch

from horizonrl.learner.advantages import (
    discounted_returns,
    gae_advantages,
    masked_moments,
    outcome_advantages,
    place_token_rewards,
    rloo_outcome_advantages,
    whiten,
)
from horizonrl.learner.batching import samples_from_batch
from horizonrl.protocol import Batch

from learner_fixtures import trajectory

MASK = torch.tensor([0, 0, 0, 1, 1, 0, 0, 1, 1, 0], dtype=torch.float32)
SPANS = [(3, 5), (7, 9)]


def test_rewards_sit_on_the_last_generated_token_of_each_turn():
    r = place_token_rewards(MASK, SPANS, [0.5, 1.0], reward=1.5)
    assert r.tolist() == [0, 0, 0, 0, 0.5, 0, 0, 0, 1.0, 0]
    # outcome-only trajectory (no per-turn rewards): the whole return on the last generated token
    r = place_token_rewards(MASK, SPANS, [0.0, 0.0], reward=2.0)
    assert r.tolist() == [0, 0, 0, 0, 0, 0, 0, 0, 2.0, 0]
    # a turn reward that cannot be placed (its turn has no generated token) still reaches the loss
    r = place_token_rewards(MASK, SPANS + [(9, 9)], [0.5, 1.0, 0.25], reward=1.75)
    assert r.tolist() == [0, 0, 0, 0, 0.5, 0, 0, 0, 1.25, 0]


def test_reinforce_plus_plus_returns_skip_observations():
    r = place_token_rewards(MASK, SPANS, [0.5, 1.0], reward=1.5)[None]
    gamma = 0.9
    got = discounted_returns(r, MASK[None], gamma)[0]
    # generated tokens, from the end: G_8 = 1, G_7 = 0.9, G_4 = 0.5 + 0.81 = 1.31, G_3 = 0.9 * 1.31
    g8, g7 = 1.0, 0.9
    g4 = 0.5 + gamma * g7
    g3 = gamma * g4
    expected = [g3, g3, g3, g3, g4, g7, g7, g7, g8, 0.0]  # observations pass the next action's G through
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-6)
    assert torch.all(got[MASK.bool()] != 0)  # ends on an observation, yet every action has a return


def test_reinforce_plus_plus_whitening_is_over_the_whole_batch():
    r = torch.stack([place_token_rewards(MASK, SPANS, [0.0, 1.0], 1.0), torch.zeros(10)])
    mask = torch.stack([MASK, MASK])
    g = discounted_returns(r, mask, 1.0)  # first row: 1 on its 4 actions; second: 0 on its 4
    moments = masked_moments(g[:1], mask[:1]) + masked_moments(g[1:], mask[1:])  # as two micro-batches
    a = whiten(g, mask, moments)
    # mean 0.5, population std 0.5 -> +1 / -1
    np.testing.assert_allclose(a[0][MASK.bool()].numpy(), [1.0] * 4, rtol=1e-6)
    np.testing.assert_allclose(a[1][MASK.bool()].numpy(), [-1.0] * 4, rtol=1e-6)
    assert torch.all(a[:, ~MASK.bool()] == 0)


def test_gae_hand_computed_on_a_trajectory_ending_on_an_observation():
    r = place_token_rewards(MASK, SPANS, [0.0, 1.0], reward=1.0)[None]
    values = torch.tensor([[0, 0, 0, 0.2, 0.3, 9, 9, 0.4, 0.6, 9]])  # 9s: off the actions, never read
    gamma, lam = 0.9, 0.8
    adv, ret = gae_advantages(r, values, MASK[None], gamma, lam)
    # actions t = 3, 4, 7, 8 (next action of 4 is 7: observations are not steps)
    d8 = 1.0 + gamma * 0.0 - 0.6
    d7 = 0.0 + gamma * 0.6 - 0.4
    d4 = 0.0 + gamma * 0.4 - 0.3
    d3 = 0.0 + gamma * 0.3 - 0.2
    a8 = d8
    a7 = d7 + gamma * lam * a8
    a4 = d4 + gamma * lam * a7
    a3 = d3 + gamma * lam * a4
    np.testing.assert_allclose(adv[0, [3, 4, 7, 8]].numpy(), [a3, a4, a7, a8], rtol=1e-6)
    np.testing.assert_allclose(ret[0, [3, 4, 7, 8]].numpy(), [a3 + 0.2, a4 + 0.3, a7 + 0.4, a8 + 0.6], rtol=1e-6)
    np.testing.assert_allclose(adv[0, [5, 6]].numpy(), [a7, a7], rtol=1e-6)  # passed through
    assert adv[0, 9] == 0 and all(abs(x) > 1e-3 for x in (a3, a4, a7, a8))


def test_gae_with_lambda_one_and_no_discount_is_return_minus_value():
    r = place_token_rewards(MASK, SPANS, [0.5, 1.0], reward=1.5)[None]
    values = torch.tensor([[0, 0, 0, 0.1, 0.2, 0, 0, 0.3, 0.4, 0]])
    adv, ret = gae_advantages(r, values, MASK[None], 1.0, 1.0)
    # returns with γ = 1 at the actions 3, 4, 7, 8: G_8 = 1, G_7 = 1, G_4 = 0.5 + 1 = 1.5, G_3 = 1.5
    np.testing.assert_allclose(adv[0, [3, 4, 7, 8]].numpy(), [1.5 - 0.1, 1.5 - 0.2, 1.0 - 0.3, 1.0 - 0.4], rtol=1e-6)
    np.testing.assert_allclose(ret[0, [3, 4, 7, 8]].numpy(), [1.5, 1.5, 1.0, 1.0], rtol=1e-6)


def test_rloo_leave_one_out():
    got = rloo_outcome_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]))
    # r_1 - mean(0, 0, 1) = 1 - 1/3
    np.testing.assert_allclose(got.numpy(), [2 / 3, -2 / 3, -2 / 3, 2 / 3], rtol=1e-6)
    np.testing.assert_allclose(rloo_outcome_advantages(torch.tensor([3.0, 1.0, 2.0])).numpy(), [1.5, -1.5, 0.0])
    assert rloo_outcome_advantages(torch.tensor([4.0])).tolist() == [0.0]


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_via_the_dispatcher(norm):
    got = outcome_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), "grpo", norm)
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6) if norm else 0.5
    np.testing.assert_allclose(got.numpy(), [a, -a, -a, a], rtol=1e-6)


def test_samples_carry_rewards_on_generated_tokens_for_every_estimator():
    rng = np.random.default_rng(0)
    group = [trajectory(rng, "g", i, r, 16) for i, r in enumerate([1.0, 0.0, 0.0, 1.0])]
    batch = Batch(run_id="test-run", request_id=1, groups=[group])
    for estimator in ("grpo", "rloo", "reinforce_plus_plus", "gae"):
        samples, _ = samples_from_batch(batch, True, estimator)
        for sample, t in zip(samples, group):
            nz = torch.nonzero(sample.token_rewards).flatten().tolist()
            assert sample.token_rewards.sum().item() == pytest.approx(t.reward)
            assert all(sample.loss_mask[i] == 1 for i in nz)
        if estimator == "rloo":
            np.testing.assert_allclose([s.advantage for s in samples], [2 / 3, -2 / 3, -2 / 3, 2 / 3], rtol=1e-6)
        if estimator in ("reinforce_plus_plus", "gae"):
            assert all(s.advantage == 0.0 for s in samples)
