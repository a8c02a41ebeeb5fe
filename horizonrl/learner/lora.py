"""Low-rank adapters on the policy (``learner.lora``): the layers, their first values, merging, what the engines get.

    h = W₀ x + ΔW x,   ΔW = s · B A,   s = α / r          (Hu et al. 2021, arXiv 2106.09685, eq. 3 and §4.1)

A (r × in) starts as ``nn.Linear``'s own init (Kaiming-uniform, as PEFT does), B (out × r) at zero, so the
adapted model starts exactly at the base model; W₀ and every other weight are frozen and only A and B are
trained (AdamW holds state for them alone).

Why the layers are this project's own and not PEFT's: :class:`LoRALinear` *is* the ``nn.Linear`` it adapts, with
two child layers added, so every base weight keeps its state-dict name (``…q_proj.weight``; PEFT's wrapper renames
it ``…q_proj.base_layer.weight``). The checkpoint loader (rank 0 reads the Hugging Face files and broadcasts them
into the FSDP2 shards, model.py), the training-state checkpoints and the merged export then need no name mapping,
and the adapter's own names are PEFT's with a prefix (core/adapter_format.py), so PEFT, transformers and vLLM load
what the learner writes. The layers are built on the meta device like the rest of the model; their first values
come from :func:`initial_adapter` on rank 0 with the checkpoint's, seeded, so every run starts the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from horizonrl.core.adapter_format import LORA_FACTORS, peft_name
from horizonrl.learner.layers import decoder_layers


@dataclass(frozen=True)
class LoraSettings:
    rank: int
    alpha: float
    target_modules: tuple[str, ...]

    @property
    def scaling(self) -> float:
        """s = α / r."""
        return self.alpha / self.rank

    @classmethod
    def of(cls, lora) -> "LoraSettings | None":
        """From a ``LoraConfig`` (core/config.py), None for None."""
        return None if lora is None else cls(lora.rank, lora.alpha, tuple(lora.target_modules))

    @classmethod
    def from_config(cls, config) -> "LoraSettings | None":
        """A training run's ``learner.lora``."""
        return cls.of(config.learner.lora)


