"""Typed configuration of the offline paradigms (``horizonrl sft`` / ``horizonrl dpo``).

Bottom layer, like :mod:`horizonrl.core.config` (imports neither torch nor vllm): one YAML file,
dotted overrides, validated once and frozen. ``model`` is the same section as in a training
run's config, so ``model.path=...`` means the same thing in ``horizonrl train``.
The formats, the losses and how to start RL from the result: docs/offline.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from horizonrl.core.config import LoraConfig, ModelConfig, dump_config, load_typed_config

PARADIGMS = ("sft", "dpo")


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class OfflineConfig(_Frozen):
    model: ModelConfig
    data: list[str] = Field(..., min_length=1, description="AgentGym-format JSON or JSONL files (SFT: records "
                            "with `conversations`; DPO: records with `chosen` and `rejected`)")
    output_dir: str = Field("runs/offline", description="logs, metrics.jsonl, summary.json and the Hugging Face "
                            "checkpoint <output_dir>/final")
    max_length: int = Field(2048, ge=8, description="tokens per sequence; longer ones are cut (and counted)")
    system_prompt: str | None = Field(None, description="system message for records without one; use the same "
                                      "as the RL run's rollout.system_prompt")
    epochs: int = Field(1, ge=1)
    max_steps: int | None = Field(None, ge=1, description="stop after this many optimizer steps (default: all epochs)")
    batch_size: int = Field(32, ge=1, description="records (SFT) or pairs (DPO) per optimizer step, over all ranks")
    micro_batch_size: int = Field(8, ge=1, description="records (SFT) or pairs (DPO) per forward/backward on one rank")
    lr: float = Field(1e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    lr_warmup_steps: int = Field(0, ge=0, description="linear warm-up from 0 to lr over this many steps")
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    grad_clip: float = Field(1.0, gt=0)
    beta: float = Field(0.1, gt=0, description="DPO: the KL-penalty strength beta of the implicit reward")
    sft_weight: float = Field(0.0, ge=0, description="DPO: weight of an extra token-mean NLL on the chosen "
                              "sides (RPO); keeps a weak model's replies from collapsing while their margin grows")
    lora: LoraConfig | None = Field(None, description="SFT: train low-rank adapters only (as a training run's "
                                    "learner.lora); the checkpoint is the merged model, the adapter beside it")
    pack_tokens: int | None = Field(None, ge=8, description="SFT: pack each micro-batch's records end to end into "
                                    "rows of at most this many tokens (each keeps its own positions and attends only "
                                    "to itself) instead of padding each to the longest. None: padding")
    num_ranks: int = Field(1, ge=1, description="FSDP world size")
    backend: Literal["auto", "gloo", "nccl"] = "auto"  # auto: nccl with CUDA, else gloo
    param_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="master weights, gradients and AdamW state, as learner.param_dtype of a training run")
    compute_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="forward/backward, as learner.compute_dtype: bfloat16 on CUDA, float32 on the CPU")
    num_threads: int = Field(0, ge=0, description="CPU only: torch threads per rank (0: cores / num_ranks)")
    seed: int = 0
    log_every: int = Field(1, ge=1, description="a log line every N optimizer steps")
    measure_before_after: bool = Field(True, description="evaluate the loss on all the data before the first and "
                                       "after the last step (SFT: NLL; DPO: loss, reward accuracy)")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"

    @field_validator("data", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @property
    def out(self) -> Path:
        return Path(self.output_dir)

    @property
    def checkpoint_dir(self) -> Path:
        """The Hugging Face checkpoint that ``horizonrl train ... model.path=`` starts from."""
        return self.out / "final"


def load_offline_config(path: str | Path | None, overrides: list[str] | None = None) -> OfflineConfig:
    """Read YAML, apply dotted overrides, validate once. Raises ConfigError with what to fix."""
    return load_typed_config(OfflineConfig, path, overrides, what="offline config")


def dump_offline_config(config: OfflineConfig) -> str:
    return dump_config(config)
