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
    r̃_t = π_θ / π_prox,   w_t = π_prox / μ   (an importance weight, no gradient)

The rollout correction (``learner/rollout_correction.py``: truncated or masked importance weights, per-turn
rejection) supplies w_t in either form: for the decoupled loss in place of π_prox / μ, for the plain one as
a factor on the token's term (the plain ratio π_θ / μ already carries π_old / μ).

π_prox is the policy at the start of the learner step, before its first optimizer update
(``learner.ppo_epochs`` × mini-batches of ``learner.ppo_mini_batch_size`` groups). With a single
update per step the two coincide and log π_prox = sg(log π_θ) comes from the same forward pass;
with several, the learner computes log π_prox once, in a no-grad pass before the first update, so
the later updates are clipped against it.

The regularisers, per token:
    KL to a frozen reference π_ref (Schulman, "Approximating KL Divergence", 2020), x = log π_ref − log π_θ:
        k1 = −x,   k2 = ½ x²,   k3 = eˣ − x − 1,   low_var_kl = clamp(k3, −10, 10)   (verl's names)
    entropy bonus: −β H(π_θ(· | s_t))

Aggregation (``loss_agg_mode``) turns per-token terms into the step's loss with one weight per
token (:func:`aggregation_weights`) computed from the WHOLE step's counts, so the sum over
micro-batches and ranks is the same however the batch is split.

Log-probabilities are those of the distribution the engine samples from, matching its
``processed_logprobs``: log_softmax(logits / T), and with nucleus sampling (``rollout.top_p`` < 1)
log_softmax over the nucleus only — the smallest set of most likely tokens whose probability
reaches p, renormalised (Holtzman et al., arXiv 1904.09751, eq. 3), found exactly as vLLM does.
Taking the full softmax instead would bias the importance ratio on every token. The KL to the
reference compares the untruncated distributions (a regulariser on the model, as verl does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

KL_ESTIMATORS = ("low_var_kl", "k1", "k2", "k3")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
LOW_VAR_KL_BOUND = 10.0
# log-probabilities are clamped here before ratios are taken: exp(−1e4) is 0 in float32, without −inf's NaNs
LOGPROB_FLOOR = -1e4


def nucleus_logits(scaled_logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Logits outside the top-p nucleus set to −inf (vLLM's rule, so both sides agree on the boundary).

    scaled_logits: (..., V) logits already divided by the temperature
    The nucleus keeps token v unless the probability of all tokens less likely than or as likely
    as v — v included, in ascending order — is at most 1 − p; the most likely token is always kept.
    """
    if top_p >= 1.0:
        return scaled_logits
    ascending, order = scaled_logits.sort(dim=-1)
    outside = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1.0 - top_p
    outside[..., -1] = False  # at least one token
    mask = torch.zeros_like(outside).scatter(-1, order, outside)
    return scaled_logits.masked_fill(mask, float("-inf"))


def token_logprobs_and_entropy(
    logits: torch.Tensor, target_ids: torch.Tensor, temperature: float, top_p: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each target token and the entropy of each next-token distribution.

    logits:     (..., V) logits predicting the targets (position t-1 predicts token t)
    target_ids: (...)    the tokens whose probability we want
    returns:    logprobs (...) = log softmax(nucleus_p(logits / T))[target]  (−inf outside the nucleus),
                entropy (...)  = −Σ_v p_v log p_v of that (truncated) distribution
    """
    logp = torch.log_softmax(nucleus_logits(logits.float() / temperature, top_p), dim=-1)
    logprobs = logp.gather(-1, target_ids.unsqueeze(-1)).squeeze(-1)
    p = logp.exp()
    # p_v log p_v with 0 · log 0 = 0, written so that its gradient is 0 there too: a token outside the
    # nucleus (log p = −inf) or one whose probability underflows (logits / T spread over > 104) would
    # make entr's gradient −(1 + log 0) · ∂p = ∞ · 0 = NaN, and with it every gradient of the step.
    entropy = -(p * torch.where(p > 0, logp, torch.zeros_like(logp))).sum(-1)
    return logprobs, entropy


def token_logprobs(logits: torch.Tensor, target_ids: torch.Tensor, temperature: float = 1.0,
                   top_p: float = 1.0) -> torch.Tensor:
    """Log-probability of each target token alone (shapes as :func:`token_logprobs_and_entropy`), in float32; the
    one function for it, the policy loss's and the offline losses' (SFT, DPO: temperature 1, no nucleus)."""
    if temperature == 1.0 and top_p >= 1.0:  # −cross-entropy: no (..., V) log-softmax kept beside the logits
        flat = -torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target_ids.reshape(-1),
                                                  reduction="none")
        return flat.reshape(target_ids.shape)
    logp = torch.log_softmax(nucleus_logits(logits.float() / temperature, top_p), dim=-1)
    return logp.gather(-1, target_ids.unsqueeze(-1)).squeeze(-1)


def aggregation_weights(loss_mask: torch.Tensor, mode: str, num_loss_tokens: int, num_sequences: int,
                        sequence_index: torch.Tensor | None = None) -> torch.Tensor:
    """One weight per token so that Σ_t w_t ℓ_t is the step's loss.

    loss_mask:       (B, T) of this micro-batch; each row is one sequence, unless ``sequence_index`` (B, T) says
                     which sequence each token belongs to (packed rows, learner/packing.py)
    num_loss_tokens: N, loss tokens of the WHOLE step;  num_sequences: S, sequences of the whole step
    returns (B, T):  token-mean           w = 1 / N              (every token counts the same)
                     seq-mean-token-mean  w = 1 / (n_i · S)      (every sequence counts the same)
                     seq-mean-token-sum   w = 1 / S              (longer answers count more)
    """
    mask = loss_mask.to(torch.float32)
    if mode == "token-mean":
        return mask / max(num_loss_tokens, 1)
    if mode == "seq-mean-token-mean":
        if sequence_index is None:
            per_sequence = mask.sum(-1, keepdim=True).clamp(min=1.0)
        else:  # n_i of each token's own sequence
            counts = torch.zeros(int(sequence_index.max()) + 1, dtype=mask.dtype, device=mask.device)
            counts.index_add_(0, sequence_index.flatten(), mask.flatten())
            per_sequence = counts[sequence_index].clamp(min=1.0)
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


def clipped_policy_loss(
    logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, advantages: torch.Tensor, clip: ClipSettings,
    proximal_logprobs: torch.Tensor | None = None, weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token clipped surrogate ℓ_t (see the module docstring); all inputs (N,) of loss tokens.

    ``proximal_logprobs`` (decoupled only): log π_prox from before the step's first update; None
    means this is the step's only update, so π_prox = sg(π_θ).
    ``weight``: w_t of each token (no gradient), the rollout correction's factor; None: π_prox / μ for the
    decoupled loss, 1 for the plain one.
    returns ℓ (N,) (differentiable), and per-token diagnostics (no gradient): the behaviour ratio
    π_θ / μ, whether the clipped ratio was clipped, and the weight.

    A token outside the current nucleus (top_p < 1) has log π_θ = −inf: its ratio is 0, so it
    contributes no gradient (finite log-ratios keep the arithmetic free of NaN).
    """
    logprobs = logprobs.clamp(min=LOGPROB_FLOOR)
    log_behaviour_ratio = logprobs - behaviour_logprobs
    if clip.decoupled:
        proximal = logprobs.detach() if proximal_logprobs is None else proximal_logprobs.clamp(min=LOGPROB_FLOOR)
        log_ratio = logprobs - proximal  # r̃ = π_θ / π_prox
        if weight is None:
            weight = torch.exp(proximal - behaviour_logprobs)  # π_prox / μ (no gradient)
    else:
        log_ratio = log_behaviour_ratio
    if weight is None:
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
            log_r = torch.log(r.clamp(min=1e-300))  # a token outside the nucleus has r = 0
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
