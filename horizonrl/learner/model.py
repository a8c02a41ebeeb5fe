"""The policy model: Hugging Face loading, FSDP2 sharding, full-state gathering, HF checkpoints."""

from __future__ import annotations

import importlib.util
import logging
import shutil
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger(__name__)

# Files of a model directory that are not weights or the model config: copied into every
# checkpoint so that it loads (tokenizer, chat template) exactly like the starting model.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "generation_config.json",
)


def resolve_backend(backend: str) -> str:
    """'auto' -> 'nccl' with CUDA, else 'gloo'."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return backend


def attention_implementation(device: torch.device) -> str:
    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def load_model(path: str, dtype: str, device: torch.device) -> nn.Module:
    """The Hugging Face causal LM at ``path`` (local directory), on the CPU, ready to shard."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=getattr(torch, dtype), attn_implementation=attention_implementation(device)
    )
    model.config.use_cache = False
    return model


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The transformer blocks (``model.model.layers`` in Qwen2/Llama/Mistral-style models)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if isinstance(layers, nn.ModuleList):
        return layers
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__} (expected model.model.layers)")


def shard_model(model: nn.Module, device_type: str) -> nn.Module:
    """FSDP2: each decoder layer is one all-gather unit, then the rest (embeddings, norm, head)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device_type, (torch.distributed.get_world_size(),))
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def gather_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Collective: every rank calls it; rank 0 gets the full state dict on the CPU, others {}."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def weights_to_send(model_config, state_dict: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The tensors an engine needs: with tied embeddings ``lm_head.weight`` is the embedding again."""
    tied = bool(getattr(model_config, "tie_word_embeddings", False))
    return [(name, tensor) for name, tensor in state_dict.items() if not (tied and name == "lm_head.weight")]


def save_hf_checkpoint(model_config, state_dict: dict[str, torch.Tensor], source_dir: str, out_dir: Path) -> Path:
    """A Hugging Face checkpoint (config + safetensors + tokenizer files) loadable by transformers and vLLM.

    Written to a temporary sibling and renamed, so a directory named step_N is always complete.
    """
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model_config.save_pretrained(tmp)
    tensors = {name: tensor.contiguous() for name, tensor in weights_to_send(model_config, state_dict)}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    copied = []
    for name in TOKENIZER_FILES:
        source = Path(source_dir) / name
        if source.is_file():
            shutil.copy2(source, tmp / name)
            copied.append(name)
    if "tokenizer_config.json" not in copied:
        log.warning("no tokenizer files in %s; checkpoint %s has weights and config only", source_dir, out_dir)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


class Critic(nn.Module):
    """The value model for ``adv_estimator=gae``: the policy's transformer, initialised from
    ``model.path`` as verl/AgentGym-RL's PPO critic is, with a scalar head (zero-initialised, so
    every value starts at 0). It is sharded and trained by FSDP alongside the policy; its weights
    never leave the learner (they are in the training-state checkpoints only)."""

    def __init__(self, backbone: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.model = backbone  # named like the causal LM's trunk, so decoder_layers() finds its layers
        self.value_head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids (B, T) -> (B, T) float32 values after reading tokens 0..t."""
        hidden = self.model(input_ids=input_ids, use_cache=False).last_hidden_state
        return self.value_head(hidden).squeeze(-1).float().clone()  # not a view (FSDP2 hooks the output)


def load_critic(path: str, dtype: str, device: torch.device) -> Critic:
    from transformers import AutoModel

    backbone = AutoModel.from_pretrained(path, dtype=getattr(torch, dtype), attn_implementation=attention_implementation(device))
    backbone.config.use_cache = False
    return Critic(backbone, backbone.config.hidden_size).to(getattr(torch, dtype))


def load_reference(path: str, dtype: str, device: torch.device) -> nn.Module:
    """A frozen copy of the starting policy for the KL loss: sharded like the policy, never trained."""
    model = load_model(path, dtype, device)
    model.requires_grad_(False)
    model.eval()
    return model
