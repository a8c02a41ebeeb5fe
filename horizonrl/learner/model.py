"""The policy model: Hugging Face loading, FSDP2 sharding, full-state gathering, HF checkpoints.

Loading on the learner (:func:`build_sharded_model`): every rank builds the model on the meta
device (no memory), shards it with FSDP2 (master weights in ``learner.param_dtype``, compute in
``learner.compute_dtype`` through a MixedPrecisionPolicy, see :mod:`horizonrl.core.precision`),
allocates only its own shards, and then rank 0 alone reads the checkpoint and broadcasts it tensor
by tensor; each rank keeps its shard of each. Peak memory per rank: its shards plus one full
tensor; rank 0 also holds the checkpoint on the CPU while it is sent.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import json
import logging
import shutil
from pathlib import Path

import torch
from torch import nn

from horizonrl.core.precision import PrecisionPolicy, learner_attention, precision_from_config
from horizonrl.learner.layers import decoder_layers

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


def flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def attention_implementation(device: torch.device, compute_dtype: str = "float32") -> str:
    """flash-attn 2 only where it runs (CUDA, bfloat16/float16), SDPA otherwise."""
    return learner_attention(compute_dtype, device.type == "cuda", flash_attn_installed())


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def learner_precision(config, device: torch.device) -> PrecisionPolicy:
    """The run's dtype policy as seen from a learner on ``device`` (engines are on a GPU when CUDA is here)."""
    return precision_from_config(config, learner_on_cuda=device.type == "cuda", engine_on_gpu=torch.cuda.is_available(),
                                 flash_attn_installed=flash_attn_installed())


def fsdp_mixed_precision(policy: PrecisionPolicy):
    """FSDP2's policy: all-gather and compute in the compute dtype, reduce gradients in float32; the
    sharded parameters (what AdamW steps) stay in the dtype the model was built in (param_dtype)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if not policy.mixed:
        return MixedPrecisionPolicy(reduce_dtype=torch_dtype(policy.reduce_dtype))
    return MixedPrecisionPolicy(param_dtype=torch_dtype(policy.compute_dtype),
                                reduce_dtype=torch_dtype(policy.reduce_dtype))


def load_model(path: str, dtype: str | None, device: torch.device) -> nn.Module:
    """The Hugging Face causal LM at ``path`` (local directory), whole, on the CPU, ready to shard.

    Every process that calls it reads the full weights: for one process (tests, evaluation, the
    offline trainers). The RL learner uses :func:`build_sharded_model`."""
    from transformers import AutoModelForCausalLM

    dtype = "float32" if dtype in (None, "auto") else dtype  # "auto": the deprecated model.dtype unset
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch_dtype(dtype), attn_implementation=attention_implementation(device, dtype)
    )
    model.config.use_cache = False
    return model


def loss_token_logits(model: nn.Module, input_ids: torch.Tensor, selected: torch.Tensor,
                      position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The (N, V) logits predicting the N loss tokens: ``logits[:, :-1][selected]`` for ``selected`` (B, T-1), rows in
    the same order, but the output layer runs only at the K positions where some sequence has a loss token.

    An agent's replies are a small part of each sequence (BabyAI: ~24 of ~500 tokens), and with a large vocabulary
    the output layer at every position costs time and memory no loss reads: with SmolLM2's 49,152 tokens, a
    micro-batch of 8 × 1,024 took 1.39× as long and ~1.4 GB more (scripts/bench_learner_logits.py). Hugging Face
    causal LMs take the positions as ``logits_to_keep``; going through the model's own forward keeps FSDP2's hooks
    where they are.

    ``position_ids`` (B, T): rows of packed sequences (learner/packing.py); None: one sequence per row from 0.
    """
    extra = {} if position_ids is None else {"position_ids": position_ids}
    if not takes_logits_to_keep(model):  # a model class from before transformers 4.50, or a custom one
        return model(input_ids=input_ids, use_cache=False, **extra).logits[:, :-1][selected]
    positions = selected.any(0).nonzero().squeeze(-1)  # (K,) ascending: the rows come in the same order
    logits = model(input_ids=input_ids, use_cache=False, logits_to_keep=positions, **extra).logits  # (B, K, V)
    return logits[selected[:, positions]]


def takes_logits_to_keep(model: nn.Module) -> bool:
    return _forward_takes_logits_to_keep(type(model))


@functools.cache
def _forward_takes_logits_to_keep(model_class: type) -> bool:
    """Read once per class: ``loss_token_logits`` asks on every micro-batch."""
    return "logits_to_keep" in inspect.signature(model_class.forward).parameters