class LoRALinear(nn.Linear):
    """``y = x W₀ᵀ + b + s · (x Aᵀ) Bᵀ``: a linear layer (its ``weight`` and ``bias`` the base's) with a low-rank
    update beside it. Computing the update from x (two thin matmuls, r ≪ in) rather than forming W₀ + sBA keeps
    the base weight untouched and costs 2·r·(in + out) FLOPs per token against the base's 2·in·out."""

    def __init__(self, in_features: int, out_features: int, bias: bool, rank: int, alpha: float,
                 device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.lora_A = nn.Linear(in_features, rank, bias=False, device=device, dtype=dtype)
        self.lora_B = nn.Linear(rank, out_features, bias=False, device=device, dtype=dtype)
        self.scaling = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.lora_B(self.lora_A(x)) * self.scaling


def add_lora(model: nn.Module, settings: LoraSettings) -> list[str]:
    """Replace each target linear layer of the decoder layers by a :class:`LoRALinear` holding the same base
    parameters, and freeze everything but the adapters. Works on the meta device (before sharding). Returns the
    adapted layers' names; a target name that matches no linear layer is an error naming those that exist."""
    layers = decoder_layers(model)
    prefix = next(name for name, module in model.named_modules() if module is layers)
    adapted, linear_names = [], set()
    for index, layer in enumerate(layers):
        for name, module in list(layer.named_modules()):
            leaf = name.rsplit(".", 1)[-1]
            if type(module) is nn.Linear:
                linear_names.add(leaf)
            if leaf not in settings.target_modules or type(module) is not nn.Linear:
                continue
            parent = layer.get_submodule(name.rsplit(".", 1)[0]) if "." in name else layer
            replacement = LoRALinear(module.in_features, module.out_features, module.bias is not None,
                                     settings.rank, settings.alpha, device=module.weight.device,
                                     dtype=module.weight.dtype)
            replacement.weight = module.weight
            replacement.bias = module.bias
            setattr(parent, leaf, replacement)
            adapted.append(f"{prefix}.{index}.{name}")
    missing = set(settings.target_modules) - linear_names
    if missing:
        raise ValueError(f"learner.lora.target_modules {sorted(missing)} match no linear layer of the decoder layers; "
                         f"they have {sorted(linear_names)}")
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(is_adapter_parameter(name))
    return adapted


def is_adapter_parameter(name: str) -> bool:
    """``…q_proj.lora_A.weight`` and ``…q_proj.lora_B.weight``."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] in LORA_FACTORS and parts[-1] == "weight"


def adapted_layers(names) -> list[str]:
    """The adapted layers' names (``…q_proj``) among parameter names, in order, each once."""
    return list(dict.fromkeys(name.rsplit(".", 2)[0] for name in names if is_adapter_parameter(name)))


def initial_adapter(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """The adapters' first values, on the CPU in the model's dtype: A as ``nn.Linear`` initialises a weight
    (Kaiming-uniform with a = √5, i.e. U(−1/√in, 1/√in)), B zero, so ΔW = 0. Seeded: the same run, the same A."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, parameter in model.named_parameters():
        if not is_adapter_parameter(name):
            continue
        tensor = torch.zeros(parameter.shape, dtype=parameter.dtype)
        if name.endswith("lora_A.weight"):
            bound = 1.0 / math.sqrt(parameter.shape[1])
            tensor.uniform_(-bound, bound, generator=generator)
        out[name] = tensor
    return out


def merged_state_dict(state_dict: dict[str, torch.Tensor], settings: LoraSettings) -> dict[str, torch.Tensor]:
    """The base model's state dict with each adapter folded in, W = W₀ + s · B A (computed in float32, stored in
    W₀'s dtype), and the adapter tensors left out: a plain Hugging Face model (the export)."""
    merged = {name: tensor for name, tensor in state_dict.items() if not is_adapter_parameter(name)}
    for layer in adapted_layers(state_dict):
        base = state_dict[f"{layer}.weight"]
        b, a = state_dict[f"{layer}.lora_B.weight"].float(), state_dict[f"{layer}.lora_A.weight"].float()
        delta = settings.scaling * (b @ a)
        merged[f"{layer}.weight"] = (base.float() + delta).to(base.dtype)
    return merged


def adapter_tensors(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter in PEFT's naming, as a checkpoint keeps it (B unscaled: the config's alpha applies)."""
    return {peft_name(name): tensor.contiguous() for name, tensor in state_dict.items() if is_adapter_parameter(name)}


def adapter_to_send(model: nn.Module, settings: LoraSettings) -> list[tuple[str, torch.Tensor]]:
    """A version for the engines: the adapter in PEFT's naming with s folded into B (B' = s·B: the engine's adapter
    has α = r, core/adapter_format.py). The tensors are the (FSDP-sharded) parameters, detached; gathered later,
    bucket by bucket, like full weights."""
    out = []
    for name, parameter in model.named_parameters():
        if is_adapter_parameter(name):
            tensor = parameter.detach()
            out.append((peft_name(name), tensor * settings.scaling if name.endswith("lora_B.weight") else tensor))
    return out


def save_adapter(directory, state_dict: dict[str, torch.Tensor], settings: LoraSettings, base_model: str = "") -> None:
    """The adapter of ``state_dict`` as a PEFT adapter directory (loads in PEFT/transformers and in vLLM)."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    from horizonrl.core.adapter_format import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, adapter_config

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    targets = {layer.rsplit(".", 1)[-1] for layer in adapted_layers(state_dict)}
    save_file(adapter_tensors(state_dict), str(directory / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
    config = adapter_config(settings.rank, settings.alpha, targets, base_model)
    (directory / ADAPTER_CONFIG_FILE).write_text(json.dumps(config, indent=1))
