"""The algorithm, read top to bottom: one learner step, from a batch of groups to the optimizer updates.

The config is read once, here (:class:`AlgorithmSettings`); every stage below receives plain settings, and the
equations sit beside their lines in the modules named at each stage, which hold the math alone (no config, no
process group): ``batching.py``, ``advantages.py``, ``turn_advantages.py``, ``rollout_correction.py``,
``policy_loss.py``.

    settings     AlgorithmSettings.from_config: the loss, the advantages, the updates
    batch        samples_from_batch (batching.py): the trajectories that train, one Sample per sample;
                 what is left out is counted (failed, no generated token, no signal)
    advantages   one dispatcher, by ``algorithm.adv_estimator`` (ESTIMATOR_STAGES):
                 grpo, rloo     per episode, against its group (advantages.py), on the samples
                 gigpo          per turn, episodes grouped by anchor state (turn_advantages.py), on the samples
                 reinforce_plus_plus   discounted returns, whitened over the whole step   (token_level_advantages)
                 gae            the critic's values (a no-grad forward), GAE, whitened likewise (token_level_advantages)
    proximal     decoupled PPO with more than one update: log π_prox of every token, in a no-grad
                 forward before the first update (the trust region every update is clipped to)
    correction   per token, from ρ = π_old / μ: truncated or masked importance weights, per-turn
                 rejection (rollout_correction.py); its factor weighs the token's policy term
    loss         per micro-batch the clipped policy loss − β·entropy + kl_coef·KL(π‖π_ref)
                 (+ vf_coef·½(V − R)² for the critic), aggregated with the mini-batch's global
                 weights (policy_loss.py)
    updates      for each epoch, for each mini-batch of ``ppo_mini_batch_size`` groups: the gradient over
                 this rank's micro-batches, grad clip, an AdamW step for the policy (and the critic)
    mismatch     per-turn |log π_θ − log π_behaviour| in the first update (mismatch.py)
    schedule     the learning rate, once per learner step (lr_multiplier)

:func:`train_step_function` runs these stages for the learner's loop (loop.py), one call per step.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from horizonrl.learner.advantages import (OUTCOME_ESTIMATORS, TOKEN_ESTIMATORS, discounted_returns, gae_advantages,
                                        masked_moments, whiten)
from horizonrl.learner.batching import MicroBatch, Sample, micro_batches_for_rank, mini_batches, samples_from_batch
from horizonrl.learner.loop import StepOutcome
from horizonrl.learner.mismatch import TurnMismatch
from horizonrl.learner.model import loss_token_logits
from horizonrl.learner.policy_loss import (
    LOGPROB_FLOOR,
    ClipSettings,
    PolicyLossStats,
    aggregation_weights,
    clipped_policy_loss,
    kl_penalty,
    token_logprobs,
    token_logprobs_and_entropy,
)
from horizonrl.learner.rollout_correction import CorrectionSettings, CorrectionStats, rollout_correction
from horizonrl.learner.step_watchdog import StepWatchdog
from horizonrl.learner.turn_advantages import TURN_ESTIMATORS, GiGPOSettings


@dataclass(frozen=True)
class LossSettings:
    """What each token's loss term is made of (stages correction and loss)."""

    temperature: float = 1.0
    top_p: float = 1.0  # the engine's nucleus: log-probabilities are taken over the same distribution
    clip: ClipSettings = ClipSettings()
    loss_agg_mode: str = "token-mean"
    entropy_coeff: float = 0.0
    kl_loss_coef: float = 0.0  # 0: no reference model
    kl_loss_type: str = "low_var_kl"
    vf_coef: float = 0.5
    correction: CorrectionSettings = CorrectionSettings()  # none unless configured (the config's default: token TIS)


@dataclass(frozen=True)
class AdvantageSettings:
    """Which estimator, and its parameters (stage advantages)."""

    estimator: str = "grpo"
    gamma: float = 1.0
    lam: float = 1.0  # GAE's λ
    whiten_gae: bool = True
    norm_by_std: bool = True  # grpo: (R − mean) / std, not R − mean
    gigpo: GiGPOSettings = GiGPOSettings()


@dataclass(frozen=True)
class UpdateSettings:
    """How one learner step turns its batch into optimizer updates."""

    ppo_epochs: int = 1
    ppo_mini_batch_size: int | None = None  # groups per update; None: the whole batch
    micro_batch_size: int = 16  # trajectories per forward/backward on one rank
    grad_clip: float = 1.0
    max_tokens_per_micro_batch: int | None = None  # padded tokens per forward/backward; None: no token cap
    pack_tokens: int | None = None  # each micro-batch one row of sequences end to end (learner/packing.py)


