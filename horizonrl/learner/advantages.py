"""GRPO outcome advantages (DeepSeekMath, arXiv 2402.03300, §4.1.2; AgentGym-RL's default).

Each group holds the n episodes of one task. An episode's advantage is its return compared
with its group's, and every generated token of the episode gets that same advantage.
"""

from __future__ import annotations

import torch

GRPO_EPS = 1e-6  # as verl (which AgentGym-RL builds on)


def grpo_outcome_advantages(rewards: torch.Tensor, norm_by_std: bool = True, eps: float = GRPO_EPS) -> torch.Tensor:
    """Advantages of one group.

    rewards: (n,) episode returns r_1..r_n of the n episodes of one task.
    returns: (n,)  A_i = (r_i - mean(r)) / (std(r) + eps)   if norm_by_std
                   A_i =  r_i - mean(r)                      otherwise (Dr. GRPO)

    std is the unbiased (Bessel-corrected) standard deviation, as in verl. A group of one
    episode has nothing to compare with: its advantage is 0.
    """
    rewards = rewards.to(torch.float32)
    if rewards.numel() < 2:
        return torch.zeros_like(rewards)
    centred = rewards - rewards.mean()
    if not norm_by_std:
        return centred
    return centred / (rewards.std(unbiased=True) + eps)


def grouped_advantages(
    group_rewards: list[list[float]], norm_by_std: bool = True, eps: float = GRPO_EPS
) -> list[list[float]]:
    """:func:`grpo_outcome_advantages` for every group; same nesting as ``group_rewards``."""
    return [
        grpo_outcome_advantages(torch.tensor(rewards, dtype=torch.float32), norm_by_std, eps).tolist()
        for rewards in group_rewards
    ]


def token_advantages(advantage: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Broadcast each episode's advantage over its generated tokens.

    advantage: (B,)   one scalar per trajectory
    loss_mask: (B, T) 1 on generated tokens, 0 on prompt / observation / padding
    returns:   (B, T) A_{i,t} = A_i * loss_mask_{i,t}
    """
    return advantage[:, None].to(torch.float32) * loss_mask.to(torch.float32)
