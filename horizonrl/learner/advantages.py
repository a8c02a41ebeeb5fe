"""Advantage estimators, selected by ``algorithm.adv_estimator``.

    grpo                 group-normalised outcome (DeepSeekMath, arXiv 2402.03300, §4.1.2)
    rloo                 leave-one-out baseline (Ahmadian et al., arXiv 2402.14740, eq. 5)
    reinforce_plus_plus  discounted return, whitened over the batch (REINFORCE++, arXiv 2501.03262)
    gae                  generalised advantage estimation with a critic (Schulman et al., arXiv 1506.02438)

The multi-turn rule (what AgentGym-RL gets wrong): a trajectory interleaves generated tokens
(loss mask 1, the actions) with observation tokens (loss mask 0, the environment's reply).
Each turn's reward sits on the **last generated token of that turn** (see
:func:`place_token_rewards`), never on an observation token, and the token-level recursions
skip observation tokens: they are not actions, so they neither discount nor bootstrap; the
value and the advantage pass through them unchanged. A trajectory that ends on an
observation therefore still has its outcome reward where the loss can see it.

All token-level tensors are (B, T), right-padded; padding has mask 0 and reward 0.
"""

from __future__ import annotations

import torch

GRPO_EPS = 1e-6  # as verl (which AgentGym-RL builds on)
WHITEN_EPS = 1e-8

ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus", "gae")
OUTCOME_ESTIMATORS = ("grpo", "rloo")  # one scalar per trajectory
TOKEN_ESTIMATORS = ("reinforce_plus_plus", "gae")  # a per-token recursion over the rewards


# ---------------------------------------------------------------- outcome (per-trajectory) estimators


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


def rloo_outcome_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """RLOO: each episode's baseline is the mean of the OTHER n-1 episodes of its task.

    rewards: (n,)
    returns: (n,)  A_i = r_i - 1/(n-1) Σ_{j≠i} r_j  =  n/(n-1) · (r_i - mean(r))
    A group of one episode has no other episode: its advantage is 0.
    """
    rewards = rewards.to(torch.float32)
    n = rewards.numel()
    if n < 2:
        return torch.zeros_like(rewards)
    baseline = (rewards.sum() - rewards) / (n - 1)
    return rewards - baseline


def outcome_advantages(rewards: torch.Tensor, estimator: str, norm_by_std: bool = True) -> torch.Tensor:
    """(n,) -> (n,) for the outcome estimators ``grpo`` and ``rloo``."""
    if estimator == "grpo":
        return grpo_outcome_advantages(rewards, norm_by_std)
    if estimator == "rloo":
        return rloo_outcome_advantages(rewards)
    raise ValueError(f"{estimator!r} is not an outcome estimator (one of {OUTCOME_ESTIMATORS})")


