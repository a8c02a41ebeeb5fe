"""The policy loss: PPO clip with the off-policy correction, KL to a reference, entropy bonus.

Asynchronous actors sample with weights that may be a few versions old, so the importance
ratio is taken against the *behaviour* logprobs carried in each trajectory (the engine's
logprob of the sampled token, log μ):

    r_t(θ) = π_θ(a_t | s_t) / μ(a_t | s_t) = exp(log π_θ − log μ)
    ℓ_t = −min(r_t A_t, clip(r_t, 1 − ε_low, 1 + ε_high) A_t)      (PPO, arXiv 1707.06347, eq. 7;
                                                                     asymmetric ε: DAPO, arXiv 2503.14476)
    with dual clip for A_t < 0:  ℓ_t = min(ℓ_t, −c A_t)             (arXiv 1912.09729, eq. 5)

Decoupled PPO (AReaL, arXiv 2505.24298, eq. 5) separates the behaviour policy μ from the
proximal policy π_prox that the trust region is centred on:

    ℓ_t = −w_t · min(r̃_t A_t, clip(r̃_t, 1 − ε_low, 1 + ε_high) A_t),
    r̃_t = π_θ / π_prox,   w_t = min(π_prox / μ, C)   (a truncated importance weight, no gradient)

The learner takes one optimizer step per batch, so π_prox is the policy at the start of that
step: log π_prox = sg(log π_θ), computed in the same forward pass (no extra one).

The regularisers, per token:
    KL to a frozen reference π_ref (Schulman, "Approximating KL Divergence", 2020), x = log π_ref − log π_θ:
        k1 = −x,   k2 = ½ x²,   k3 = eˣ − x − 1,   low_var_kl = clamp(k3, −10, 10)   (verl's names)
    entropy bonus: −β H(π_θ(· | s_t))

Aggregation (``loss_agg_mode``) turns per-token terms into the step's loss with one weight per
token (:func:`aggregation_weights`) computed from the WHOLE step's counts, so the sum over
micro-batches and ranks is the same however the batch is split. Log-probabilities are
log_softmax(logits / T), matching the engine's ``processed_logprobs``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

KL_ESTIMATORS = ("low_var_kl", "k1", "k2", "k3")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
LOW_VAR_KL_BOUND = 10.0


def token_logprobs_and_entropy(
    logits: torch.Tensor, target_ids: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each target token and the entropy of each next-token distribution.

    logits:     (..., V) logits predicting the targets (position t-1 predicts token t)
    target_ids: (...)    the tokens whose probability we want
    returns:    logprobs (...) = log softmax(logits / T)[target],  entropy (...) = −Σ_v p_v log p_v
    """
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    logprobs = logp.gather(-1, target_ids.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logprobs, entropy


def aggregation_weights(loss_mask: torch.Tensor, mode: str, num_loss_tokens: int, num_sequences: int) -> torch.Tensor:
    """One weight per token so that Σ_t w_t ℓ_t is the step's loss.

    loss_mask:       (B, T) of this micro-batch; each row is one sequence
    num_loss_tokens: N, loss tokens of the WHOLE step;  num_sequences: S, sequences of the whole step
    returns (B, T):  token-mean           w = 1 / N              (every token counts the same)
                     seq-mean-token-mean  w = 1 / (n_i · S)      (every sequence counts the same)
                     seq-mean-token-sum   w = 1 / S              (longer answers count more)
    """
    mask = loss_mask.to(torch.float32)
    if mode == "token-mean":
        return mask / max(num_loss_tokens, 1)
    if mode == "seq-mean-token-mean":
        per_sequence = mask.sum(-1, keepdim=True).clamp(min=1.0)
        return mask / per_sequence / max(num_sequences, 1)
    if mode == "seq-mean-token-sum":
        return mask / max(num_sequences, 1)
    raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {mode!r}")


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(π_θ || π_ref) from samples of π_θ (shapes alike, e.g. (N,))."""
    x = ref_logprobs - logprobs  # log π_ref − log π_θ
    if kind == "k1":
        return -x
    if kind == "k2":
        return 0.5 * x * x
    k3 = torch.exp(x) - x - 1.0
    if kind == "k3":
        return k3
    if kind == "low_var_kl":
        return torch.clamp(k3, -LOW_VAR_KL_BOUND, LOW_VAR_KL_BOUND)
    raise ValueError(f"kl_loss_type must be one of {KL_ESTIMATORS}, got {kind!r}")


@dataclass(frozen=True)
class ClipSettings:
    clip_low: float = 0.2  # ε_low
    clip_high: float = 0.2  # ε_high
    clip_ratio_c: float | None = None  # dual-clip bound c (> 1) for negative advantages; None: off
    decoupled: bool = False  # AReaL's decoupled objective with a proximal policy
    behaviour_weight_cap: float | None = None  # C, truncation of π_prox / μ (decoupled only)


def clipped_policy_loss(
    logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, advantages: torch.Tensor, clip: ClipSettings
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token clipped surrogate ℓ_t (see the module docstring); all inputs (N,) of loss tokens.

    returns ℓ (N,) (differentiable), and per-token diagnostics (no gradient): the ratio r_t
    that was clipped, whether it was clipped, and the behaviour ratio π_θ / μ.
    """
    log_behaviour_ratio = logprobs - behaviour_logprobs
    if clip.decoupled:
        log_ratio = logprobs - logprobs.detach()  # r̃ = π_θ / π_prox = 1, with the gradient of π_θ
        weight = torch.exp(log_behaviour_ratio.detach())  # π_prox / μ
        if clip.behaviour_weight_cap is not None:
            weight = torch.clamp(weight, max=clip.behaviour_weight_cap)
    else:
        log_ratio = log_behaviour_ratio
        weight = torch.ones_like(logprobs)
    ratio = torch.exp(log_ratio)
    pg_unclipped = -advantages * ratio
    pg_clipped = -advantages * torch.clamp(ratio, 1.0 - clip.clip_low, 1.0 + clip.clip_high)
    pg = torch.maximum(pg_unclipped, pg_clipped)  # −min(r A, clip(r) A)
    if clip.clip_ratio_c is not None:
        pg = torch.where(advantages < 0, torch.minimum(pg, -advantages * clip.clip_ratio_c), pg)
    with torch.no_grad():
        clipped = (ratio < 1.0 - clip.clip_low) | (ratio > 1.0 + clip.clip_high)
        diagnostics = {"ratio": torch.exp(log_behaviour_ratio), "clipped": clipped.float(), "weight": weight}
    return weight * pg, diagnostics


def ppo_clip_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    clip_ratio: float,
    num_loss_tokens: int,
    clip: ClipSettings | None = None,
) -> tuple[torch.Tensor, "PolicyLossStats"]:
    """This micro-batch's share of the step's token-mean clipped loss (no regularisers).

    logprobs:           (B, T) log π_θ of the taken tokens (differentiable)
    behaviour_logprobs: (B, T) log μ from the trajectory (the engine that generated it)
    advantages:         (B, T) A_t, already broadcast over generated tokens
    loss_mask:          (B, T) 1 where the token was generated by the policy
                        (any common shape works, e.g. (N,) of already selected tokens)
    num_loss_tokens:    N, loss tokens of the WHOLE step (all ranks, all micro-batches)
    returns: the scalar Σ_t mask_t · ℓ_t / N, and sums for the metrics
    """
    clip = clip or ClipSettings(clip_ratio, clip_ratio)
    mask = loss_mask.to(logprobs.dtype)
    selected = loss_mask.bool()
    # masked before exp: no overflow on tokens that are not trained on
    lp = torch.where(selected, logprobs, behaviour_logprobs)
    per_token, diag = clipped_policy_loss(lp, behaviour_logprobs, advantages, clip)
    loss = (per_token * mask).sum() / max(num_loss_tokens, 1)
    stats = PolicyLossStats.from_tokens(per_token[selected], diag["ratio"][selected], diag["clipped"][selected])
    return loss, stats


