"""From a :class:`Batch` of groups to the mini-batches (one optimizer update each) and the
micro-batches (one forward/backward each) every rank trains on.

Invariant: every rank holds the same Batch, so every rank computes the same split without
talking to the others, and every rank runs the same number of micro-batches (with FSDP each
forward/backward is a collective; a rank that skipped one would hang the others). Ranks with
a smaller share pad with empty micro-batches that carry no loss tokens.

What enters the step (``samples_from_batch``), and why the rest does not:
- a trajectory with a failure (environment, engine, a prompt too long for the context) never
  does, nor does it count in its group's baseline;
- a trajectory without a generated token has nothing to train and would only drag its group's
  baseline (its reward is not the agent's doing);
- with the outcome estimators (grpo, rloo), a group whose rewards are all equal has advantage 0
  on every token: it carries no policy-gradient signal, and keeping it would only dilute the
  informative groups (token-mean divides by its tokens too) and apply the entropy and KL terms to
  a batch selected for having no signal. Such groups are left out of the step entirely — DAPO's
  dynamic-sampling rule (arXiv 2503.14476, §3.2), applied where the buffer's equal-reward
  fallback lets them through. The token-level estimators (reinforce_plus_plus, gae) keep them:
  their advantages are not zero. With the turn-level estimator (gigpo) a group is left out on the
  same ground only when every turn's advantage is 0: equal returns may still differ turn by turn.
Each exclusion is counted (:class:`BatchAccounting`).

An episode of several samples (a chat template that rewrites history: ``Trajectory.sample_starts``)
enters as one :class:`Sample` per sample — each a sequence of its own, exactly as the engine was
prompted — all carrying the episode's advantage (docs/algorithms.md, "Episodes of several samples").
Selection, baselines and accounting stay per episode.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from horizonrl.learner.packing import PAD_TOKEN_ID, pack_rows  # noqa: F401 - PAD_TOKEN_ID: imported from here

from horizonrl.learner.advantages import (
    OUTCOME_ESTIMATORS,
    discounted_returns,
    outcome_advantages,
    place_token_rewards,
    token_advantages,
)
from horizonrl.learner.turn_advantages import (
    TURN_ESTIMATORS,
    GiGPOSettings,
    episode_turns,
    gigpo_turn_advantages,
    turn_token_advantages,
    turns_sharing_a_state,
)
from horizonrl.protocol import FAILURE_NONE, Batch, Trajectory
from horizonrl.protocol.arrays import LOGPROB_DTYPE, MASK_DTYPE, TOKEN_DTYPE, unpack



@dataclass
class Sample:
    """One sequence of a trajectory (the whole trajectory unless it has several samples) as tensors.
    token_ids/loss_mask/behaviour_logprobs/token_rewards/turn_of_token: (L,).

    ``advantage`` is the outcome estimators' A_i (grpo, rloo); the token-level estimators
    (reinforce_plus_plus, gae) start from ``token_rewards`` instead and leave it 0; the turn-level
    estimator (gigpo) puts each turn's A_{i,k} on that turn's tokens in ``token_advantages``.
    """

    token_ids: torch.Tensor
    loss_mask: torch.Tensor
    behaviour_logprobs: torch.Tensor
    advantage: float
    token_rewards: torch.Tensor | None = None
    group: int = 0  # index of its group among the step's groups that train (for mini-batches)
    token_advantages: torch.Tensor | None = None  # (L,) per-turn A_t (gigpo); replaces ``advantage`` when set
    # The turn (1-based) of each generated token the learner's current weights produced, −1 elsewhere: where the
    # trainer–engine log-probability mismatch is measured (other tokens differ by policy lag too).
    turn_of_token: torch.Tensor | None = None
    turn_index: torch.Tensor | None = None  # (L,) the 1-based turn of every generated token, 0 elsewhere

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
    proximal_logprobs: torch.Tensor | None = None  # (B, T): log π_prox before the step's first update
    turn_of_token: torch.Tensor | None = None  # (B, T): Sample.turn_of_token, −1 on padding
    turn_index: torch.Tensor | None = None  # (B, T): Sample.turn_index, 0 on padding
    # Packed (learner.pack_tokens, :func:`collate_packed`): sequences end to end in one row, each with its own
    # positions 0, 1, ... (B, T), and the index of the sequence each token belongs to (B, T). None: a row per sequence.
    position_ids: torch.Tensor | None = None
    sequence_index: torch.Tensor | None = None

    def to(self, device: torch.device) -> "MicroBatch":
        def move(x):
            return None if x is None else x.to(device)

        return MicroBatch(
            self.input_ids.to(device), self.loss_mask.to(device), self.behaviour_logprobs.to(device),
            self.advantages.to(device), self.num_sequences, move(self.token_rewards), move(self.returns),
            move(self.proximal_logprobs), move(self.turn_of_token), move(self.turn_index), move(self.position_ids),
            move(self.sequence_index),
        )

    @property
    def sequence_of_token(self) -> torch.Tensor:
        """(B, T): which of the micro-batch's sequences each position belongs to (its row when not packed)."""
        if self.sequence_index is not None:
            return self.sequence_index
        return torch.arange(self.input_ids.shape[0], device=self.input_ids.device)[:, None].expand_as(self.input_ids)


