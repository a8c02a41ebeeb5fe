"""A LoRA adapter's names and files, as the learner writes them and the engines read them (bottom layer: no torch).

The format is PEFT's, which transformers (``PeftModel.from_pretrained``) and vLLM (``LoRARequest``) both load: a
directory with ``adapter_config.json`` and ``adapter_model.safetensors``, whose tensors are named after the base
model's linear layers, ``base_model.model.<module>.lora_A.weight`` (r × in) and ``….lora_B.weight`` (out × r).
The adapter changes a layer's weight by ΔW = s · B A with s = lora_alpha / r (Hu et al. 2021, arXiv 2106.09685,
eq. 3 and §4.1).

On the wire (a LoRA run's weight versions, learner/weight_broadcast.py) the same names travel, with the scaling
folded into B (B' = s · B, so ΔW = B' A): the engine's adapter then has lora_alpha = r (s = 1) and needs none of
the learner's settings, only the tensors. Checkpoints keep PEFT's own convention (B unscaled, the run's alpha).
"""

from __future__ import annotations

from typing import Any, Iterable

PEFT_PREFIX = "base_model.model."  # PEFT wraps the causal LM twice (PeftModel -> LoraModel -> the model)
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
LORA_FACTORS = ("lora_A", "lora_B")
# The adapter as it lives in a checkpoint directory (learner/services.py writes it beside the merged weights).
CHECKPOINT_ADAPTER_DIR = "adapter"


def peft_name(parameter: str) -> str:
    """``model.layers.0.self_attn.q_proj.lora_A.weight`` -> PEFT's ``base_model.model.`` + the same."""
    return PEFT_PREFIX + parameter


def parameter_name(peft: str) -> str:
    """The inverse of :func:`peft_name`."""
    if not peft.startswith(PEFT_PREFIX):
        raise ValueError(f"{peft!r} is not a PEFT adapter tensor name (it does not start with {PEFT_PREFIX!r})")
    return peft[len(PEFT_PREFIX):]


def is_adapter_tensor(name: str) -> bool:
    """Whether ``name`` is one of an adapter's factors in PEFT's naming (a full model has no such name)."""
    parts = name.split(".")
    return name.startswith(PEFT_PREFIX) and len(parts) >= 2 and parts[-2] in LORA_FACTORS and parts[-1] == "weight"


def adapted_module(name: str) -> str:
    """``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` -> ``model.layers.0.self_attn.q_proj``."""
    if not is_adapter_tensor(name):
        raise ValueError(f"{name!r} is not a LoRA factor in PEFT's naming")
    return parameter_name(name).rsplit(".", 2)[0]


def adapter_config(rank: int, alpha: float, target_modules: Iterable[str], base_model: str = "") -> dict[str, Any]:
    """PEFT's ``adapter_config.json`` for a plain LoRA (no dropout, no bias, no extra trained modules)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": int(rank),
        "lora_alpha": float(alpha),
        "target_modules": sorted(set(target_modules)),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }


def wire_adapter_config(shapes: dict[str, list[int]]) -> dict[str, Any]:
    """The engine's ``adapter_config.json`` for a version received off the wire (scaling folded into B: alpha = r),
    from its tensors' names and shapes: r is lora_A's first dimension, the target modules the adapted layers' names.
    Every factor must have the same rank (PEFT's config has one)."""
    ranks = {shape[0] for name, shape in shapes.items() if name.split(".")[-2] == "lora_A"}
    if len(ranks) != 1:
        raise ValueError(f"an adapter version must have one rank, these lora_A factors have {sorted(ranks)}")
    rank = ranks.pop()
    targets = {adapted_module(name).rsplit(".", 1)[-1] for name in shapes}
    return adapter_config(rank, float(rank), targets)
