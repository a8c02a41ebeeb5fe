"""Splitting a Batch into per-rank micro-batches, and the batch metrics."""

import numpy as np
import torch

from horizonrl.learner.batching import micro_batches_for_rank, samples_from_batch, split_across_ranks
from horizonrl.learner.main import batch_metrics
from horizonrl.protocol import Batch

from learner_fixtures import groups


def test_failed_trajectories_are_skipped_and_left_out_of_the_baseline():
    samples, skipped = samples_from_batch(Batch(request_id=1, groups=groups()), norm_adv_by_std=False)
    assert skipped == 1 and len(samples) == 7
    # group g1 without its failed member: rewards [0.5, 0, 1], mean 0.5
    assert [s.advantage for s in samples[4:]] == [0.0, -0.5, 0.5]
    assert [s.advantage for s in samples[:4]] == [0.5, -0.5, -0.5, 0.5]


def test_every_rank_runs_the_same_number_of_micro_batches():
    samples, _ = samples_from_batch(Batch(request_id=1, groups=groups()), norm_adv_by_std=True)
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
    samples, _ = samples_from_batch(Batch(request_id=1, groups=groups()), norm_adv_by_std=True)
    (mb,) = micro_batches_for_rank(samples[:2], 0, 1, micro_batch_size=2)
    n0, n1 = samples[0].num_tokens, samples[1].num_tokens
    assert mb.input_ids.shape == (2, max(n0, n1))
    torch.testing.assert_close(mb.input_ids[1, :n1], samples[1].token_ids)
    assert torch.all(mb.loss_mask[1, n1:] == 0)
    expected = samples[0].advantage * samples[0].loss_mask
    torch.testing.assert_close(mb.advantages[0, :n0], expected)


def test_batch_metrics():
    batch = Batch(request_id=1, groups=groups(), buffer_stats={"depth": 2})
    metrics = batch_metrics(batch, learner_version=3)
    assert metrics["batch/groups"] == 2 and metrics["batch/trajectories"] == 8
    assert metrics["batch/staleness_max"] == 3 and metrics["buffer/depth"] == 2.0
    rewards = [t.reward for g in batch.groups for t in g]
    assert np.isclose(metrics["batch/reward_mean"], np.mean(rewards))
    assert np.isclose(metrics["env/fake/success_mean"], np.mean([r > 0 for r in rewards]))
