"""Where a causal language model keeps its transformer blocks: what FSDP shards one by one (model.py) and what
LoRA wraps (lora.py)."""

from __future__ import annotations

from torch import nn


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The transformer blocks (``model.model.layers`` in Qwen2/Llama/Mistral-style models)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if isinstance(layers, nn.ModuleList):
        return layers
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__} (expected model.model.layers)")
