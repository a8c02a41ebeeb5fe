"""GRPO advantages against hand-computed numbers, on the path training runs (samples_from_batch)."""

import math

import numpy as np
import torch

from horizonrl.learner.advantages import grpo_outcome_advantages, token_advantages
from horizonrl.learner.batching import samples_from_batch
from horizonrl.protocol import Batch

from learner_fixtures import trajectory


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


def test_group_advantages_in_a_batch_and_on_tokens():
    rng = np.random.default_rng(0)
    batch = Batch(run_id="test-run", request_id=1, groups=[[trajectory(rng, "a", i, r, 10) for i, r in enumerate([1.0, 0.0])],
                                        [trajectory(rng, "b", i, r, 10) for i, r in enumerate([0.0, 0.0, 3.0])]])
    samples, _ = samples_from_batch(batch, norm_adv_by_std=False)
    assert [s.advantage for s in samples] == [0.5, -0.5, -1.0, -1.0, 2.0]
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1]])
    torch.testing.assert_close(
        token_advantages(torch.tensor([0.5, -2.0]), mask), torch.tensor([[0, 0.5, 0.5, 0], [0, 0, -2.0, -2.0]])
    )