@dataclass(frozen=True)
class AlgorithmSettings:
    """The step's typed view of the run's config: the only place the algorithm reads ``TrainConfig``."""

    loss: LossSettings = field(default_factory=LossSettings)
    advantage: AdvantageSettings = field(default_factory=AdvantageSettings)
    update: UpdateSettings = field(default_factory=UpdateSettings)

    @classmethod
    def from_config(cls, config) -> "AlgorithmSettings":
        a, lc, rc = config.algorithm, config.learner, config.algorithm.rollout_correction
        low, high = rc.reject_bounds
        loss = LossSettings(
            temperature=config.rollout.temperature,
            top_p=config.rollout.top_p,
            clip=ClipSettings(lc.clip_low, lc.clip_high, lc.clip_ratio_c, lc.decoupled_loss),
            correction=CorrectionSettings(
                is_level=None if rc.is_level == "none" else rc.is_level, is_cap=rc.is_cap,
                reject_level=None if rc.reject_level == "none" else rc.reject_level, reject_low=low, reject_high=high,
                turn_action=None if rc.turn_reject == "none" else rc.turn_reject, turn_kl_bound=rc.turn_kl_bound),
            loss_agg_mode=lc.loss_agg_mode,
            entropy_coeff=lc.entropy_coeff,
            kl_loss_coef=lc.kl_loss_coef if lc.use_kl_loss else 0.0,
            kl_loss_type=lc.kl_loss_type,
            vf_coef=a.vf_coef,
        )
        advantage = AdvantageSettings(a.adv_estimator, a.gamma, a.lam, a.whiten_gae_advantages,
                                      a.norm_adv_by_std_in_grpo,
                                      GiGPOSettings(a.gigpo_gamma, a.gigpo_step_weight, a.norm_adv_by_std_in_grpo))
        update = UpdateSettings(lc.ppo_epochs, lc.ppo_mini_batch_size, lc.micro_batch_size, lc.grad_clip,
                                lc.micro_batch_token_cap, lc.pack_tokens)
        return cls(loss, advantage, update)


# Stage advantages, one dispatcher: where each estimator's advantages are computed. The episode- and turn-level
# ones need whole groups, so they are set on the samples before the batch is split across ranks; the token-level
# ones need the critic and the whole step's moments, so they are set on each rank's micro-batches after the split.
ESTIMATOR_STAGES = {**{name: "episode" for name in OUTCOME_ESTIMATORS}, **{name: "turn" for name in TURN_ESTIMATORS},
                    **{name: "token" for name in TOKEN_ESTIMATORS}}


@dataclass
class Trainables:
    """What the optimizer steps touch, and what a checkpoint holds."""

    model: Any
    optimizer: Any
    scheduler: Any
    reference: Any = None  # frozen π_ref (learner.use_kl_loss)
    critic: Any = None  # value model (adv_estimator=gae)
    critic_optimizer: Any = None
    critic_scheduler: Any = None

    def checkpoint_parts(self) -> dict[str, Any]:
        return dict(model=self.model, optimizer=self.optimizer, scheduler=self.scheduler, critic=self.critic,
                    critic_optimizer=self.critic_optimizer, critic_scheduler=self.critic_scheduler)


def train_step_function(settings: AlgorithmSettings, tr: Trainables, *, rank: int, world_size: int,
                        device: torch.device, watchdog: StepWatchdog | None = None, first_step: int = 1,
                        epoch: int = 0):
    """The learner's step (every rank, its share of the samples), one call per batch: the samples and their
    episode- or turn-level advantages, then ``train_on_batch`` (every update), then the LR schedule; bounded in
    time by ``watchdog`` (step_watchdog.py). Returns the loop's StepOutcome (loop.py)."""
    adv = settings.advantage
    steps = [first_step - 1]  # the watchdog names the step it ends

    def train(batch) -> StepOutcome:
        steps[0] += 1
        # The weights being trained are version steps[0] − 1 of this epoch: the engine's, where it has caught up.
        samples, accounting = samples_from_batch(batch, adv.norm_by_std, adv.estimator, adv.gamma,
                                                 current_weights=(epoch, steps[0] - 1), gigpo=adv.gigpo)
        with watchdog.step(steps[0]) if watchdog is not None else nullcontext():
            metrics = train_on_batch(
                tr.model, tr.optimizer, samples, rank=rank, world_size=world_size, settings=settings.loss,
                update=settings.update, device=device, advantage=adv, reference=tr.reference,
                critic=tr.critic, critic_optimizer=tr.critic_optimizer,
            )
        metrics["optim/lr"] = tr.scheduler.get_last_lr()[0]
        tr.scheduler.step()
        if tr.critic_scheduler is not None:
            tr.critic_scheduler.step()
        return StepOutcome(metrics=metrics, num_samples=len(samples), num_tokens=sum(s.num_tokens for s in samples),
                           num_loss_tokens=sum(s.num_loss_tokens for s in samples), trained_ids=accounting.ids,
                           accounting_metrics=accounting.metrics(), failed_skipped=sum(accounting.failed.values()))

    return train


