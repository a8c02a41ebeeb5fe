"""Learner GPU memory per rank, from a model's shape: the formula behind docs/gpu.md's sizing table
and the prediction ``scripts/gpu_check.py`` compares the measured peak against.

Pure arithmetic (no torch). The setting it describes is this learner's: FSDP2 over W ranks, master
weights, gradients and AdamW state in float32 and sharded, compute in bfloat16 (MixedPrecisionPolicy),
Hugging Face Qwen2-style decoder layers with SDPA/flash attention, the loss of algorithm.py.

    states        params 4P/W + grads 4P/W + AdamW (exp_avg, exp_avg_sq) 8P/W           = 16P/W
    unsharded     bf16 copies FSDP2 all-gathers: the root (embeddings, head, final norm) stays
                  gathered from forward to backward (2·P_root); two layers in flight (2·2·P_layer)
    activations   per token, saved for backward, bf16 (counted from the autograd graph of
                  transformers' Qwen2 layer, re-measured by ``gpu_check --cpu``):
                      per layer   16·H + 4·q + 4·kv + 8·I     (q = heads·head_dim, kv = kv_heads·head_dim)
                      outside     6·H + 4·head_dim             (final norm, rotary tables)
                  with activation checkpointing a layer keeps only its bf16 input (2·H), outside
                  6·H, and one layer's full activations exist during its recompute
    logits        per token, all of them loss tokens (upper bound): the bf16 logits 2V, what the loss
                  keeps for backward (log-softmax, probabilities, the entropy's mask and product: 13V),
                  and the float32 copy plus its gradient alive at the peak (8V)                 = 23V
    optimizer     AdamW's foreach step allocates a float32 temporary of the shard (sqrt of exp_avg_sq): 4P/W
    end of backward  the root's gradient, unsharded: bf16 2·P_root + the float32 copy reduced 4·P_root

Peak = max(forward/backward, end of backward, optimizer step, weight gather), each with the states.
The broadcast to the engines adds, on rank 0, one bucket plus the largest tensor gathered in the
engine's dtype (:func:`broadcast_bytes`; learner/weight_gather.py gathers parameter by parameter
into the bucket). The forward/backward term counts the gradients too: with more than one micro-batch
per update they exist from the first micro-batch's backward on.
"""

from __future__ import annotations

from dataclasses import dataclass

from horizonrl.core.model_shape import LOGITS_BYTES_PER_VOCAB, ModelShape  # noqa: F401 - ModelShape lived here

GB = 1e9
COMPUTE_BYTES = 2  # bfloat16
MASTER_BYTES = 4  # float32 params, grads, each AdamW moment


# Qwen2.5 shapes (the models' config.json): vocab, hidden, intermediate, layers, heads, kv heads, head_dim, tied
QWEN25 = {
    "0.5B": ModelShape("Qwen2.5-0.5B", 151936, 896, 4864, 24, 14, 2, 64, True),
    "1.5B": ModelShape("Qwen2.5-1.5B", 151936, 1536, 8960, 28, 12, 2, 128, True),
    "7B": ModelShape("Qwen2.5-7B", 152064, 3584, 18944, 28, 28, 4, 128, False),
    "32B": ModelShape("Qwen2.5-32B", 152064, 5120, 27648, 64, 40, 8, 128, False),
}


@dataclass(frozen=True)
class LearnerMemory:
    """Bytes on one learner rank (see the module docstring for each term)."""

    params: float
    grads: float
    adamw: float
    unsharded: float
    activations: float
    logits: float
    optimizer_temp: float
    root_grad_reduce: float
    broadcast: float

    @property
    def states(self) -> float:
        return self.params + self.grads + self.adamw

    @property
    def peak(self) -> float:
        forward_backward = self.states + self.unsharded + self.activations + self.logits
        end_of_backward = self.states + self.unsharded + self.root_grad_reduce
        optimizer = self.states + self.optimizer_temp
        weight_gather = self.states + self.broadcast  # after the step: activations and gathered copies are freed
        return max(forward_backward, end_of_backward, optimizer, weight_gather)

    def as_dict(self) -> dict[str, float]:
        out = {name: getattr(self, name) for name in self.__dataclass_fields__}
        out.update(states=self.states, peak=self.peak)
        return out