def token_advantages(advantage: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Broadcast each episode's advantage over its generated tokens.

    advantage: (B,)   one scalar per trajectory
    loss_mask: (B, T) 1 on generated tokens, 0 on prompt / observation / padding
    returns:   (B, T) A_{i,t} = A_i * loss_mask_{i,t}
    """
    return advantage[:, None].to(torch.float32) * loss_mask.to(torch.float32)


# ---------------------------------------------------------------- where rewards sit


def place_token_rewards(
    loss_mask: torch.Tensor, turn_spans: list[tuple[int, int]], turn_rewards: list[float], reward: float
) -> torch.Tensor:
    """The per-token reward of one trajectory.

    loss_mask:    (L,) 1 on generated tokens
    turn_spans:   [(start, end)) token range of each generated turn
    turn_rewards: the environment's reward for each turn's action
    reward:       the episode return (the sum of the turn rewards)
    returns:      (L,) r_t = turn_rewards[i] at the last generated token of turn i, 0 elsewhere;
                  whatever part of ``reward`` the turn rewards do not account for (e.g. a
                  trajectory that reports only its outcome) goes on the LAST generated token.
    A trajectory without generated tokens gets no reward anywhere (it has nothing to train).
    """
    rewards = torch.zeros(loss_mask.shape[0], dtype=torch.float32)
    generated = torch.nonzero(loss_mask > 0).flatten()
    if generated.numel() == 0:
        return rewards
    placed = 0.0
    for (start, end), turn_reward in zip(turn_spans, turn_rewards):
        in_turn = generated[(generated >= start) & (generated < end)]
        if in_turn.numel() == 0 or turn_reward == 0.0:
            continue  # a turn with no generated token (cut off) cannot carry its reward
        rewards[in_turn[-1]] += turn_reward
        placed += turn_reward
    rewards[generated[-1]] += reward - placed
    return rewards


# ---------------------------------------------------------------- token-level estimators


def discounted_returns(token_rewards: torch.Tensor, loss_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """REINFORCE++'s return over the generated tokens only.

    token_rewards: (B, T) r_t (0 off generated tokens)
    loss_mask:     (B, T) 1 on generated tokens
    returns:       (B, T) G_t = r_t + γ G_{t'}  at a generated token t, where t' is the NEXT
                   generated token (observation tokens are skipped: no discount, no reward);
                   at an observation token G passes through from the next generated token.
    """
    mask = loss_mask.bool()
    out = torch.zeros_like(token_rewards, dtype=torch.float32)
    running = torch.zeros(token_rewards.shape[0], dtype=torch.float32)
    for t in reversed(range(token_rewards.shape[1])):
        running = torch.where(mask[:, t], token_rewards[:, t] + gamma * running, running)
        out[:, t] = running
    return out


def gae_advantages(
    token_rewards: torch.Tensor, values: torch.Tensor, loss_mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over the generated tokens (the actions); observation tokens pass value and advantage through.

    token_rewards: (B, T) r_t
    values:        (B, T) V_t, the critic's value of the state in which token t is generated
    loss_mask:     (B, T) 1 on generated tokens
    returns:       advantages (B, T), returns (B, T) = A_t + V_t (the critic's target)

    With t' the next generated token after t (none: V_{t'} = 0, the episode is over):
        δ_t = r_t + γ V_{t'} − V_t                          (GAE paper, eq. 11)
        A_t = δ_t + γ λ A_{t'}                              (eq. 16, as a recursion)
    """
    mask = loss_mask.bool()
    advantages = torch.zeros_like(values, dtype=torch.float32)
    returns = torch.zeros_like(values, dtype=torch.float32)
    next_value = torch.zeros(values.shape[0], dtype=torch.float32)
    last_adv = torch.zeros(values.shape[0], dtype=torch.float32)
    for t in reversed(range(values.shape[1])):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        last_adv = torch.where(mask[:, t], delta + gamma * lam * last_adv, last_adv)
        next_value = torch.where(mask[:, t], values[:, t].float(), next_value)
        advantages[:, t] = last_adv
        returns[:, t] = last_adv + next_value
    return advantages, returns


def masked_moments(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(count, Σx, Σx²) over the masked entries, float64: these add up across micro-batches and ranks."""
    m = mask.to(torch.float64)
    x = x.to(torch.float64) * m
    return torch.stack([m.sum(), x.sum(), (x * x).sum()])


def whiten(x: torch.Tensor, mask: torch.Tensor, moments: torch.Tensor, eps: float = WHITEN_EPS) -> torch.Tensor:
    """(x − mean) / (std + eps) on masked entries, 0 elsewhere; mean/std from ``moments`` of the whole batch.

    std is the population standard deviation (verl's masked_whiten uses the unbiased one; with
    thousands of tokens the difference is nil, and this form combines across ranks exactly).
    """
    count, total, squares = (float(v) for v in moments)
    count = max(count, 1.0)
    mean = total / count
    std = max(squares / count - mean * mean, 0.0) ** 0.5
    return ((x - mean) / (std + eps)) * mask.to(x.dtype)
