"""What enters a step, mini-batches, per-rank micro-batches, and the batch metrics."""

import numpy as np
import pytest
import torch

from horizonrl.learner.batching import micro_batches_for_rank, mini_batches, samples_from_batch, split_across_ranks
from horizonrl.learner.loop import batch_metrics
from horizonrl.protocol import Batch

from learner_fixtures import groups, trajectory


def test_failed_trajectories_are_skipped_and_left_out_of_the_baseline():
    samples, accounting = samples_from_batch(Batch(run_id="test-run", request_id=1, groups=groups()), norm_adv_by_std=False)
    assert accounting.failed == {"environment": 1} and accounting.trained == len(samples) == 7
    # group g1 without its failed member: rewards [0.5, 0, 1], mean 0.5
    assert [s.advantage for s in samples[4:]] == [0.0, -0.5, 0.5]
    assert [s.advantage for s in samples[:4]] == [0.5, -0.5, -0.5, 0.5]


def test_every_rank_runs_the_same_number_of_micro_batches():
    samples, _ = samples_from_batch(Batch(run_id="test-run", request_id=1, groups=groups()), norm_adv_by_std=True)
    shares = split_across_ranks(samples, 3)
    assert sorted(id(s) for share in shares for s in share) == sorted(id(s) for s in samples)
    per_rank = [micro_batches_for_rank(samples, rank, 3, micro_batch_size=2) for rank in range(3)]
    assert len({len(mbs) for mbs in per_rank}) == 1
    assert sum(mb.num_sequences for mbs in per_rank for mb in mbs) == 7
    tokens = sum(float(mb.loss_mask.sum()) for mbs in per_rank for mb in mbs)
    assert tokens == sum(s.num_loss_tokens for s in samples)
    # more ranks than trajectories: the idle ranks still run one (empty) micro-batch
    idle = micro_batches_for_rank(samples[:1], 1, 2, micro_batch_size=2)
    assert len(idle) == 1 and idle[0].num_sequences == 0 and float(idle[0].loss_mask.sum()) == 0


def test_micro_batch_is_right_padded_with_advantages_on_generated_tokens():
    samples, _ = samples_from_batch(Batch(run_id="test-run", request_id=1, groups=groups()), norm_adv_by_std=True)
    (mb,) = micro_batches_for_rank(samples[:2], 0, 1, micro_batch_size=2)
    n0, n1 = samples[0].num_tokens, samples[1].num_tokens
    assert mb.input_ids.shape == (2, max(n0, n1))
    torch.testing.assert_close(mb.input_ids[1, :n1], samples[1].token_ids)
    assert torch.all(mb.loss_mask[1, n1:] == 0)
    # group g0 has rewards [1, 0, 0, 1]: A_0 = 0.5 / (sqrt(1/3) + 1e-6), on its generated tokens only
    a0 = 0.5 / (np.sqrt(1 / 3) + 1e-6)
    generated = samples[0].loss_mask.bool()
    torch.testing.assert_close(mb.advantages[0, :n0][generated], torch.full((int(generated.sum()),), a0))
    assert torch.all(mb.advantages[0, :n0][~generated] == 0) and torch.all(mb.advantages[0, n0:] == 0)


def test_batch_metrics():
    batch = Batch(run_id="test-run", request_id=1, groups=groups(), buffer_stats={"depth": 2})
    metrics = batch_metrics(batch, learner_version=3)
    assert metrics["batch/groups"] == 2 and metrics["batch/trajectories"] == 8
    assert metrics["batch/staleness_max"] == 3 and metrics["buffer/depth"] == 2.0
    rewards = [t.reward for g in batch.groups for t in g]
    assert np.isclose(metrics["batch/reward_mean"], np.mean(rewards))
    assert np.isclose(metrics["env/fake/success_mean"], np.mean([r > 0 for r in rewards]))


def _zero_turn(rng, group, index):
    """A trajectory with no generated token (the prompt alone filled the context), not marked failed."""
    t = trajectory(rng, group, index, 0.0, 4)  # 4 tokens: the prompt only
    assert t.num_turns == 0
    return t


def test_a_trajectory_without_generated_tokens_stays_out_of_its_groups_baseline():
    rng = np.random.default_rng(3)
    group = [trajectory(rng, "g", i, r, 12) for i, r in enumerate([1.0, 0.0, 1.0])] + [_zero_turn(rng, "g", 3)]
    samples, accounting = samples_from_batch(Batch(run_id="test-run", request_id=1, groups=[group]), norm_adv_by_std=False)
    assert accounting.no_generated_tokens == 1 and len(samples) == 3
    # baseline over the three played episodes: mean 2/3 (with the zero-turn one it would be 1/2)
    assert [s.advantage for s in samples] == pytest.approx([1 / 3, -2 / 3, 1 / 3])


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_equal_reward_groups_carry_no_signal_and_stay_out_of_the_step(estimator):
    rng = np.random.default_rng(4)
    informative = [trajectory(rng, "a", i, r, 12) for i, r in enumerate([1.0, 0.0])]
    equal = [trajectory(rng, "b", i, 1.0, 12) for i in range(3)]
    samples, accounting = samples_from_batch(Batch(run_id="test-run", request_id=1, groups=[equal, informative]), True, estimator)
    assert [s.group for s in samples] == [0, 0] and accounting.zero_signal == 3 and accounting.groups_trained == 1
    metrics = accounting.metrics()
    assert metrics["batch/zero_signal_skipped"] == 3 and metrics["batch/trajectories_trained"] == 2


def test_token_level_estimators_keep_equal_reward_groups():
    rng = np.random.default_rng(4)
    equal = [trajectory(rng, "b", i, 1.0, 12) for i in range(3)]
    samples, accounting = samples_from_batch(Batch(run_id="test-run", request_id=1, groups=[equal]), True, "gae")
    assert len(samples) == 3 and accounting.zero_signal == 0


def test_mini_batches_are_whole_groups_in_batch_order():
    rng = np.random.default_rng(5)
    batch = Batch(run_id="test-run", request_id=1, groups=[[trajectory(rng, f"g{k}", i, float(i), 10) for i in range(2)] for k in range(5)])
    samples, _ = samples_from_batch(batch, True)
    cuts = mini_batches(samples, 2)
    assert [[s.group for s in cut] for cut in cuts] == [[0, 0, 1, 1], [2, 2, 3, 3], [4, 4]]
    assert mini_batches(samples, None) == [samples] and mini_batches([], 2) == []
