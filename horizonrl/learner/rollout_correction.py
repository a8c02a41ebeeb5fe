"""Rollout correction: what the loss does about tokens sampled by a policy other than the one it trains.

An actor's token a_t was sampled by the behaviour policy μ: the engine, with weights that may be a few
versions old (asynchrony) and with kernels whose numerics differ from the learner's (bf16 vLLM against
the learner's forward pass). The learner's own policy before the step's first update is π_old. Every
correction here is a function of the per-token behaviour ratio

    ρ_t = π_old(a_t | s_t) / μ(a_t | s_t),      log ρ_t = log π_old − log μ      (no gradient)

and yields one factor c_t ≥ 0 per loss token that multiplies the token's policy-gradient term. What
π_old is depends on where the PPO ratio is anchored (``learner.decoupled_loss``):

- **recompute** (``decoupled_loss: true``, AReaL's decoupled PPO): the PPO ratio is π_θ / π_old, with
  π_old the learner's policy before the step's first update (π_prox), so nothing in the ratio accounts for
  μ; the correction's weight W_t does. With no truncation W_t = ρ_t (plain importance sampling).
- **bypass** (``decoupled_loss: false``, the default; verl's bypass mode): the engine's log-probabilities
  serve as the old policy, the PPO ratio is π_θ / μ, and it already carries ρ_t (at the first update
  π_θ = π_old). There π_old = sg(π_θ) of the update at hand, and the factor is c_t = W_t / ρ_t, which
  takes the ratio's own ρ_t out and puts the corrected weight in: at the first update both modes weigh
  token t by the same W_t.

The corrections (each optional, all composable; ``algorithm.rollout_correction``):

    truncated IS, token      W_t = min(ρ_t, C)                                  (TIS; Yao et al. 2025)
    truncated IS, sequence   W_t = min(Π_{s∈seq} ρ_s, C)   for every token of the sequence
    rejection, token         M_t = 1[L ≤ ρ_t ≤ U]          (two-sided: IcePop, Ring-1T, arXiv 2510.18855)
    rejection, sequence      M_t = 1[L ≤ Π_{s∈seq} ρ_s ≤ U]
    rejection, geometric     M_t = 1[L ≤ exp(mean_{s∈seq} log ρ_s) ≤ U]         (the per-token geometric mean)
    per-turn rejection       KL_k = mean_{t∈turn k} (ρ_t − 1 − log ρ_t)           (k3 estimate of KL(μ ‖ π_old))
                             drop:        T_t = 1[KL_k ≤ B]
                             down-weight: T_t = min(1, B / KL_k)
    c_t = W_t · M_t · T_t   (recompute)      c_t = (W_t / ρ_t) · M_t · T_t   (bypass; W_t / ρ_t = 1 without truncation)

A sequence is one training sample (a row: a whole episode, or one sample of an episode that branched);
a turn is one generated turn of it. Masked tokens stay in the loss's normaliser (their term is 0), as in
verl, so a mask does not inflate the other tokens' weight. The per-turn rejection is this project's own:
it acts on the turn whose tokens drifted — a long episode's one bad turn — not the whole episode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from horizonrl.learner.mismatch import MISMATCH_TURNS

IS_LEVELS = ("token", "sequence")
REJECT_LEVELS = ("token", "sequence", "geometric")
TURN_ACTIONS = ("drop", "downweight")
# log ρ is clamped here before it is exponentiated (verl bounds its weights at exp(±20) the same way)
LOG_RATIO_BOUND = 20.0


@dataclass(frozen=True)
class CorrectionSettings:
    """``algorithm.rollout_correction`` as the loss uses it (bounds resolved: see core/config.py)."""

    is_level: str | None = None  # None, "token" or "sequence"
    is_cap: float = 2.0  # C
    reject_level: str | None = None  # None, "token", "sequence" or "geometric"
    reject_low: float = 0.0  # L
    reject_high: float = float("inf")  # U
    turn_action: str | None = None  # None, "drop" or "downweight"
    turn_kl_bound: float = 0.01  # B

    @property
    def active(self) -> bool:
        return bool(self.is_level or self.reject_level or self.turn_action)


def k3(log_rho: torch.Tensor) -> torch.Tensor:
    """ρ − 1 − log ρ: per-sample k3 estimate of KL(μ ‖ π_old) from tokens sampled by μ (≥ 0)."""
    return torch.expm1(log_rho) - log_rho


def per_group_mean(values: torch.Tensor, groups: torch.Tensor, num_groups: int) -> torch.Tensor:
    """(N,) each token's group mean of ``values`` (groups: (N,) ints in [0, num_groups))."""
    sums = torch.zeros(num_groups, dtype=values.dtype, device=values.device).index_add_(0, groups, values)
    counts = torch.zeros(num_groups, dtype=values.dtype, device=values.device).index_add_(
        0, groups, torch.ones_like(values))
    return (sums / counts.clamp(min=1))[groups]


def per_group_sum(values: torch.Tensor, groups: torch.Tensor, num_groups: int) -> torch.Tensor:
    sums = torch.zeros(num_groups, dtype=values.dtype, device=values.device).index_add_(0, groups, values)
    return sums[groups]


@dataclass
class Correction:
    """One micro-batch's correction: the factor per loss token and what it did (no gradient anywhere)."""

    factor: torch.Tensor  # (N,) c_t
    log_rho: torch.Tensor  # (N,) the clamped log ρ_t it was computed from
    truncated: torch.Tensor  # (N,) bool: W_t < its untruncated value
    rejected: torch.Tensor  # (N,) bool: M_t = 0
    turn_scaled: torch.Tensor  # (N,) bool: T_t < 1