def train_on_batch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    samples: list[Sample],
    *,
    rank: int,
    world_size: int,
    settings: LossSettings,
    update: UpdateSettings,
    device: torch.device,
    advantage: AdvantageSettings = AdvantageSettings(),
    reference: nn.Module | None = None,
    critic: nn.Module | None = None,
    critic_optimizer: torch.optim.Optimizer | None = None,
) -> dict[str, float]:
    """Every optimizer update of one learner step (see the module docstring). A collective: every
    rank passes the same ``samples`` and trains its share. Returns metrics over all updates,
    reduced over all ranks; no samples: no update (``learner/updates`` = 0)."""
    cuts = mini_batches(samples, update.ppo_mini_batch_size)
    plan = [(cut, micro_batches_for_rank(cut, rank, world_size, update.micro_batch_size,
                                         update.max_tokens_per_micro_batch, update.pack_tokens)) for cut in cuts]
    # Advantages and proximal log-probs are functions of the policy *before* the first update.
    token_level_advantages([mb for _, micro in plan for mb in micro], advantage, critic, device)
    if settings.clip.decoupled and update.ppo_epochs * len(plan) > 1:
        for _, micro in plan:
            fill_proximal_logprobs(model, micro, settings, device)
    stats, grad_norms, critic_norms = PolicyLossStats(), [], []
    # Measured in the step's first update only: its log π_θ are those of the weights the engine has.
    mismatch = TurnMismatch()
    corrections = CorrectionStats()  # over every update: the share of tokens each one corrected
    for _ in range(update.ppo_epochs):
        for cut, micro in plan:
            update_stats, norms = optimizer_step(
                model, optimizer, micro, settings=settings, grad_clip=update.grad_clip,
                num_loss_tokens=sum(s.num_loss_tokens for s in cut), num_sequences=len(cut), device=device,
                reference=reference, critic=critic, critic_optimizer=critic_optimizer,
                mismatch=mismatch if not grad_norms else None, correction_stats=corrections)
            stats.add(update_stats)
            grad_norms.append(norms["grad/norm"])
            if "grad/critic_norm" in norms:
                critic_norms.append(norms["grad/critic_norm"])
    metrics = all_reduce_stats(stats).metrics()
    metrics.update(mismatch.all_reduce().metrics())
    metrics.update(corrections.all_reduce().metrics())
    metrics["learner/updates"] = float(len(grad_norms))
    if grad_norms:
        metrics["grad/norm"] = sum(grad_norms) / len(grad_norms)
    if critic_norms:
        metrics["grad/critic_norm"] = sum(critic_norms) / len(critic_norms)
    return metrics


def token_level_advantages(micro_batches: list[MicroBatch], adv: AdvantageSettings, critic: nn.Module | None,
                       device: torch.device) -> None:
    """The token-level estimators (reinforce_plus_plus, gae): fill ``advantages`` (and ``returns`` for gae) of this
    rank's micro-batches in place; the others have theirs on the samples already (``ESTIMATOR_STAGES``).

    Whitening uses the moments of the whole step (all micro-batches on all ranks), so the
    result does not depend on how the batch is split. A collective: every rank calls it.
    """
    if ESTIMATOR_STAGES[adv.estimator] != "token":
        return
    moments = torch.zeros(3, dtype=torch.float64)
    for mb in micro_batches:
        rewards = mb.token_rewards.float()
        if adv.estimator == "reinforce_plus_plus":
            mb.advantages = discounted_returns(rewards, mb.loss_mask, adv.gamma)
        else:
            with torch.no_grad():
                values = critic_values(critic, mb.input_ids.to(device)).float().cpu()
            mb.advantages, mb.returns = gae_advantages(rewards, values * mb.loss_mask, mb.loss_mask, adv.gamma, adv.lam)
        moments += masked_moments(mb.advantages, mb.loss_mask)
    if adv.estimator == "gae" and not adv.whiten_gae:
        for mb in micro_batches:
            mb.advantages = mb.advantages * mb.loss_mask
        return
    dist.all_reduce(moments, op=dist.ReduceOp.SUM)
    for mb in micro_batches:
        mb.advantages = whiten(mb.advantages, mb.loss_mask, moments)