def trainable(trajectory: Trajectory) -> bool:
    return trajectory.failure == FAILURE_NONE


@dataclass
class BatchAccounting:
    """What happened to every trajectory of a batch: trained on, or left out for a counted reason."""

    trained: int = 0
    samples_trained: int = 0  # sequences: more than ``trained`` when an episode branched into several samples
    failed: Counter = field(default_factory=Counter)  # failure kind -> trajectories
    no_generated_tokens: int = 0
    zero_signal: int = 0  # in groups whose rewards are all equal (outcome estimators)
    groups_trained: int = 0
    turns: int = 0  # gigpo: turns of the groups that train, and those sharing their anchor state with another turn
    turns_in_step_groups: int = 0
    ids: dict[str, list[str]] = field(default_factory=dict)  # "trained" or the reason left out -> trajectory ids

    def note(self, outcome: str, trajectory: Trajectory) -> None:
        self.ids.setdefault(outcome, []).append(trajectory.trajectory_id)

    def metrics(self) -> dict[str, float]:
        out = {
            "batch/trajectories_trained": float(self.trained),
            "batch/samples_trained": float(self.samples_trained),
            "batch/groups_trained": float(self.groups_trained),
            "batch/failed_skipped": float(sum(self.failed.values())),
            "batch/no_generated_tokens_skipped": float(self.no_generated_tokens),
            "batch/zero_signal_skipped": float(self.zero_signal),
        }
        out.update({f"batch/failed_skipped_{kind}": float(n) for kind, n in self.failed.items()})
        if self.turns:
            out["batch/turns_in_step_groups"] = self.turns_in_step_groups / self.turns
        return out


