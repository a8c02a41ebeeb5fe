"""Turn-level credit: GiGPO's two-level advantage (Feng et al., "Group-in-Group Policy Optimization for
LLM Agent Training", arXiv 2505.10978), selected by ``algorithm.adv_estimator=gigpo``.

With an outcome estimator every turn of an episode gets the same advantage, however much that turn did
for the outcome. GiGPO adds a second, step-level comparison: among the n episodes of one task, the turns
taken from the **same environment state** (an anchor state) form a step group, and each turn is compared
with the other turns of its step group on the discounted return that followed it.

For the n episodes i = 1..n of one task, with turn rewards r_{i,k} (k = 0..K_i − 1) and anchor state s_{i,k}
(the observation the agent answered at turn k):

    R_i      = Σ_k r_{i,k}                                              episode return
    A^E_i    = (R_i − mean_j R_j) / (std_j R_j + ε)                     episode level (GRPO)
    G_{i,k}  = Σ_{k' ≥ k} γ^{k'−k} r_{i,k'}                             discounted return from turn k
    S(s)     = {(j, k') : s_{j,k'} = s}                                 the step group of state s
    A^S_{i,k} = (G_{i,k} − mean_{S(s_{i,k})} G) / (std_{S(s_{i,k})} G + ε)   step level
    A_{i,k}  = A^E_i + ω · A^S_{i,k}                                    the turn's advantage

The paper's defaults: ω = 1, γ = 0.95 (``algorithm.gigpo_step_weight``, ``algorithm.gigpo_gamma``).

std is the unbiased one, as in GRPO; a step group of one turn has nothing to compare with and gives
A^S = 0, and with ``norm_by_std=False`` both levels are only centred (the paper's "mean-norm" variant).
Every generated token of turn k carries A_{i,k}; observation tokens carry nothing.

The anchor state is read from the tokens the policy saw before the turn: the prompt for turn 0, else the
observation tokens between the previous turn's end and this turn's start. The same observation after the
same chat template gives the same tokens, so no key needs to travel in the trajectory message. It is the
*current observation*, not the history, exactly as GiGPO's anchor: two positions that the environment
describes in the same words are one state (Signpost's "A sign points left." at two crossroads are).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from horizonrl.learner.advantages import GRPO_EPS, grpo_outcome_advantages

GIGPO = "gigpo"
TURN_ESTIMATORS = (GIGPO,)  # one advantage per turn


@dataclass(frozen=True)
class GiGPOSettings:
    gamma: float = 0.95  # the paper's discount per turn
    step_weight: float = 1.0  # ω, the paper's default
    norm_by_std: bool = True


@dataclass(frozen=True)
class EpisodeTurns:
    """What GiGPO needs of one episode: its return, and per turn its reward and anchor state key."""

    episode_return: float
    turn_rewards: list[float]
    state_keys: list[bytes]


def episode_turns(token_ids: np.ndarray, turn_spans: list[tuple[int, int]], turn_rewards: list[float],
                  reward: float) -> EpisodeTurns:
    """An episode's turns as GiGPO reads them.

    Whatever part of the episode return ``reward`` the turn rewards do not account for (a sender that reports
    only its outcome) is added to the last turn, as :func:`place_token_rewards` puts it on the last generated token.
    """
    rewards = [float(r) for r in turn_rewards[:len(turn_spans)]]
    rewards += [0.0] * (len(turn_spans) - len(rewards))
    if rewards:
        rewards[-1] += reward - sum(rewards)
    return EpisodeTurns(float(reward), rewards, anchor_state_keys(token_ids, turn_spans))


def anchor_state_keys(token_ids: np.ndarray, turn_spans: list[tuple[int, int]]) -> list[bytes]:
    """(K,) one key per turn: a digest of the tokens between the previous turn's end (0 for the first turn)
    and this turn's start — the prompt, then each observation as the chat template wrapped it."""
    tokens = np.ascontiguousarray(token_ids, dtype=np.int64)
    keys, previous_end = [], 0
    for start, end in turn_spans:
        keys.append(hashlib.blake2b(tokens[previous_end:start].tobytes(), digest_size=16).digest())
        previous_end = end
    return keys


def discounted_turn_returns(turn_rewards: list[float], gamma: float) -> torch.Tensor:
    """(K,) G_k = r_k + γ G_{k+1}, G_K = 0: the discounted return from turn k to the episode's end."""
    returns = torch.zeros(len(turn_rewards), dtype=torch.float64)
    running = 0.0
    for k in reversed(range(len(turn_rewards))):
        running = turn_rewards[k] + gamma * running
        returns[k] = running
    return returns


def step_group_advantages(turn_returns: list[torch.Tensor], state_keys: list[list[bytes]], norm_by_std: bool = True,
                          eps: float = GRPO_EPS) -> list[torch.Tensor]:
    """A^S of every turn of every episode of one task.

    turn_returns: n tensors (K_i,) of G_{i,k};  state_keys: n lists (K_i,) of anchor keys s_{i,k}
    returns:      n tensors (K_i,) float32: (G_{i,k} − mean G over its step group) / (std + eps), 0 for a
                  step group of one turn (std is unbiased; without norm_by_std the centred return).
    """
    members: dict[bytes, list[tuple[int, int]]] = {}
    for i, keys in enumerate(state_keys):
        for k, key in enumerate(keys):
            members.setdefault(key, []).append((i, k))
    out = [torch.zeros(len(keys), dtype=torch.float32) for keys in state_keys]
    for turns in members.values():
        returns = torch.stack([turn_returns[i][k] for i, k in turns]).to(torch.float32)
        advantages = grpo_outcome_advantages(returns, norm_by_std, eps)  # 0 for a group of one
        for (i, k), advantage in zip(turns, advantages.tolist()):
            out[i][k] = advantage
    return out


def turns_sharing_a_state(state_keys: list[list[bytes]]) -> int:
    """How many turns of a group are in a step group of two or more (the rest get A^S = 0)."""
    counts = Counter(key for keys in state_keys for key in keys)
    return sum(n for n in counts.values() if n > 1)


def gigpo_turn_advantages(episodes: list[EpisodeTurns], settings: GiGPOSettings) -> list[torch.Tensor]:
    """A_{i,k} = A^E_i + ω A^S_{i,k} for the n episodes of one task: n tensors (K_i,) (see the module docstring)."""
    episode_level = grpo_outcome_advantages(torch.tensor([e.episode_return for e in episodes]), settings.norm_by_std)
    step_level = step_group_advantages([discounted_turn_returns(e.turn_rewards, settings.gamma) for e in episodes],
                                       [e.state_keys for e in episodes], settings.norm_by_std)
    return [episode_level[i] + settings.step_weight * step_level[i] for i in range(len(episodes))]


def turn_token_advantages(loss_mask: torch.Tensor, turn_spans: list[tuple[int, int]],
                          turn_advantages: torch.Tensor) -> torch.Tensor:
    """(L,) A_t = A_k on every generated token t of turn k (loss mask 1 in ``turn_spans[k]``), 0 elsewhere."""
    out = torch.zeros(loss_mask.shape[0], dtype=torch.float32)
    for (start, end), advantage in zip(turn_spans, turn_advantages.tolist()):
        out[start:end] = advantage
    return out * (loss_mask > 0).to(torch.float32)