@dataclass
class PolicyLossStats:
    """Sums over loss tokens (so micro-batches and ranks combine by adding), plus min/max."""

    tokens: float = 0.0
    loss_sum: float = 0.0
    ratio_sum: float = 0.0
    ratio_min: float = float("inf")
    ratio_max: float = float("-inf")
    clipped: float = 0.0
    approx_kl_sum: float = 0.0
    entropy_sum: float = 0.0
    kl_ref_sum: float = 0.0
    value_loss_sum: float = 0.0
    value_error_sq_sum: float = 0.0  # Σ (R − V)², for explained variance
    return_sum: float = 0.0
    return_sq_sum: float = 0.0

    SUM_FIELDS: ClassVar[tuple[str, ...]] = (
        "tokens", "loss_sum", "ratio_sum", "clipped", "approx_kl_sum", "entropy_sum", "kl_ref_sum",
        "value_loss_sum", "value_error_sq_sum", "return_sum", "return_sq_sum",
    )

    @classmethod
    def from_tokens(cls, per_token_loss: torch.Tensor, ratio: torch.Tensor, clipped: torch.Tensor) -> "PolicyLossStats":
        """per_token_loss, ratio (π_θ / μ), clipped: (N,) over the loss tokens."""
        with torch.no_grad():
            r = ratio.double()
            log_r = torch.log(r)
            # k3 estimator of KL(μ || π) from samples of μ: (r − 1) − log r
            return cls(
                tokens=float(r.numel()),
                loss_sum=float(per_token_loss.detach().double().sum()),
                ratio_sum=float(r.sum()),
                ratio_min=float(r.min()) if r.numel() else float("inf"),
                ratio_max=float(r.max()) if r.numel() else float("-inf"),
                clipped=float(clipped.sum()),
                approx_kl_sum=float(((r - 1.0) - log_r).sum()),
            )

    def add(self, other: "PolicyLossStats") -> None:
        for name in self.SUM_FIELDS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.ratio_min = min(self.ratio_min, other.ratio_min)
        self.ratio_max = max(self.ratio_max, other.ratio_max)

    def metrics(self) -> dict[str, float]:
        n = max(self.tokens, 1.0)
        out = {
            "loss/policy": self.loss_sum / n,
            "loss/entropy": self.entropy_sum / n,
            "loss/approx_kl": self.approx_kl_sum / n,
            "loss/kl_ref": self.kl_ref_sum / n,
            "ratio/mean": self.ratio_sum / n,
            "ratio/min": self.ratio_min if self.tokens else 1.0,
            "ratio/max": self.ratio_max if self.tokens else 1.0,
            "ratio/clip_fraction": self.clipped / n,
        }
        if self.value_loss_sum or self.value_error_sq_sum:
            variance = self.return_sq_sum / n - (self.return_sum / n) ** 2
            out["loss/value"] = self.value_loss_sum / n
            # 1 − Var(R − V) / Var(R), with the error's mean folded in (cleanrl's explained variance)
            out["critic/explained_variance"] = 1.0 - (self.value_error_sq_sum / n) / variance if variance > 0 else 0.0
        return out