def samples_from_batch(batch: Batch, norm_adv_by_std: bool, estimator: str = "grpo", gamma: float = 1.0,
                       current_weights: tuple[int, int] | None = None,
                       gigpo: GiGPOSettings | None = None) -> tuple[list[Sample], BatchAccounting]:
    """One Sample per sample of each trajectory that trains (see the module docstring for what does not),
    with its episode's outcome advantage (grpo, rloo), its per-turn advantages (gigpo, with ``gigpo`` or the
    paper's defaults) or 0 (the token-level estimators start from the per-token rewards every Sample
    carries; ``gamma`` carries later samples' return into earlier ones).
    ``current_weights``: the learner's (epoch, version), whose tokens the mismatch metric measures."""
    samples: list[Sample] = []
    accounting = BatchAccounting()
    for group in batch.groups:
        members = []
        for trajectory in group:
            if not trainable(trajectory):
                accounting.failed[trajectory.failure] += 1
                accounting.note(f"failed_{trajectory.failure}", trajectory)
            elif not any(unpack(trajectory.loss_mask, MASK_DTYPE)[1:]):
                accounting.no_generated_tokens += 1
                accounting.note("no_generated_tokens", trajectory)
            else:
                members.append(trajectory)
        if not members:
            continue
        if estimator in TURN_ESTIMATORS:
            group_samples = _turn_level_samples(members, gigpo or GiGPOSettings(norm_by_std=norm_adv_by_std),
                                                accounting, gamma, current_weights)
        elif estimator in OUTCOME_ESTIMATORS and len({t.reward for t in members}) == 1:
            group_samples = []  # a single member, or all rewards equal: A = 0 everywhere
        else:
            if estimator in OUTCOME_ESTIMATORS:
                rewards = torch.tensor([t.reward for t in members])
                advantages = outcome_advantages(rewards, estimator, norm_adv_by_std).tolist()
            else:
                advantages = [0.0] * len(members)
            group_samples = [trajectory_samples(t, a, accounting.groups_trained, gamma, current_weights)
                             for t, a in zip(members, advantages)]
        if not group_samples:
            accounting.zero_signal += len(members)
            for trajectory in members:
                accounting.note("zero_signal", trajectory)
            continue
        for trajectory, pieces in zip(members, group_samples):
            samples += pieces
            accounting.samples_trained += len(pieces)
            accounting.note("trained", trajectory)
        accounting.groups_trained += 1
        accounting.trained += len(members)
    return samples, accounting


