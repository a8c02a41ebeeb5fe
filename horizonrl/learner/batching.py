"""From a :class:`Batch` of groups to the micro-batches each rank trains on.

Invariant: every rank holds the same Batch, so every rank computes the same split without
talking to the others, and every rank runs the same number of micro-batches (with FSDP each
forward/backward is a collective; a rank that skipped one would hang the others). Ranks with
a smaller share pad with empty micro-batches that carry no loss tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from horizonrl.learner.advantages import OUTCOME_ESTIMATORS, outcome_advantages, place_token_rewards, token_advantages
from horizonrl.protocol import FAILURE_NONE, Batch, Trajectory
from horizonrl.protocol.arrays import LOGPROB_DTYPE, MASK_DTYPE, TOKEN_DTYPE, unpack

PAD_TOKEN_ID = 0  # right padding: with causal attention it never influences real tokens


@dataclass
class Sample:
    """One trajectory as tensors. token_ids/loss_mask/behaviour_logprobs/token_rewards: (L,).

    ``advantage`` is the outcome estimators' A_i (grpo, rloo); the token-level estimators
    (reinforce_plus_plus, gae) start from ``token_rewards`` instead and leave it 0.
    """

    token_ids: torch.Tensor
    loss_mask: torch.Tensor
    behaviour_logprobs: torch.Tensor
    advantage: float
    token_rewards: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.numel())

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask[1:].sum())  # token 0 has no prediction; it is never generated


@dataclass
class MicroBatch:
    """Right-padded tensors of shape (B, T); an empty micro-batch has B = 1, T = 1 and no loss tokens."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    behaviour_logprobs: torch.Tensor
    advantages: torch.Tensor  # (B, T): A_t on generated tokens (outcome estimators: A_i broadcast)
    num_sequences: int
    token_rewards: torch.Tensor | None = None  # (B, T): r_t on the last generated token of each turn
    returns: torch.Tensor | None = None  # (B, T): the critic's target (gae)

    def to(self, device: torch.device) -> "MicroBatch":
        def move(x):
            return None if x is None else x.to(device)

        return MicroBatch(
            self.input_ids.to(device), self.loss_mask.to(device), self.behaviour_logprobs.to(device),
            self.advantages.to(device), self.num_sequences, move(self.token_rewards), move(self.returns),
        )


def trainable(trajectory: Trajectory) -> bool:
    return trajectory.failure == FAILURE_NONE


def samples_from_batch(batch: Batch, norm_adv_by_std: bool, estimator: str = "grpo") -> tuple[list[Sample], int]:
    """Outcome advantages per group (grpo, rloo), then one Sample per trainable trajectory;
    every Sample also carries its per-token rewards for the token-level estimators.

    Trajectories with a failure are never trained on (the buffer filters them already; this
    is the defensive second line) and are left out of their group's baseline too.
    Returns (samples, number of failed trajectories skipped).
    """
    samples: list[Sample] = []
    skipped = 0
    for group in batch.groups:
        members = [t for t in group if trainable(t)]
        skipped += len(group) - len(members)
        if not members:
            continue
        if estimator in OUTCOME_ESTIMATORS:
            advantages = outcome_advantages(torch.tensor([t.reward for t in members]), estimator, norm_adv_by_std).tolist()
        else:
            advantages = [0.0] * len(members)
        for trajectory, advantage in zip(members, advantages):
            samples.append(_sample(trajectory, advantage))
    return samples, skipped


def _sample(trajectory: Trajectory, advantage: float) -> Sample:
    token_ids = unpack(trajectory.token_ids, TOKEN_DTYPE)
    loss_mask = unpack(trajectory.loss_mask, MASK_DTYPE)
    logprobs = unpack(trajectory.logprobs, LOGPROB_DTYPE)
    if not len(token_ids) == len(loss_mask) == len(logprobs):
        raise ValueError(
            f"trajectory {trajectory.trajectory_id}: {len(token_ids)} tokens, {len(loss_mask)} mask entries, "
            f"{len(logprobs)} logprobs"
        )
    mask = torch.from_numpy(loss_mask.astype("float32"))
    mask[0] = 0  # the first token has no prediction
    return Sample(
        token_ids=torch.from_numpy(token_ids.astype("int64")),
        loss_mask=mask,
        behaviour_logprobs=torch.from_numpy(logprobs.copy()),
        advantage=advantage,
        token_rewards=place_token_rewards(mask, trajectory.turn_spans, trajectory.turn_rewards, trajectory.reward),
    )


def split_across_ranks(samples: list[Sample], world_size: int) -> list[list[Sample]]:
    """Longest first, each to the rank with the fewest tokens so far (deterministic on every rank)."""
    shares: list[list[Sample]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    for index in sorted(range(len(samples)), key=lambda i: (-samples[i].num_tokens, i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        shares[rank].append(samples[index])
        loads[rank] += samples[index].num_tokens
    return shares


def micro_batches_for_rank(
    samples: list[Sample], rank: int, world_size: int, micro_batch_size: int
) -> list[MicroBatch]:
    """This rank's micro-batches, padded with empty ones to the count of the busiest rank."""
    shares = split_across_ranks(samples, world_size)
    count = max(1, max(math.ceil(len(share) / micro_batch_size) for share in shares))
    share = shares[rank]
    chunks = [share[i : i + micro_batch_size] for i in range(0, len(share), micro_batch_size)]
    return [collate(chunk) for chunk in chunks] + [empty_micro_batch() for _ in range(count - len(chunks))]


def collate(samples: list[Sample]) -> MicroBatch:
    length = max(s.num_tokens for s in samples)
    input_ids = torch.full((len(samples), length), PAD_TOKEN_ID, dtype=torch.int64)
    loss_mask = torch.zeros(len(samples), length)
    logprobs = torch.zeros(len(samples), length)
    rewards = torch.zeros(len(samples), length)
    for row, sample in enumerate(samples):
        n = sample.num_tokens
        input_ids[row, :n] = sample.token_ids
        loss_mask[row, :n] = sample.loss_mask
        logprobs[row, :n] = sample.behaviour_logprobs
        if sample.token_rewards is not None:
            rewards[row, :n] = sample.token_rewards
    loss_mask[:, 0] = 0  # the first token has no prediction
    advantages = token_advantages(torch.tensor([s.advantage for s in samples]), loss_mask)
    return MicroBatch(input_ids, loss_mask, logprobs, advantages, len(samples), token_rewards=rewards)


def empty_micro_batch() -> MicroBatch:
    zero = torch.zeros(1, 1)
    return MicroBatch(torch.full((1, 1), PAD_TOKEN_ID, dtype=torch.int64), zero, zero.clone(), zero.clone(), 0,
                      token_rewards=zero.clone())
