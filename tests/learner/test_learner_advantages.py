"""GRPO advantages against hand-computed numbers."""

import math

import torch

from horizonrl.learner.advantages import grouped_advantages, grpo_outcome_advantages, token_advantages


def test_grpo_normalised_by_std():
    # r = [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(((.5²)·4)/3) = sqrt(1/3)
    got = grpo_outcome_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]))
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    torch.testing.assert_close(got, torch.tensor([a, -a, -a, a]))


def test_grpo_without_std():
    got = grpo_outcome_advantages(torch.tensor([3.0, 1.0, 2.0]), norm_by_std=False)
    torch.testing.assert_close(got, torch.tensor([1.0, -1.0, 0.0]))


def test_equal_rewards_and_singletons_give_zero():
    torch.testing.assert_close(grpo_outcome_advantages(torch.tensor([2.0, 2.0])), torch.zeros(2))
    torch.testing.assert_close(grpo_outcome_advantages(torch.tensor([5.0])), torch.zeros(1))


def test_grouped_and_token_advantages():
    groups = grouped_advantages([[1.0, 0.0], [0.0, 0.0, 3.0]], norm_by_std=False)
    assert groups == [[0.5, -0.5], [-1.0, -1.0, 2.0]]
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1]])
    torch.testing.assert_close(
        token_advantages(torch.tensor([0.5, -2.0]), mask), torch.tensor([[0, 0.5, 0.5, 0], [0, 0, -2.0, -2.0]])
    )
