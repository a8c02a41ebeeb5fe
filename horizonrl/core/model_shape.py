"""A decoder-only transformer's shape, and the per-token bytes that follow from it (bottom layer: no torch).

Shared by the learner's GPU sizing (learner/sizing.py, docs/gpu.md) and the memory defaults every run resolves at
launch (core/memory_plan.py). :meth:`ModelShape.from_hf_config` reads a Hugging Face ``config.json``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# What the loss keeps per loss token and vocabulary entry (learner/sizing.py's module docstring: the bf16 logits 2V,
# the loss's saved tensors 13V, the float32 copy and its gradient 8V).
LOGITS_BYTES_PER_VOCAB = 23


@dataclass(frozen=True)
class ModelShape:
    name: str
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    qkv_bias: bool = True

    @property
    def layer_params(self) -> int:
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.qkv_bias else 0)
        return attention + 3 * h * self.intermediate + 2 * h

    @property
    def root_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.root_params

    @property
    def layer_activation_bytes(self) -> int:
        """Per token, what one decoder layer keeps for backward (bf16 compute)."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return 16 * h + 4 * q + 4 * kv + 8 * self.intermediate

    def stored_activation_bytes(self, checkpointing: bool) -> int:
        """Per token, what the trunk keeps from forward to backward. With checkpointing a layer keeps
        its bf16 input only, and the rotary tables are consumed inside the checkpointed layers."""
        if checkpointing:
            return self.layers * 2 * self.hidden + 6 * self.hidden
        return self.layers * self.layer_activation_bytes + 6 * self.hidden + 4 * self.head_dim

    def activation_bytes_per_token(self, checkpointing: bool) -> int:
        """Per token at the backward's peak: the stored part, plus the layer being recomputed."""
        return self.stored_activation_bytes(checkpointing) + (self.layer_activation_bytes if checkpointing else 0)

    @property
    def logits_bytes_per_token(self) -> int:
        return LOGITS_BYTES_PER_VOCAB * self.vocab

    @property
    def largest_tensor(self) -> int:
        return max(self.vocab * self.hidden, self.hidden * self.intermediate)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """An engine's KV cache per token: a key and a value per layer, ``kv_heads × head_dim`` each."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], name: str = "") -> "ModelShape":
        """From a Hugging Face causal LM's ``config.json`` (Llama/Qwen2/Mistral-style keys; a multimodal model's
        ``text_config``)."""
        c = config.get("text_config", config)
        heads = int(c["num_attention_heads"])
        return cls(name or str(c.get("_name_or_path", c.get("model_type", ""))), int(c["vocab_size"]),
                   int(c["hidden_size"]), int(c["intermediate_size"]), int(c["num_hidden_layers"]), heads,
                   int(c.get("num_key_value_heads") or heads),
                   int(c.get("head_dim") or int(c["hidden_size"]) // heads),
                   bool(c.get("tie_word_embeddings", False)),
                   bool(c.get("attention_bias", c.get("model_type") == "qwen2")))

    @property
    def layer_linear_params(self) -> int:
        """One decoder layer's matmul weights (attention projections and MLP), no biases or norms."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return h * q + 2 * h * kv + q * h + 3 * h * self.intermediate

    def training_flops(self, length: int, loss_tokens: int, *, frozen_weights: bool = False) -> float:
        """Useful FLOPs of one forward and backward of a sequence of ``length`` tokens whose output layer runs at
        its ``loss_tokens`` loss positions only (learner/model.py ``loss_token_logits``), counting 2 per
        multiply-add (padding, recomputation and the softmax's elementwise work are not useful FLOPs):

            matmuls    forward 2·P_lin·L; backward the input gradient 2·P_lin·L, the weight gradient 2·P_lin·L
                       (none when the weights are frozen: LoRA)
            attention  causal QKᵀ and AV: forward 2 · 2 · (L²/2) · q_dim per layer, backward twice that
            output     forward 2·H·V per loss token, backward 4·H·V (2·H·V when frozen)

        Model FLOPs utilisation (MFU) = these / seconds / the matmul peak (scripts/bench_learner_mfu.py)."""
        passes = 2 if frozen_weights else 3  # forward, input gradient[, weight gradient]
        linear = 2 * self.layers * self.layer_linear_params * length * passes
        attention = 3 * self.layers * 2 * length * length * self.heads * self.head_dim
        output = 2 * self.hidden * self.vocab * loss_tokens * passes
        return float(linear + attention + output)
