"""Which dtype each part of the system holds its weights and computes in (bottom layer: no torch).

The policy, resolved once per process from the config and the device it runs on:

    master weights, gradients, AdamW state   learner.param_dtype      (default float32)
    learner forward/backward                 learner.compute_dtype    (auto: bfloat16 on CUDA, float32 on CPU)
    gradient reduce-scatter                  float32, always
    engine weights and compute               rollout.engine.dtype     (auto: model.dtype if set, else
                                                                       bfloat16 on a GPU, float32 on the CPU)
    weights on the wire                      the engine's dtype (the learner casts before it sends)
    learner attention                        flash_attention_2 when installed AND the compute dtype is
                                             bfloat16/float16 on CUDA (it rejects float32), else sdpa

Why float32 master weights: bfloat16 has 8 bits of mantissa, so a weight w keeps an update only
if it is larger than about |w|·2⁻⁹; AdamW with lr 1e-6 moves each weight by ~1e-6, which rounds
away on every weight larger than ~5e-4 in magnitude. FSDP2's MixedPrecisionPolicy keeps the sharded
float32 parameter for the optimizer and all-gathers a bfloat16 copy for the forward pass.

``model.dtype`` (one dtype for learner and engine) is kept for old config files: it is the engine's
dtype where ``rollout.engine.dtype`` is auto, and it no longer changes the learner.
"""

from __future__ import annotations

from dataclasses import dataclass

LOW_PRECISION = ("bfloat16", "float16")


@dataclass(frozen=True)
class PrecisionPolicy:
    """Dtype names (``getattr(torch, name)`` turns each into a torch dtype)."""

    param_dtype: str  # sharded master weights; gradients and optimizer state follow them
    compute_dtype: str  # the unsharded copy every forward/backward runs in
    reduce_dtype: str  # gradient reduce-scatter across learner ranks
    engine_dtype: str  # the inference engine's weights; what the learner sends
    attention: str  # the learner's attn_implementation

    @property
    def mixed(self) -> bool:
        """True when FSDP2 must cast (compute differs from the master weights)."""
        return self.compute_dtype != self.param_dtype


def resolve_compute_dtype(compute_dtype: str, learner_on_cuda: bool) -> str:
    if compute_dtype == "auto":
        return "bfloat16" if learner_on_cuda else "float32"
    return compute_dtype


def resolve_engine_dtype(engine_dtype: str, legacy_model_dtype: str | None, engine_on_gpu: bool) -> str:
    """The engine's dtype: explicit ``rollout.engine.dtype``, else the legacy ``model.dtype``, else by device.

    Both set and different is an error: which of the two was meant cannot be guessed. The legacy
    ``model.dtype`` counts as unset when it is None or "auto"."""
    if legacy_model_dtype == "auto":
        legacy_model_dtype = None
    if engine_dtype != "auto":
        if legacy_model_dtype is not None and legacy_model_dtype != engine_dtype:
            raise ValueError(f"model.dtype={legacy_model_dtype} and rollout.engine.dtype={engine_dtype} disagree; "
                             "drop model.dtype (deprecated) and set rollout.engine.dtype")
        return engine_dtype
    if legacy_model_dtype is not None:
        return legacy_model_dtype
    return "bfloat16" if engine_on_gpu else "float32"


def learner_attention(compute_dtype: str, learner_on_cuda: bool, flash_attn_installed: bool) -> str:
    """flash-attn 2 runs only on CUDA in bfloat16/float16; everything else gets PyTorch's SDPA."""
    if learner_on_cuda and flash_attn_installed and compute_dtype in LOW_PRECISION:
        return "flash_attention_2"
    return "sdpa"


def resolve_precision(param_dtype: str, compute_dtype: str, engine_dtype: str, legacy_model_dtype: str | None, *,
                      learner_on_cuda: bool, engine_on_gpu: bool, flash_attn_installed: bool) -> PrecisionPolicy:
    """The whole policy from the config's names and the devices (see the module docstring)."""
    compute = resolve_compute_dtype(compute_dtype, learner_on_cuda)
    if param_dtype != "float32" and compute == "float32":
        raise ValueError(f"learner.param_dtype={param_dtype} with compute_dtype float32: the master weights would "
                         "hold less precision than the compute; use param_dtype float32")
    return PrecisionPolicy(
        param_dtype=param_dtype,
        compute_dtype=compute,
        reduce_dtype="float32",
        engine_dtype=resolve_engine_dtype(engine_dtype, legacy_model_dtype, engine_on_gpu),
        attention=learner_attention(compute, learner_on_cuda, flash_attn_installed),
    )


def precision_from_config(config, *, learner_on_cuda: bool, engine_on_gpu: bool,
                          flash_attn_installed: bool) -> PrecisionPolicy:
    """:func:`resolve_precision` with the names of a :class:`~horizonrl.core.config.TrainConfig`."""
    return resolve_precision(config.learner.param_dtype, config.learner.compute_dtype, config.rollout.engine.dtype,
                             config.model.dtype, learner_on_cuda=learner_on_cuda, engine_on_gpu=engine_on_gpu,
                             flash_attn_installed=flash_attn_installed)