def mini_batches(samples: list[Sample], groups_per_mini_batch: int | None) -> list[list[Sample]]:
    """The step's samples cut into mini-batches of whole groups, in batch order (one optimizer update each).

    ``None``: the whole batch is one mini-batch. Every rank computes the same cut.
    """
    if not samples:
        return []
    if groups_per_mini_batch is None:
        return [samples]
    cuts: dict[int, list[Sample]] = {}
    for sample in samples:
        cuts.setdefault(sample.group // groups_per_mini_batch, []).append(sample)
    return [cuts[k] for k in sorted(cuts)]


def _turn_level_samples(members: list[Trajectory], settings: GiGPOSettings, accounting: BatchAccounting,
                        gamma: float, current_weights: tuple[int, int] | None) -> list[list[Sample]]:
    """Each member's Samples with GiGPO's per-turn advantages on their tokens; none when every advantage is 0."""
    episodes = [episode_turns(unpack(t.token_ids, TOKEN_DTYPE), t.turn_spans, t.turn_rewards, t.reward)
                for t in members]
    per_turn = gigpo_turn_advantages(episodes, settings)
    if all(not bool(a.any()) for a in per_turn):
        return []
    accounting.turns += sum(len(e.state_keys) for e in episodes)
    accounting.turns_in_step_groups += turns_sharing_a_state([e.state_keys for e in episodes])
    out = []
    for trajectory, advantages in zip(members, per_turn):
        pieces = trajectory_samples(trajectory, 0.0, accounting.groups_trained, gamma, current_weights)
        mask = torch.from_numpy(unpack(trajectory.loss_mask, MASK_DTYPE).astype("float32"))
        episode = turn_token_advantages(mask, trajectory.turn_spans, advantages)  # (L,) over the whole episode
        for piece, (start, end) in zip(pieces, trajectory.sample_bounds()):
            piece.token_advantages = episode[start:end] * piece.loss_mask
        out.append(pieces)
    return out


def trajectory_samples(trajectory: Trajectory, advantage: float, group: int, gamma: float = 1.0,
                       current_weights: tuple[int, int] | None = None) -> list[Sample]:
    """The trajectory's samples (one unless it has ``sample_starts``), each with the episode's ``advantage``.

    Token rewards are placed on the whole episode, then cut with it. So that a token-level estimator's
    return does not stop at a cut, each sample's last generated token also gets γ·G of the next sample's
    first generated token (G: the episode's discounted return, as ``discounted_returns`` computes it):
    REINFORCE++'s returns are then those of the whole episode, exactly.
    """
    token_ids = unpack(trajectory.token_ids, TOKEN_DTYPE)
    loss_mask = unpack(trajectory.loss_mask, MASK_DTYPE)
    logprobs = unpack(trajectory.logprobs, LOGPROB_DTYPE)
    if not len(token_ids) == len(loss_mask) == len(logprobs):
        raise ValueError(
            f"trajectory {trajectory.trajectory_id}: {len(token_ids)} tokens, {len(loss_mask)} mask entries, "
            f"{len(logprobs)} logprobs"
        )
    mask = torch.from_numpy(loss_mask.astype("float32"))
    mask[0] = 0  # the first token has no prediction (nor has any sample's: a sample starts with its prompt)
    rewards = place_token_rewards(mask, trajectory.turn_spans, trajectory.turn_rewards, trajectory.reward)
    bounds = trajectory.sample_bounds()
    if len(bounds) > 1:
        returns = discounted_returns(rewards[None], mask[None], gamma)[0]
        for (start, end), (next_start, next_end) in zip(bounds, bounds[1:]):
            mine = torch.nonzero(mask[start:end] > 0).flatten()
            later = torch.nonzero(mask[next_start:next_end] > 0).flatten()
            if mine.numel() and later.numel():
                rewards[start + mine[-1]] += gamma * returns[next_start + later[0]]
    turns = _turn_of_token(trajectory, len(token_ids), current_weights)
    turn_index = torch.zeros(len(token_ids), dtype=torch.int64)
    for k, (turn_start, turn_end) in enumerate(trajectory.turn_spans):
        turn_index[turn_start:turn_end] = k + 1
    samples = []
    for start, end in bounds:
        piece = mask[start:end].clone()
        piece[0] = 0  # the first token of a sequence has no prediction
        samples.append(Sample(
            token_ids=torch.from_numpy(token_ids[start:end].astype("int64")), loss_mask=piece,
            behaviour_logprobs=torch.from_numpy(logprobs[start:end].copy()), advantage=advantage,
            token_rewards=rewards[start:end].clone(), group=group, turn_of_token=turns[start:end].clone(),
            turn_index=turn_index[start:end].clone()))
    return samples


def _turn_of_token(trajectory: Trajectory, length: int, current_weights: tuple[int, int] | None) -> torch.Tensor:
    """(L,) the 1-based turn of each generated token whose weights are ``current_weights``, −1 elsewhere."""
    turns = torch.full((length,), -1, dtype=torch.int64)
    if current_weights is None:
        return turns
    spans = trajectory.version_spans or [
        (s, e, epoch, version)
        for (s, e), epoch, version in zip(trajectory.turn_spans, trajectory.turn_epochs, trajectory.turn_versions)]
    turn_ends = [end for _, end in trajectory.turn_spans]
    for start, end, epoch, version in spans:
        if (epoch, version) == tuple(current_weights):
            turns[start:end] = 1 + next(k for k, turn_end in enumerate(turn_ends) if end <= turn_end)
    return turns


def split_across_ranks(samples: list[Sample], world_size: int) -> list[list[Sample]]:
    """Longest first, each to the rank with the fewest tokens so far (deterministic on every rank)."""
    shares: list[list[Sample]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    for index in sorted(range(len(samples)), key=lambda i: (-samples[i].num_tokens, i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        shares[rank].append(samples[index])
        loads[rank] += samples[index].num_tokens
    return shares


def pack_micro_batches(share: list[Sample], max_sequences: int, max_tokens: int | None = None) -> list[list[Sample]]:
    """One rank's share cut into micro-batches, in order: at most ``max_sequences`` trajectories and,
    with ``max_tokens``, at most that many padded tokens (rows × the longest row: what the forward pass
    allocates). A trajectory longer than ``max_tokens`` on its own is a micro-batch of its own."""
    chunks: list[list[Sample]] = []
    current: list[Sample] = []
    longest = 0
    for sample in share:
        grown = max(longest, sample.num_tokens)
        fits = len(current) < max_sequences and (max_tokens is None or (len(current) + 1) * grown <= max_tokens)
        if current and not fits:
            chunks.append(current)
            current, grown = [], sample.num_tokens
        current.append(sample)
        longest = grown
    if current:
        chunks.append(current)
    return chunks


def micro_batches_for_rank(
    samples: list[Sample], rank: int, world_size: int, micro_batch_size: int, max_tokens: int | None = None,
    pack_tokens: int | None = None,
) -> list[MicroBatch]:
    """This rank's micro-batches, padded with empty ones to the count of the busiest rank.

    Every rank packs every rank's share (cheap, and identical everywhere), so all agree on the count.
    ``pack_tokens``: each micro-batch is one row of sequences end to end, at most that many tokens
    (learner/packing.py), instead of ``micro_batch_size`` padded rows."""
    shares = split_across_ranks(samples, world_size)
    if pack_tokens is not None:
        packed = [[[share[i] for i in row] for row in pack_rows([s.num_tokens for s in share], pack_tokens)]
                  for share in shares]
        build = collate_packed
    else:
        packed = [pack_micro_batches(share, micro_batch_size, max_tokens) for share in shares]
        build = collate
    count = max(1, max(len(chunks) for chunks in packed))
    chunks = packed[rank]
    return [build(chunk) for chunk in chunks] + [empty_micro_batch() for _ in range(count - len(chunks))]


def collate_packed(samples: list[Sample]) -> MicroBatch:
    """``samples`` end to end in one row (B = 1), each with its own positions from 0 and its index in
    ``sequence_index``; every per-token field as :func:`collate` makes it for the sample alone. Each sample's
    first token has loss mask 0 (Sample's invariant), so no token is predicted across a boundary."""
    alone = [collate([sample]) for sample in samples]

    def joined(field: str) -> torch.Tensor | None:
        parts = [getattr(mb, field) for mb in alone]
        return None if any(p is None for p in parts) else torch.cat(parts, dim=1)

    lengths = [s.num_tokens for s in samples]
    return MicroBatch(
        joined("input_ids"), joined("loss_mask"), joined("behaviour_logprobs"), joined("advantages"), len(samples),
        token_rewards=joined("token_rewards"), turn_of_token=joined("turn_of_token"),
        turn_index=joined("turn_index"),
        position_ids=torch.cat([torch.arange(n) for n in lengths])[None],
        sequence_index=torch.cat([torch.full((n,), i, dtype=torch.int64) for i, n in enumerate(lengths)])[None])


def collate(samples: list[Sample]) -> MicroBatch:
    length = max(s.num_tokens for s in samples)
    input_ids = torch.full((len(samples), length), PAD_TOKEN_ID, dtype=torch.int64)
    loss_mask = torch.zeros(len(samples), length)
    logprobs = torch.zeros(len(samples), length)
    rewards = torch.zeros(len(samples), length)
    turns = torch.full((len(samples), length), -1, dtype=torch.int64)
    turn_index = torch.zeros((len(samples), length), dtype=torch.int64)
    for row, sample in enumerate(samples):
        n = sample.num_tokens
        input_ids[row, :n] = sample.token_ids
        loss_mask[row, :n] = sample.loss_mask
        logprobs[row, :n] = sample.behaviour_logprobs
        if sample.token_rewards is not None:
            rewards[row, :n] = sample.token_rewards
        if sample.turn_of_token is not None:
            turns[row, :n] = sample.turn_of_token
        if sample.turn_index is not None:
            turn_index[row, :n] = sample.turn_index
    loss_mask[:, 0] = 0  # the first token has no prediction
    advantages = token_advantages(torch.tensor([s.advantage for s in samples]), loss_mask)
    for row, sample in enumerate(samples):
        if sample.token_advantages is not None:  # turn-level: A_t per token instead of one A_i per row
            advantages[row, :sample.num_tokens] = sample.token_advantages * loss_mask[row, :sample.num_tokens]
    return MicroBatch(input_ids, loss_mask, logprobs, advantages, len(samples), token_rewards=rewards,
                      turn_of_token=turns, turn_index=turn_index)


def empty_micro_batch() -> MicroBatch:
    zero = torch.zeros(1, 1)
    return MicroBatch(torch.full((1, 1), PAD_TOKEN_ID, dtype=torch.int64), zero, zero.clone(), zero.clone(), 0,
                      token_rewards=zero.clone())