def rollout_correction(log_rho: torch.Tensor, rows: torch.Tensor, turns: torch.Tensor, settings: CorrectionSettings,
                       bypass: bool) -> Correction:
    """The factor c_t of every loss token (the module docstring has each equation).

    log_rho: (N,) log π_old − log μ of the micro-batch's loss tokens
    rows:    (N,) the row (sequence) of each token;  turns: (N,) its 1-based turn within that row (≥ 1)
    bypass:  the PPO ratio is anchored at μ (it already carries ρ_t), else at π_old
    """
    with torch.no_grad():
        log_rho = log_rho.detach().double().clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        n = log_rho.numel()
        num_rows = int(rows.max()) + 1 if n else 1
        rho = log_rho.exp()
        # W_t, as a log weight so that bypass's W_t / ρ_t stays exact where ρ_t is tiny
        if settings.is_level == "token":
            log_w = torch.clamp(log_rho, max=math.log(settings.is_cap))  # min(ρ_t, C)
        elif settings.is_level == "sequence":
            log_seq = per_group_sum(log_rho, rows, num_rows)  # log Π_{s∈seq} ρ_s
            log_w = torch.clamp(log_seq, max=math.log(settings.is_cap))  # min(Π ρ, C)
        else:
            log_w = log_rho  # untruncated: W_t = ρ_t
        untruncated = log_rho if settings.is_level != "sequence" else per_group_sum(log_rho, rows, num_rows)
        truncated = log_w < untruncated
        factor = torch.exp(log_w - log_rho) if bypass else torch.exp(log_w)

        rejected = torch.zeros(n, dtype=torch.bool, device=log_rho.device)
        if settings.reject_level:
            if settings.reject_level == "token":
                statistic = rho  # ρ_t
            elif settings.reject_level == "sequence":
                statistic = per_group_sum(log_rho, rows, num_rows).clamp(max=LOG_RATIO_BOUND).exp()  # Π ρ
            else:
                statistic = per_group_mean(log_rho, rows, num_rows).exp()  # exp(mean log ρ)
            rejected = (statistic < settings.reject_low) | (statistic > settings.reject_high)
            factor = torch.where(rejected, torch.zeros_like(factor), factor)  # M_t

        turn_scaled = torch.zeros(n, dtype=torch.bool, device=log_rho.device)
        if settings.turn_action and n:
            turn_key = rows * (int(turns.max()) + 1) + turns  # one id per (row, turn)
            turn_kl = per_group_mean(k3(log_rho), turn_key, int(turn_key.max()) + 1)  # KL_k on each of its tokens
            over = turn_kl > settings.turn_kl_bound
            if settings.turn_action == "drop":
                scale = torch.where(over, torch.zeros_like(turn_kl), torch.ones_like(turn_kl))  # 1[KL_k ≤ B]
            else:
                scale = torch.clamp(settings.turn_kl_bound / turn_kl.clamp(min=1e-30), max=1.0)  # min(1, B / KL_k)
            turn_scaled = over
            factor = factor * scale  # T_t
    return Correction(factor.float(), log_rho, truncated, rejected, turn_scaled)


class CorrectionStats:
    """Sums over a step's loss tokens, per turn (index 0 unused; turns past ``MISMATCH_TURNS`` share the last),
    added to per micro-batch and reduced over ranks once (one row per name in ``ROWS``)."""

    ROWS = ("k3", "tokens", "truncated", "rejected", "turn_scaled", "removed", "factor")

    def __init__(self) -> None:
        self.sums = torch.zeros(len(self.ROWS), MISMATCH_TURNS + 1, dtype=torch.float64)

    def add(self, correction: Correction, turns: torch.Tensor) -> None:
        if correction.factor.numel() == 0:
            return
        index = turns.clamp(min=1, max=MISMATCH_TURNS).cpu()
        removed = correction.rejected | correction.turn_scaled  # masked, dropped or down-weighted
        values = torch.stack([k3(correction.log_rho), torch.ones_like(correction.log_rho),
                              correction.truncated.double(), correction.rejected.double(),
                              correction.turn_scaled.double(), removed.double(), correction.factor.double()]).cpu()
        self.sums.index_add_(1, index, values)

    def all_reduce(self) -> "CorrectionStats":
        """The sums over every rank (a collective: every rank calls it)."""
        out = CorrectionStats()
        out.sums = self.sums.clone()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(out.sums, op=dist.ReduceOp.SUM)
        return out

    def metrics(self) -> dict[str, float]:
        """``correction/*``: the k3 KL(μ ‖ π_old) per token, the shares of tokens truncated, rejected and turn-scaled,
        the mean factor, and per turn k the k3 KL and the share of its tokens rejected or scaled down."""
        totals = self.sums.sum(dim=1)
        tokens = float(totals[1])
        if tokens == 0:
            return {}
        share = dict(zip(self.ROWS, (float(x) / tokens for x in totals)))
        out = {"correction/k3_kl": share["k3"], "correction/truncated_fraction": share["truncated"],
               "correction/rejected_fraction": share["rejected"],
               "correction/turn_scaled_fraction": share["turn_scaled"], "correction/mean_factor": share["factor"],
               "correction/tokens": tokens}
        for k in range(1, MISMATCH_TURNS + 1):
            count = float(self.sums[1, k])
            if count > 0:
                out[f"correction/turn_{k}_k3_kl"] = float(self.sums[0, k]) / count
                out[f"correction/turn_{k}_removed_fraction"] = float(self.sums[5, k]) / count
        return out