def critic_values(critic: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) V_t: the value of the state in which token t is generated, i.e. the critic's
    output at position t − 1 (the same position whose logits predict token t). V_0 = 0."""
    v = critic(input_ids)  # (B, T): value after reading tokens 0..t
    return torch.cat([torch.zeros_like(v[:, :1]), v[:, :-1]], dim=1)


@torch.no_grad()
def fill_proximal_logprobs(model: nn.Module, micro_batches: list[MicroBatch], settings: LossSettings,
                           device: torch.device) -> None:
    """Set each micro-batch's ``proximal_logprobs`` (B, T): log π_θ of its tokens now, 0 off the loss tokens."""
    for mb in micro_batches:
        input_ids = mb.input_ids.to(device)
        selected = mb.loss_mask[:, 1:].bool().to(device)
        positions = None if mb.position_ids is None else mb.position_ids.to(device)
        logprobs = token_logprobs(loss_token_logits(model, input_ids, selected, positions), input_ids[:, 1:][selected],
                                  settings.temperature, settings.top_p)
        proximal = torch.zeros(mb.loss_mask.shape, dtype=torch.float32, device=device)
        proximal[:, 1:][selected] = logprobs
        mb.proximal_logprobs = proximal.cpu()


def optimizer_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[MicroBatch],
    *,
    settings: LossSettings,
    grad_clip: float,
    num_loss_tokens: int,
    num_sequences: int,
    device: torch.device,
    reference: nn.Module | None = None,
    critic: nn.Module | None = None,
    critic_optimizer: torch.optim.Optimizer | None = None,
    mismatch: TurnMismatch | None = None,
    correction_stats: CorrectionStats | None = None,
) -> tuple[PolicyLossStats, dict[str, float]]:
    """One optimizer update: accumulate the gradient over this rank's micro-batches, clip it, step.

    Every rank passes the same mini-batch-wide counts (``num_loss_tokens`` N, ``num_sequences`` S),
    so Σ_ranks Σ_mb loss_mb is the mini-batch's loss exactly. FSDP averages gradients over the W
    ranks; the ×W undoes that average, so the update does not depend on W. Returns this rank's
    loss statistics (sums, not yet reduced) and the (global) gradient norms before clipping.
    """
    world_size = dist.get_world_size()
    optimizer.zero_grad(set_to_none=True)
    if critic_optimizer is not None:
        critic_optimizer.zero_grad(set_to_none=True)
    stats = PolicyLossStats()
    for micro_batch in micro_batches:
        loss, mb_stats = micro_batch_loss(model, micro_batch.to(device), settings, num_loss_tokens, num_sequences,
                                          reference, critic, mismatch, correction_stats)
        (loss * world_size).backward()
        stats.add(mb_stats)
    norms = {"grad/norm": _clip(model, grad_clip)}
    optimizer.step()
    if critic is not None and critic_optimizer is not None:
        norms["grad/critic_norm"] = _clip(critic, grad_clip)
        critic_optimizer.step()
    return stats, norms