def shard_model(model: nn.Module, device_type: str, mp_policy=None) -> nn.Module:
    """FSDP2: each decoder layer is one all-gather unit, then the rest (embeddings, norm, head).

    ``mp_policy``: a :class:`~torch.distributed.fsdp.MixedPrecisionPolicy` (:func:`fsdp_mixed_precision`);
    None: compute in the parameters' own dtype."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp_policy = mp_policy or MixedPrecisionPolicy()
    mesh = init_device_mesh(device_type, (torch.distributed.get_world_size(),))
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    return model


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each decoder layer in the backward pass (keep only its input): activations
    drop from ~L layers' worth to one layer's plus L inputs. Non-reentrant, so it composes with
    FSDP2's hooks; Hugging Face decoder layers checkpoint only in training mode."""
    inner = getattr(model, "model", model)
    target = inner if hasattr(inner, "gradient_checkpointing_enable") else model
    if not hasattr(target, "gradient_checkpointing_enable"):
        raise ValueError(f"{type(model).__name__} does not support activation checkpointing")
    target.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()


def checkpoint_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the Hugging Face checkpoint at ``path``, in its stored dtype, on the CPU
    (``model.safetensors`` or the shards named by ``model.safetensors.index.json``)."""
    from safetensors.torch import load_file

    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json (the learner reads "
                                "safetensors checkpoints; convert others with transformers' save_pretrained)")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(str(path / name)))
    return tensors


def full_state_dict_for(model: nn.Module, checkpoint: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under ``model``'s state-dict names: the tied ``lm_head.weight`` (absent
    from tied checkpoints) is the embedding, a critic's zero-initialised value head is added, and keys
    the model does not have (a critic has no lm_head) are left out. A missing weight is an error."""
    expected = model.state_dict().keys()  # on the meta model: names only
    out = {name: checkpoint[name] for name in expected if name in checkpoint}
    if "lm_head.weight" in expected and "lm_head.weight" not in out and "model.embed_tokens.weight" in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    for name in expected:
        if name.startswith("value_head.") and name not in out:
            shape = dict(model.named_parameters())[name].shape
            out[name] = torch.zeros(shape)  # as Critic.__init__ does: every value starts at 0
    missing = sorted(set(expected) - set(out))
    if missing:
        raise KeyError(f"the checkpoint lacks {len(missing)} weights of {type(model).__name__}, e.g. {missing[:3]}")
    return out


