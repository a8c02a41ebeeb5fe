"""The trainer–engine log-probability mismatch, per turn.

The engine's behaviour log-probabilities and the learner's own, of the same tokens under the same
weights, should agree (to float rounding: both are log_softmax(logits / T) over the same nucleus).
A gap that grows with the turn is the signature of a sequence the learner trains on that differs
from what the engine was prompted with (retokenization drift; a chat template that rewrites
history and was not branched). Measured only on tokens the learner's current weights generated
(``Sample.turn_of_token``): older tokens differ by policy lag as well, which is not this.

    Δ_t = |log π_learner(y_t | x_<t) − log π_engine(y_t | x_<t)|
    mismatch/turn_k_mean = mean of Δ_t over the step's measured tokens of turn k (1-based)
    mismatch/turn_k_max  = max of Δ_t over the same tokens
    mismatch/mean, mismatch/max, mismatch/tokens: over every measured token

Turns past ``MISMATCH_TURNS`` share the last key (``turn_{MISMATCH_TURNS}``), so TensorBoard gets a
bounded set of names however long episodes grow.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

MISMATCH_TURNS = 16  # turns reported one by one; later turns are counted in the last


class TurnMismatch:
    """Per-turn sums, counts and maxima of Δ, added to per micro-batch and reduced over ranks once."""

    def __init__(self) -> None:
        self.sums = torch.zeros(MISMATCH_TURNS + 1, dtype=torch.float64)  # index 0 unused: turns are 1-based
        self.counts = torch.zeros(MISMATCH_TURNS + 1, dtype=torch.float64)
        self.maxes = torch.zeros(MISMATCH_TURNS + 1, dtype=torch.float64)

    def add(self, turns: torch.Tensor, learner_logprobs: torch.Tensor, engine_logprobs: torch.Tensor) -> None:
        """turns, learner_logprobs, engine_logprobs: (N,) of the same tokens; turns < 1 are not measured."""
        measured = turns >= 1
        if not bool(measured.any()):
            return
        delta = (learner_logprobs.detach()[measured].double() - engine_logprobs[measured].double()).abs().cpu()
        index = turns[measured].clamp(max=MISMATCH_TURNS).cpu()
        self.sums.index_add_(0, index, delta)
        self.counts.index_add_(0, index, torch.ones_like(delta))
        self.maxes.scatter_reduce_(0, index, delta, reduce="amax")

    def all_reduce(self) -> "TurnMismatch":
        """The sums over every rank (a collective: every rank calls it)."""
        totals = torch.stack([self.sums, self.counts])
        maxes = self.maxes.clone()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(totals, op=dist.ReduceOp.SUM)
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
        out = TurnMismatch()
        out.sums, out.counts, out.maxes = totals[0], totals[1], maxes
        return out

    def metrics(self) -> dict[str, float]:
        """The TensorBoard scalars (see the module docstring); none when no token was measured."""
        total = float(self.counts.sum())
        if total == 0:
            return {}
        out = {"mismatch/mean": float(self.sums.sum()) / total, "mismatch/max": float(self.maxes.max()),
               "mismatch/tokens": total}
        for k in range(1, MISMATCH_TURNS + 1):
            if self.counts[k] > 0:
                out[f"mismatch/turn_{k}_mean"] = float(self.sums[k] / self.counts[k])
                out[f"mismatch/turn_{k}_max"] = float(self.maxes[k])
        return out