def micro_batch_loss(
    model: nn.Module,
    micro_batch: MicroBatch,
    settings: LossSettings,
    num_loss_tokens: int,
    num_sequences: int,
    reference: nn.Module | None = None,
    critic: nn.Module | None = None,
    mismatch: TurnMismatch | None = None,
    correction_stats: CorrectionStats | None = None,
) -> tuple[torch.Tensor, PolicyLossStats]:
    """Forward on the full token sequences; the loss at generated tokens only. With ``mismatch``, the
    per-turn |log π_θ − log π_behaviour| of the measured tokens is added to it (``learner/mismatch.py``);
    with ``correction_stats``, what the rollout correction did (``learner/rollout_correction.py``).

    Logits at position t-1 predict token t, so the targets are input_ids[:, 1:] and only the
    (N_mb, V) rows where loss_mask[:, 1:] = 1 are ever normalised (memory: N_mb·V, not B·T·V).
    No attention mask: padding is on the right, and causal attention never looks right.
    """
    selected = micro_batch.loss_mask[:, 1:].bool()  # (B, T-1)
    targets = micro_batch.input_ids[:, 1:][selected]
    positions = micro_batch.position_ids  # packed rows (learner/packing.py); None: a row per sequence
    logits = loss_token_logits(model, micro_batch.input_ids, selected, positions)  # (N_mb, V)
    logprobs, entropy = token_logprobs_and_entropy(logits, targets, settings.temperature,
                                                   settings.top_p)  # (N_mb,)
    weights = aggregation_weights(micro_batch.loss_mask, settings.loss_agg_mode, num_loss_tokens, num_sequences,
                                  micro_batch.sequence_index)
    w = weights[:, 1:][selected]  # (N_mb,)

    behaviour = micro_batch.behaviour_logprobs[:, 1:][selected]
    proximal = None if micro_batch.proximal_logprobs is None else micro_batch.proximal_logprobs[:, 1:][selected]
    # π_old: the learner's policy before the step's first update (decoupled: π_prox; bypass: this update's own)
    old = proximal if proximal is not None else logprobs.detach()
    rows = micro_batch.sequence_of_token[:, 1:][selected]  # (N_mb,) the sequence of each token
    turns = (micro_batch.turn_index[:, 1:][selected] if micro_batch.turn_index is not None
             else torch.ones_like(rows))
    correction = rollout_correction(old.clamp(min=LOGPROB_FLOOR) - behaviour, rows, turns, settings.correction,
                                    bypass=not settings.clip.decoupled)
    if correction_stats is not None:
        correction_stats.add(correction, turns)
    pg, diag = clipped_policy_loss(logprobs, behaviour, micro_batch.advantages[:, 1:][selected], settings.clip,
                                   proximal, weight=correction.factor)
    loss = (w * pg).sum() - settings.entropy_coeff * (w * entropy).sum()
    stats = PolicyLossStats.from_tokens(pg, diag["ratio"], diag["clipped"])
    stats.entropy_sum = float(entropy.detach().sum())
    if mismatch is not None and micro_batch.turn_of_token is not None:
        mismatch.add(micro_batch.turn_of_token[:, 1:][selected], logprobs, behaviour)

    if reference is not None:
        with torch.no_grad():
            ref_logprobs = token_logprobs(loss_token_logits(reference, micro_batch.input_ids, selected, positions),
                                          targets, settings.temperature)
        # KL(π_θ ‖ π_ref) between the untruncated distributions, both sides: with top_p < 1 the
        # nucleus log π_θ is not comparable with the full log π_ref, and is −inf outside the nucleus
        # (k3 = e^∞ − ∞ = NaN)
        full_logprobs = logprobs if settings.top_p >= 1.0 else token_logprobs(logits, targets, settings.temperature)
        kl = kl_penalty(full_logprobs, ref_logprobs, settings.kl_loss_type)
        loss = loss + settings.kl_loss_coef * (w * kl).sum()
        stats.kl_ref_sum = float(kl.detach().sum())

    if critic is not None:
        values = critic_values(critic, micro_batch.input_ids)[:, 1:][selected].float()
        target = micro_batch.returns[:, 1:][selected]
        value_loss = 0.5 * (values - target) ** 2  # ½ (V_t − R_t)²   (one update per batch: no value clipping)
        loss = loss + settings.vf_coef * (w * value_loss).sum()
        with torch.no_grad():
            stats.value_loss_sum = float(value_loss.sum())
            stats.value_error_sq_sum = float(((target - values) ** 2).sum())
            stats.return_sum = float(target.sum())
            stats.return_sq_sum = float((target * target).sum())
    return loss, stats


def _clip(module: nn.Module, max_norm: float) -> float:
    norm = torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm)
    if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2
        norm = norm.full_tensor()
    return float(norm)


def all_reduce_stats(stats: PolicyLossStats) -> PolicyLossStats:
    """Sums add up over ranks; min and max reduce as min and max (one all-reduce each)."""
    sums = torch.tensor([getattr(stats, name) for name in PolicyLossStats.SUM_FIELDS], dtype=torch.float64)
    extremes = torch.tensor([-stats.ratio_min, stats.ratio_max], dtype=torch.float64)
    dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
    total = PolicyLossStats(**dict(zip(PolicyLossStats.SUM_FIELDS, sums.tolist())))
    total.ratio_min, total.ratio_max = -float(extremes[0]), float(extremes[1])
    return total


def lr_multiplier(step: int, warmup_steps: int, total_steps: int, schedule: str, min_ratio: float) -> float:
    """The learning-rate factor for optimizer step ``step`` (0-based: the number of steps already taken).

    warm-up (step < W):  (step + 1) / W
    then, with p = (step − W) / max(1, total − W) in [0, 1]:
        constant  1
        linear    1 − (1 − m) p
        cosine    m + (1 − m) · ½ (1 + cos π p)          (SGDR, arXiv 1608.03983, eq. 5, one cycle)
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "linear":
        return 1.0 - (1.0 - min_ratio) * progress
    if schedule == "cosine":
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown lr_schedule {schedule!r}")