def _empty_model(path: str, kind: str, policy: PrecisionPolicy) -> nn.Module:
    """The model's modules with meta tensors: shapes and names, no memory, no weights read."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    config.use_cache = False
    dtype = torch_dtype(policy.param_dtype)
    with torch.device("meta"):
        if kind == "critic":
            backbone = AutoModel.from_config(config, dtype=dtype, attn_implementation=policy.attention)
            model = Critic(backbone, config.hidden_size).to(dtype)
        else:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=policy.attention)
    return model


def _restore_non_persistent_buffers(model: nn.Module, device: torch.device) -> None:
    """Buffers outside the state dict (the rotary embedding's ``inv_freq``) are computed at
    construction; after meta init they are uninitialised memory, so compute them again."""
    for module in model.modules():
        names = getattr(module, "_non_persistent_buffers_set", set())
        if not names:
            continue
        if not hasattr(module, "config"):
            raise NotImplementedError(f"cannot recompute the buffers {sorted(names)} of {type(module).__name__} "
                                      "after meta-device init")
        fresh = type(module)(module.config)  # small: only buffer-holding modules (rotary embeddings) are rebuilt
        for name in names:
            setattr(module, name, getattr(fresh, name).to(device))


def build_sharded_model(path: str, *, kind: str, policy: PrecisionPolicy, device: torch.device,
                        activation_checkpointing: bool = False, read_weights: bool | None = None,
                        lora=None, seed: int = 0, compile_layers: bool = False) -> nn.Module:
    """A collective: the model at ``path`` FSDP2-sharded over the default process group, loaded so that
    only rank 0 reads the weight files (see the module docstring).

    kind: "policy" (trained), "reference" (frozen, eval mode) or "critic" (:class:`Critic`).
    read_weights: whether this rank reads the checkpoint (default: rank 0 only; tests pass False to prove
    the other ranks need no files).
    lora: a policy's :class:`~horizonrl.learner.lora.LoraSettings`: low-rank adapters on its decoder layers, the
    only trained parameters, first valued by ``initial_adapter(model, seed)`` (learner/lora.py).
    compile_layers: ``torch.compile`` each decoder layer in place (before sharding, as torchtitan does, so that
    FSDP2's hooks stay outside the compiled graphs)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if kind not in ("policy", "reference", "critic"):
        raise ValueError(f"unknown model kind {kind!r}")
    if lora is not None and kind != "policy":
        raise ValueError(f"LoRA adapts the policy, not the {kind}")
    rank = dist.get_rank()
    read_weights = rank == 0 if read_weights is None else read_weights
    model = _empty_model(path, kind, policy)
    if lora is not None:
        from horizonrl.learner.lora import add_lora

        add_lora(model, lora)
    if activation_checkpointing and kind != "reference":
        enable_activation_checkpointing(model)
    if compile_layers:
        for layer in decoder_layers(model):
            layer.compile()
    # Rank 0 prepares the full state dict before any collective, and tells the others if it failed,
    # so that a bad checkpoint is one clear error on every rank instead of a hang in the broadcast.
    full, error = {}, None
    if read_weights:
        try:
            checkpoint = checkpoint_tensors(path)
            if lora is not None:
                from horizonrl.learner.lora import initial_adapter

                checkpoint.update(initial_adapter(model, seed))
            full = full_state_dict_for(model, checkpoint)
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
            error = f"{type(exc).__name__}: {exc}"
    errors = [error]
    dist.broadcast_object_list(errors, src=0)
    if errors[0] is not None:
        raise RuntimeError(f"loading {path} on rank 0 failed: {errors[0]}")
    shard_model(model, device.type, fsdp_mixed_precision(policy))
    model.to_empty(device=device)
    _restore_non_persistent_buffers(model, device)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    del full
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False) and hasattr(model, "lm_head"):
        if model.lm_head.weight is not model.get_input_embeddings().weight:
            raise RuntimeError("tied embeddings came apart while sharding (lm_head.weight is not embed_tokens.weight)")
    if kind == "reference":
        model.requires_grad_(False)
        model.eval()
    return model


def gather_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Collective: every rank calls it; rank 0 gets the full state dict on the CPU, others {}."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def weights_to_send(model_config, state_dict: dict[str, torch.Tensor],
                    dtype: torch.dtype | None = None) -> list[tuple[str, torch.Tensor]]:
    """The tensors an engine needs: with tied embeddings ``lm_head.weight`` is the embedding again.

    ``dtype``: the engine's (``torch_dtype(policy.engine_dtype)``); the learner's float32 master
    weights are cast to it, so the wire carries what the engine holds. None: as they are."""
    tied = bool(getattr(model_config, "tie_word_embeddings", False))
    return [(name, tensor if dtype is None else tensor.to(dtype)) for name, tensor in state_dict.items()
            if not (tied and name == "lm_head.weight")]


def save_hf_checkpoint(model_config, state_dict: dict[str, torch.Tensor], source_dir: str, out_dir: Path,
                       extra=None) -> Path:
    """A Hugging Face checkpoint (config + safetensors + tokenizer files) loadable by transformers and vLLM.

    Written to a temporary sibling and renamed, so a directory named step_N is always complete; ``extra(tmp)``
    writes more into it before the rename (a LoRA run's adapter, learner/services.py ``save_policy``).
    """
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    for partial in [tmp, *out_dir.parent.glob("step_*.tmp")]:  # left by a save that failed or a learner killed in one
        shutil.rmtree(partial, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        model_config.save_pretrained(tmp)
        tensors = {name: tensor.contiguous() for name, tensor in weights_to_send(model_config, state_dict)}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        copied = []
        for name in TOKENIZER_FILES:
            source = Path(source_dir) / name
            if source.is_file():
                shutil.copy2(source, tmp / name)
                copied.append(name)
        if extra is not None:
            extra(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a full disk: no half-written checkpoint left to keep it full
        raise
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


def load_critic(path: str, dtype: str | None, device: torch.device) -> Critic:
    from transformers import AutoModel

    dtype = "float32" if dtype in (None, "auto") else dtype  # "auto": the deprecated model.dtype unset
    backbone = AutoModel.from_pretrained(path, dtype=torch_dtype(dtype),
                                         attn_implementation=attention_implementation(device, dtype))
    backbone.config.use_cache = False
    return Critic(backbone, backbone.config.hidden_size).to(torch_dtype(dtype))


def load_reference(path: str, dtype: str | None, device: torch.device) -> nn.Module:
    """A frozen copy of the starting policy for the KL loss: sharded like the policy, never trained."""
    model = load_model(path, dtype, device)
    model.requires_grad_(False)
    model.eval()
    return model
