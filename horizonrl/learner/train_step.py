"""One optimizer step over a rank's micro-batches: forward, clipped loss, backward, clip, step."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from horizonrl.learner.batching import MicroBatch
from horizonrl.learner.policy_loss import PolicyLossStats, ppo_clip_loss, token_logprobs_and_entropy


def micro_batch_loss(
    model: nn.Module, micro_batch: MicroBatch, temperature: float, clip_ratio: float, num_loss_tokens: int
) -> tuple[torch.Tensor, PolicyLossStats]:
    """Forward on the full token sequences; the loss at generated tokens only.

    Logits at position t-1 predict token t, so the targets are input_ids[:, 1:] and only the
    (N_mb, V) rows where loss_mask[:, 1:] = 1 are ever normalised (memory: N_mb·V, not B·T·V).
    No attention mask: padding is on the right, and causal attention never looks right.
    """
    logits = model(input_ids=micro_batch.input_ids, use_cache=False).logits  # (B, T, V)
    selected = micro_batch.loss_mask[:, 1:].bool()  # (B, T-1)
    logprobs, entropy = token_logprobs_and_entropy(
        logits[:, :-1][selected], micro_batch.input_ids[:, 1:][selected], temperature
    )  # (N_mb,)
    loss, stats = ppo_clip_loss(
        logprobs,
        micro_batch.behaviour_logprobs[:, 1:][selected],
        micro_batch.advantages[:, 1:][selected],
        torch.ones_like(logprobs),
        clip_ratio,
        num_loss_tokens,
    )
    stats.entropy_sum = float(entropy.detach().sum())
    return loss, stats


def optimizer_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[MicroBatch],
    *,
    temperature: float,
    clip_ratio: float,
    grad_clip: float,
    num_loss_tokens: int,
    device: torch.device,
) -> dict[str, float]:
    """Accumulate the step's gradient over this rank's micro-batches, clip it and step.

    Every rank passes the same ``num_loss_tokens`` N (the whole step's), so Σ_ranks Σ_mb
    loss_mb = L^CLIP exactly. FSDP averages gradients over the W ranks; the ×W undoes that
    average, so the update does not depend on W. Returns metrics reduced over all ranks.
    """
    world_size = dist.get_world_size()
    optimizer.zero_grad(set_to_none=True)
    stats = PolicyLossStats()
    for micro_batch in micro_batches:
        loss, mb_stats = micro_batch_loss(model, micro_batch.to(device), temperature, clip_ratio, num_loss_tokens)
        (loss * world_size).backward()
        stats.add(mb_stats)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP2
        grad_norm = grad_norm.full_tensor()
    optimizer.step()
    stats = all_reduce_stats(stats)
    return {**stats.metrics(), "grad/norm": float(grad_norm)}


def all_reduce_stats(stats: PolicyLossStats) -> PolicyLossStats:
    """Sums add up over ranks; min and max reduce as min and max (one all-reduce each)."""
    sums = torch.tensor([getattr(stats, name) for name in PolicyLossStats.SUM_FIELDS], dtype=torch.float64)
    extremes = torch.tensor([-stats.ratio_min, stats.ratio_max], dtype=torch.float64)
    dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
    total = PolicyLossStats(**dict(zip(PolicyLossStats.SUM_FIELDS, sums.tolist())))
    total.ratio_min, total.ratio_max = -float(extremes[0]), float(extremes[1])
    return total