def learner_memory(shape: ModelShape, *, world_size: int, tokens: int, checkpointing: bool,
                   bucket_bytes: int = 0, engine_bytes: int = COMPUTE_BYTES, optimizer_foreach: bool = True,
                   rank0: bool = True) -> LearnerMemory:
    """Bytes per rank for micro-batches of ``tokens`` padded tokens on ``world_size`` FSDP ranks.

    ``bucket_bytes``: the weight broadcast's bucket (0: leave the broadcast out); it is on rank 0 only."""
    shard = shape.params / world_size
    return LearnerMemory(
        params=MASTER_BYTES * shard,
        grads=MASTER_BYTES * shard,
        adamw=2 * MASTER_BYTES * shard,
        unsharded=COMPUTE_BYTES * (shape.root_params + 2 * shape.layer_params),
        activations=tokens * shape.activation_bytes_per_token(checkpointing),
        logits=tokens * shape.logits_bytes_per_token,
        optimizer_temp=MASTER_BYTES * shard if optimizer_foreach else 0.0,
        root_grad_reduce=(COMPUTE_BYTES + MASTER_BYTES) * shape.root_params,
        broadcast=broadcast_bytes(shape, world_size, bucket_bytes, engine_bytes) if (bucket_bytes and rank0) else 0.0,
    )


def broadcast_bytes(shape: ModelShape, world_size: int, bucket_bytes: int, engine_bytes: int = COMPUTE_BYTES) -> float:
    """Rank 0's extra device memory while it gathers a version for the engines (weight_gather.gather_buckets):
    the staging bucket (a tensor larger than a bucket gets a bucket of its own size), and for the largest
    tensor its shard cast to the engine's dtype plus, with more than one rank, the full tensor gathered
    from it (on one rank ``full_tensor()`` returns the cast shard itself: measured on an H200, 0.5B and
    1.5B, the extra was exactly bucket + one cast tensor)."""
    largest = engine_bytes * shape.largest_tensor
    gathered = largest if world_size > 1 else 0.0
    return max(bucket_bytes, largest) + largest / world_size + gathered


def max_tokens(shape: ModelShape, *, world_size: int, checkpointing: bool, budget_bytes: float,
               bucket_bytes: int = 0) -> int:
    """The largest micro-batch (padded tokens) whose peak fits ``budget_bytes``; 0 if the states alone do not."""
    fixed = learner_memory(shape, world_size=world_size, tokens=0, checkpointing=checkpointing,
                           bucket_bytes=bucket_bytes)
    if fixed.peak > budget_bytes:
        return 0
    per_token = shape.activation_bytes_per_token(checkpointing) + shape.logits_bytes_per_token
    return max(0, int((budget_bytes - fixed.states - fixed.unsharded) // per_token))


TABLE_ROWS = (("1.5B", 1), ("1.5B", 2), ("1.5B", 8), ("7B", 1), ("7B", 2), ("7B", 4), ("7B", 8),
              ("32B", 4), ("32B", 8), ("32B", 16), ("32B", 32))


def sizing_table(budget_gb: float = 80.0, tokens: int = 8192, bucket_mb: float = 256.0,
                 rows_of: tuple[tuple[str, int], ...] = TABLE_ROWS) -> str:
    """docs/gpu.md's table (Markdown): per model and FSDP world size W, GB per learner rank (rank 0,
    which also gathers the broadcast's buckets)."""
    bucket = int(bucket_mb * (1 << 20))
    rows = ["| model | params | W | params+grads+AdamW | unsharded bf16 | act./token (AC off / on) | logits/token | "
            f"weight gather (rank 0) | peak @ {tokens} tok (AC off / on) | max tokens in {budget_gb:.0f} GB "
            "(AC off / on) |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for key, world in rows_of:
        shape = QWEN25[key]
        off = learner_memory(shape, world_size=world, tokens=tokens, checkpointing=False, bucket_bytes=bucket)
        on = learner_memory(shape, world_size=world, tokens=tokens, checkpointing=True, bucket_bytes=bucket)
        fits = [max_tokens(shape, world_size=world, checkpointing=ac, budget_bytes=budget_gb * GB, bucket_bytes=bucket)
                for ac in (False, True)]
        rows.append(
            f"| {shape.name} | {shape.params / 1e9:.2f} B | {world} | {off.states / GB:.1f} | "
            f"{off.unsharded / GB:.2f} | {shape.activation_bytes_per_token(False) / 1e6:.2f} / "
            f"{shape.activation_bytes_per_token(True) / 1e6:.2f} MB | "
            f"{shape.logits_bytes_per_token / 1e6:.2f} MB | {off.broadcast / GB:.2f} | "
            f"{off.peak / GB:.1f} / {on.peak / GB:.1f} | "
            + " / ".join("does not fit" if n == 0 else f"{n:,}" for n in fits) + " |")
    return "\n".join(rows)
