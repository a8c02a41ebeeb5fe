"""Typed run configuration: one YAML file per run, overridable with dotted keys.

Bottom layer (imports neither torch nor vllm). Parsed and validated once by
:func:`load_config`, frozen afterwards; derived values are properties. Where
AgentGym-RL has a name for a setting (``algorithm.adv_estimator``,
``algorithm.rounds_ctrl.type|rounds|steps_scaling_inter``, ``rollout.n``), the same
name is accepted so its users can bring their scripts.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from horizonrl.core.agent_config import AgentConfig
from horizonrl.core.run_dirs import RunDir
from horizonrl.protocol.names import LABEL_PATTERN
from horizonrl.protocol.transport import advertise_host, tcp_endpoint


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class RunConfig(_Frozen):
    name: str = "run"
    output_dir: str = "runs/run"  # TensorBoard events, checkpoints, logs and the resolved config
    run_id: str = Field("", description="set by the launcher: a new id for a new output_dir, the same id when it "
                                        "resumes; every message carries it and processes reject other runs' messages")
    seed: int = 0
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"


class TinyModelRecipe(_Frozen):
    """How ``horizonrl demo`` builds the tiny model at ``model.path`` when it is missing (horizonrl/apps/tiny_model.py):
    a format-only warm-up on random-policy episodes of the run's environments."""

    episodes_per_env: int = Field(1500, ge=1, description="random-policy episodes per environment")
    warmup_steps: int = Field(200, ge=1, description="language-model optimizer steps on those episodes")
    max_turns: int = Field(6, ge=1, description="turn cap of a random-policy episode")
    layers: int = Field(2, ge=1, description="decoder layers of the tiny Qwen2")
    hidden: int = Field(128, ge=64, multiple_of=64, description="its hidden size (heads of 64; MLP twice as wide)")
    device: str = Field("cpu", description="where the warm-up runs (cuda: long warm-ups in minutes); not part of "
                        "the recipe: a model built on a GPU is reused on the CPU")


# The linear layers of a Llama/Qwen2-style decoder layer (attention and MLP): what learner.lora adapts by default.
LORA_DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraConfig(_Frozen):
    """Low-rank adapters (Hu et al. 2021): the learner trains only A (r x in) and B (out x r) of each target layer,
    ΔW = (alpha / r) · B A, and the engines load each new adapter version in place (docs/learning.md, LoRA)."""

    rank: int = Field(..., ge=1, le=512, description="r: the adapter's rank (vLLM serves ranks up to 512)")
    alpha: float = Field(32.0, gt=0, description="lora_alpha: the update is scaled by alpha / r. A fixed alpha (not "
                         "one proportional to r) keeps the best learning rate about the same across ranks")
    target_modules: list[str] = Field(list(LORA_DEFAULT_TARGETS), min_length=1,
                                      description="names of the decoder layers' linear layers to adapt (every layer's "
                                                  "module of that name)")


class FormatWarmup(_Frozen):
    """A short SFT of a pretrained model on random-policy episodes of the run's environments
    (horizonrl/apps/warmup_data.py): the reply format, not the skill (every reply in the data is a random valid
    action)."""

    episodes_per_env: int = Field(500, ge=1, description="random-policy episodes per environment")
    steps: int = Field(40, ge=1, description="SFT optimizer steps on them")
    batch_size: int = Field(16, ge=1, description="episodes per step")
    lr: float = Field(2e-5, gt=0)
    lora: LoraConfig | None = Field(None, description="train low-rank adapters only, then merge them (a LoRA lr is "
                                      "typically ~10x a full fine-tune's); None: every weight")
    pack_tokens: int | None = Field(None, ge=8, description="pack each micro-batch's episodes into rows of at most "
                                    "this many tokens instead of padding them (learner/packing.py); None: padding")


class PretrainedRecipe(_Frozen):
    """How ``horizonrl demo`` makes ``model.path`` from a packaged pretrained model when it is missing: the model
    imported (``horizonrl make-model NAME``), then, if asked, format-warmed (the import stays beside it, as
    ``<path>.base``)."""

    packaged: Literal["smollm2"] = Field(..., description="the packaged model (horizonrl/apps/model_import.py)")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="the imported checkpoint's dtype")
    format_warmup: FormatWarmup | None = Field(None, description="None: the instruct model as it is (the paper's "
                                                                 "prompted start)")


class ModelConfig(_Frozen):
    path: str = Field(..., description="Hugging Face model directory on local disk")
    tiny: TinyModelRecipe = Field(TinyModelRecipe(), description="horizonrl demo only: the recipe of the tiny "
                                  "model it builds at path when missing (rebuilt when the recipe changes)")
    pretrained: PretrainedRecipe | None = Field(None, description="horizonrl demo only: build path from a packaged "
                                                "pretrained model instead of the tiny one")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = Field(
        None, description="deprecated (one dtype for learner and engine): when set (not None/auto), it is the "
                          "engine's dtype where rollout.engine.dtype is auto; the learner uses learner.param_dtype / "
                          "learner.compute_dtype (docs/gpu.md, Precision)")
    vocab_size: int | None = Field(None, ge=1, description="set by the launcher from the model's config.json: the "
                                                           "buffer rejects token ids outside it")


class EnvSpec(_Frozen):
    # The buffer refuses a trajectory whose environment is not a label (protocol/names.py): a name that is not one
    # would refuse every trajectory of the run, so it is refused here, before the run starts.
    name: str = Field(pattern=LABEL_PATTERN)
    settings: dict[str, Any] = {}
    weight: float = Field(1.0, gt=0, description="share of groups drawn from this environment")


class EngineConfig(_Frozen):
    kv_cache_gib: Annotated[float, Field(gt=0)] | Literal["auto"] = Field(
        "auto", description="the KV cache on the CPU, in GiB (vLLM's kv_cache_memory_bytes). auto: the launcher sizes "
                            "it for the run's concurrent sequences and context from the model's shape "
                            "(core/memory_plan.py); an engine started outside a run takes 1")
    num_kv_blocks: int | None = Field(
        None, ge=1, description="the engine's KV-cache blocks (vLLM's num_gpu_blocks_override), instead of what its "
                                "memory gives: the benchmarks make a small cache to see preemptions (docs/horizon.md)")
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    enforce_eager: bool = True
    max_num_seqs: int = Field(128, ge=1)
    enable_prefix_caching: bool = True
    block_size: int | None = Field(
        None, ge=1, description="tokens per KV-cache block (vLLM's block_size; default: vLLM's, 128 on the CPU, 16 on "
                                "GPUs). The prefix cache keeps whole blocks only, so with on_weight_update=resubmit "
                                "a request cut off by an update re-computes its last partial block: smaller blocks, "
                                "less to re-compute")
    on_weight_update: Literal["keep", "resubmit", "recompute"] = Field(
        "keep", description="what a weight swap does with the requests in flight (each reply's tokens are tagged with "
                            "the version that sampled them either way, and the learner's ratio uses the logprobs "
                            "sampled). keep: they stay in the engine, paused between two steps while the weights "
                            "change, and go on from the keys and values the old weights computed (as PipelineRL "
                            "does); the cheapest. resubmit: they are cut off and each goes on as a new request under "
                            "the new weights, the prefix cache reused: the last partial KV block is computed again. "
                            "recompute: cut off too, and every key and value the old weights computed is dropped, so "
                            "every token after the swap comes from the new weights alone (a prefill of each request's "
                            "context)")
    tensor_parallel_size: int = Field(1, ge=1, description="devices each engine shards the model over (vLLM's "
                                      "tensor_parallel_size); resources.actor_gpus gives each engine this many GPUs")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="the engine's weights and compute; the learner sends its weights in this dtype. auto: "
                            "model.dtype if set (deprecated), else bfloat16 on a GPU and float32 on the CPU")


    @model_validator(mode="before")
    @classmethod
    def _recompute_kv_on_update_is_on_weight_update(cls, data: Any) -> Any:
        """The setting before on_weight_update existed: true was recompute, false resubmit."""
        if isinstance(data, dict) and "recompute_kv_on_update" in data:
            data = dict(data)
            old = data.pop("recompute_kv_on_update")
            if not isinstance(old, bool):
                raise ValueError(f"rollout.engine.recompute_kv_on_update must be true or false, not {old!r}")
            meant = "recompute" if old else "resubmit"
            if data.setdefault("on_weight_update", meant) != meant:
                raise ValueError(f"rollout.engine.recompute_kv_on_update={str(old).lower()} (deprecated: it means "
                                 f"on_weight_update={meant}) contradicts on_weight_update={data['on_weight_update']}")
            warnings.warn(f"rollout.engine.recompute_kv_on_update is deprecated: use on_weight_update={meant}",
                          FutureWarning, stacklevel=2)  # FutureWarning: shown to users by default
        return data

    @property
    def kv_cache_gib_or_default(self) -> float:
        """kv_cache_gib, "auto" not resolved by a launcher (an engine started alone: ``horizonrl eval``) read as 1."""
        return 1.0 if self.kv_cache_gib == "auto" else float(self.kv_cache_gib)


class ConcurrencyConfig(_Frozen):
    """How many groups each actor keeps in flight (actors/concurrency.py, docs/horizon.md)."""

    mode: Literal["fixed", "adaptive"] = Field(
        "fixed", description="fixed: rollout.groups_in_flight; adaptive: start there and keep the engine's KV-cache "
                             "use between kv_cache_low and kv_cache_high, within min_groups..max_groups (fewer "
                             "groups when the engine preempts), as a rising turn budget lengthens the contexts")
    kv_cache_low: float = Field(0.6, ge=0, lt=1, description="adaptive: below this share of KV blocks in use, add a "
                                "group (when every slot is busy)")
    kv_cache_high: float = Field(0.9, gt=0, le=1, description="adaptive: above this, or on a preemption, remove a "
                                 "quarter of the groups")
    min_groups: int = Field(1, ge=1)
    max_groups: int = Field(16, ge=1)
    hold_s: float = Field(5.0, ge=0, description="adaptive: seconds after a change before the next one (the cache "
                          "fills turns after a group starts)")
    interval_s: float = Field(0.5, gt=0, description="adaptive: seconds between two decisions")

    @model_validator(mode="after")
    def _ordered(self) -> "ConcurrencyConfig":
        if self.kv_cache_low >= self.kv_cache_high:
            raise ValueError(f"rollout.concurrency.kv_cache_low ({self.kv_cache_low}) must be below kv_cache_high "
                             f"({self.kv_cache_high})")
        if self.min_groups > self.max_groups:
            raise ValueError(f"rollout.concurrency.min_groups ({self.min_groups}) must be at most max_groups "
                             f"({self.max_groups})")
        return self


class ContextConfig(_Frozen):
    """``rollout.context``: what an episode does when its next turn would not fit in ``rollout.max_context_tokens``
    (actors/context.py; docs/horizon.md)."""

    policy: Literal["cut", "window", "summarize"] = Field(
        "cut", description="cut: the episode ends there (stop reason context_limit); window: it goes on in a new "
                           "segment whose prompt keeps the system prompt, the task and the newest turns that fit "
                           "(the oldest turns dropped, a note says how many); summarize: the model first writes a "
                           "summary of the episode (a turn of its own, trained as an action), and the new segment's "
                           "prompt is the task, the summary and the latest observation. Each segment is trained as "
                           "a sample of its own with the episode's return")
    window_fill: float = Field(0.5, gt=0, lt=1, description="window: a new segment's prompt holds at most this share "
                               "of the context, so that several turns fit after it before the next window")
    max_segments: int = Field(4, ge=2, le=64, description="window, summarize: an episode ends (context_limit) rather "
                              "than start a segment past this many; bounds an episode's tokens, and so a learner "
                              "step's, at max_segments x max_context_tokens")
    summary_tokens: int = Field(128, ge=8, description="summarize: the longest summary, in tokens (the context keeps "
                                "room for it and the request)")

    @property
    def max_summaries(self) -> int:
        """Summary turns an episode may hold beside the environment's (one per segment after the first)."""
        return self.max_segments - 1 if self.policy == "summarize" else 0


class RolloutConfig(_Frozen):
    num_actors: int = Field(2, ge=1)
    n: int = Field(8, ge=1, description="episodes per task: the GRPO group size (AgentGym-RL: rollout.n)")
    groups_in_flight: int = Field(4, ge=1, description="groups each actor runs concurrently")
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens_per_turn: int = Field(64, ge=1)
    max_context_tokens: int = Field(2048, ge=16)
    system_prompt: str | None = None
    synchronous: bool = Field(False, description="the synchronous baseline (benchmarks, debugging): each actor "
                              "generates its share of one learner batch under the current weights, then waits "
                              "for the next weight version; nothing overlaps with training")
    turn_timeout_s: float = Field(300.0, gt=0, description="a generation taking longer is abandoned: the episode "
                                  "ends as a timeout failure (counted, never trained on)")
    episode_timeout_s: float = Field(1800.0, gt=0, description="an episode (environment steps included) taking "
                                     "longer is abandoned as a timeout failure, so no group waits forever")
    ack_timeout_s: float = Field(30.0, gt=0, description="resend a trajectory the buffer has not acknowledged for this "
                                 "long (the buffer de-duplicates)")
    max_unacked: int = Field(256, ge=1, description="trajectories an actor keeps unacknowledged before it stops "
                             "starting groups")
    weight_staging: bool = Field(True, description="receive each weight version into a staging buffer while the "
                                 "engine keeps generating, then swap it in between two engine steps (requests in "
                                 "flight go on under the new weights); costs one copy of the model in the engine's "
                                 "dtype on the engine's device. false: receive bucket by bucket straight into the "
                                 "model with the engine paused (extra memory about one bucket)")
    weight_sync_every: int = Field(1, ge=1, description="the learner sends its weights to the engines every N "
                                   "learner steps (and after its last); buffer.max_staleness must be at least N - 1")
    engine: EngineConfig = EngineConfig()
    concurrency: ConcurrencyConfig = ConcurrencyConfig()
    context: ContextConfig = ContextConfig()
    agent: AgentConfig | None = Field(None, description="play the episodes with an agent program through an "
                                      "OpenAI-compatible endpoint in front of each actor's engine (docs/agents.md)")

    @model_validator(mode="before")
    @classmethod
    def _only_sampling_the_learner_reproduces(cls, data: Any) -> Any:
        """Sampling settings of vLLM's other than temperature and top_p, which users of verl / AgentGym-RL bring:
        accepted at the value that turns them off (and dropped), refused otherwise. The importance ratio divides the
        learner's probability of each token by the engine's, of the distribution it sampled from (vLLM's
        processed_logprobs: after temperature, top-k, top-p, min-p and penalties); the learner reproduces temperature
        and top_p (learner/policy_loss.py nucleus_logits), so any other setting would bias every ratio silently."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for key, off in UNREPRODUCED_SAMPLING.items():
            if key in data:
                value = data.pop(key)
                if value not in off:
                    raise ValueError(
                        f"rollout.{key}={value!r} is not supported: the engine's logprobs of a token are those of the "
                        f"distribution it sampled from, and the learner reproduces temperature and top_p only (the "
                        f"importance ratio would be biased on every token); remove it, or set it to "
                        f"{' or '.join(repr(v) for v in off)} (off)")
        return data


# vLLM's sampling settings the learner does not reproduce, with the values that turn each off.
UNREPRODUCED_SAMPLING: dict[str, tuple] = {
    "top_k": (-1, 0, None),
    "min_p": (0, 0.0, None),
    "repetition_penalty": (1, 1.0, None),
    "presence_penalty": (0, 0.0, None),
    "frequency_penalty": (0, 0.0, None),
}


class RoundsCtrlConfig(_Frozen):
    """The max-turn budget schedule (AgentGym-RL's ``algorithm.rounds_ctrl``)."""

    type: Literal["fixed", "scaling_inter_stepwise"] = "fixed"
    rounds: list[int] = [20]
    steps_scaling_inter: int = Field(100, ge=1)

    @field_validator("rounds")
    @classmethod
    def _positive_rounds(cls, rounds: list[int]) -> list[int]:
        if not rounds or any(r < 1 for r in rounds):
            raise ValueError("rounds must be a non-empty list of positive turn counts, e.g. [10, 20, 30]")
        return rounds


# The rejection bounds [L, U] when a level's are not given, from the peers' published settings
# (docs/algorithms.md, "Rollout correction"): IcePop's [0.5, 5] per token; TRL's sequence mask at 3 above;
# a geometric mean within 1 % of 1, as SkyRL's and verl's geometric masks are set.
REJECT_BOUNDS = {"token": (0.5, 5.0), "sequence": (0.0, 3.0), "geometric": (0.99, 1.01)}


class RolloutCorrectionConfig(_Frozen):
    """``algorithm.rollout_correction``: what the loss does about tokens the engine sampled under other weights
    or other numerics (learner/rollout_correction.py; docs/algorithms.md, "Rollout correction"). Each acts on
    rho = pi_old / mu per token; all compose; every advantage estimator, with or without learner.decoupled_loss."""

    is_level: Literal["none", "token", "sequence"] = Field(
        "token", description="truncated importance weights: min(rho_t, is_cap) per token, or min(prod rho, is_cap) "
                             "per sequence; none: the untruncated rho")
    is_cap: float = Field(2.0, gt=0, description="C of the truncated importance weights (verl's and TIS's 2.0)")
    reject_level: Literal["none", "token", "sequence", "geometric"] = Field(
        "none", description="drop tokens whose rho_t (token: IcePop's two-sided mask), whole sequences whose "
                            "prod rho (sequence) or exp(mean log rho) (geometric) falls outside [reject_low, "
                            "reject_high]")
    reject_low: float | None = Field(None, ge=0, description="L (default by level: token 0.5, sequence 0, "
                                     "geometric 0.99)")
    reject_high: float | None = Field(None, gt=0, description="U (default by level: token 5, sequence 3, "
                                      "geometric 1.01)")
    turn_reject: Literal["none", "drop", "downweight"] = Field(
        "none", description="per turn: a turn whose mean k3 KL(mu || pi_old) per token exceeds turn_kl_bound is "
                            "dropped, or its tokens weighted by turn_kl_bound / KL; the episode's other turns train")
    turn_kl_bound: float = Field(0.01, gt=0, description="B of turn_reject, per token (10x the largest healthy "
                                 "trainer-engine k3 KL published for dense models, 1e-3)")

    @property
    def reject_bounds(self) -> tuple[float, float]:
        """[L, U] of the rejection (its level's defaults where not given); (0, inf) with no rejection."""
        low, high = REJECT_BOUNDS.get(self.reject_level, (0.0, float("inf")))
        return (low if self.reject_low is None else self.reject_low,
                high if self.reject_high is None else self.reject_high)

    @model_validator(mode="after")
    def _ordered(self) -> "RolloutCorrectionConfig":
        low, high = self.reject_bounds
        if low >= high:
            raise ValueError(f"algorithm.rollout_correction: reject_low ({low}) must be below reject_high ({high})")
        return self


class AlgorithmConfig(_Frozen):
    adv_estimator: Literal["grpo", "rloo", "reinforce_plus_plus", "gae", "gigpo"] = Field(
        "grpo", description="grpo: group-normalised outcome; rloo: leave-one-out baseline; reinforce_plus_plus: "
        "discounted return whitened over the batch; gae: GAE with a critic; gigpo: GRPO plus turn-level groups "
        "of identical environment states (docs/algorithms.md)")
    norm_adv_by_std_in_grpo: bool = Field(True, description="grpo: divide by the group's std (False: Dr. GRPO)")
    gamma: float = Field(1.0, ge=0, le=1, description="discount per generated token (reinforce_plus_plus, gae)")
    lam: float = Field(1.0, ge=0, le=1, description="GAE lambda (gae)")
    whiten_gae_advantages: bool = Field(True, description="gae: whiten advantages over the batch, as verl does")
    critic_lr: float | None = Field(None, gt=0, description="gae: the critic's learning rate (default: learner.lr)")
    vf_coef: float = Field(0.5, gt=0, description="gae: weight of the critic's squared error ½(V − R)²")
    gigpo_gamma: float = Field(0.95, ge=0, le=1, description="gigpo: discount per turn of the step-level return")
    gigpo_step_weight: float = Field(1.0, ge=0, description="gigpo: weight ω of the step-level advantage "
                                     "(A = A_episode + ω A_step; 0 gives GRPO)")
    rounds_ctrl: RoundsCtrlConfig = RoundsCtrlConfig()
    rollout_correction: RolloutCorrectionConfig = RolloutCorrectionConfig()


class LearnerConfig(_Frozen):
    num_ranks: int = Field(1, ge=1, description="FSDP world size")
    backend: Literal["auto", "gloo", "nccl"] = "auto"  # auto: nccl with CUDA, else gloo
    total_steps: int = Field(100, ge=1)
    groups_per_step: int = Field(8, ge=1)
    lr: float = Field(1e-6, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    clip_ratio: float = Field(0.2, gt=0)
    clip_ratio_low: float | None = Field(None, gt=0, description="PPO clip below 1 (default: clip_ratio)")
    clip_ratio_high: float | None = Field(None, gt=0, description="PPO clip above 1 (default: clip_ratio; "
                                          "DAPO's clip-higher uses e.g. 0.28)")
    clip_ratio_c: float | None = Field(None, gt=1, description="dual-clip bound for negative advantages (verl: 3.0)")
    decoupled_loss: bool = Field(False, description="AReaL's decoupled PPO: clip against the proximal policy "
                                 "(the learner's own, recomputed), weight by pi_prox / mu as "
                                 "algorithm.rollout_correction says; false: the engine's logprobs serve as the old "
                                 "policy (bypass)")
    use_kl_loss: bool = Field(False, description="add kl_loss_coef * KL(pi || pi_ref) to a frozen copy of model.path")
    kl_loss_coef: float = Field(0.001, ge=0)
    kl_loss_type: Literal["low_var_kl", "k1", "k2", "k3"] = "low_var_kl"
    entropy_coeff: float = Field(0.0, ge=0, description="entropy bonus: the loss subtracts entropy_coeff * H")
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    lr_warmup_steps: int = Field(0, ge=0, description="linear warm-up from 0 to lr over this many steps")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="after the warm-up: constant, or decay to min_lr_ratio * lr at total_steps")
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    grad_clip: float = Field(1.0, gt=0)
    micro_batch_size: int = Field(16, ge=1, description="trajectories per forward/backward on one rank")
    max_tokens_per_micro_batch: Annotated[int, Field(ge=1)] | None | Literal["auto"] = Field(
        "auto", description="also cap each micro-batch at this many padded tokens (rows x longest row); a "
                            "trajectory longer than that is a micro-batch of its own. None: trajectories only. auto: "
                            "the launcher takes the most that fits the learner's share of the host's memory on the "
                            "CPU (core/memory_plan.py), None on GPUs")
    pack_tokens: int | None = Field(
        None, ge=8, description="pack each micro-batch's trajectories end to end into one row of at most this many "
                                "tokens (each keeps its own positions and attends only to itself: learner/packing.py) "
                                "instead of padding micro_batch_size rows to the longest. None: padding. Outcome "
                                "estimators only (grpo, rloo, gigpo): gae and reinforce_plus_plus scan along a row")
    param_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="master weights, gradients and AdamW state (bfloat16 rounds lr-1e-6 updates away)")
    compute_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="forward/backward (FSDP2 MixedPrecisionPolicy; gradients reduce in float32). auto: "
                            "bfloat16 when the learner runs on CUDA, float32 on the CPU")
    activation_checkpointing: bool | Literal["auto"] = Field(
        "auto", description="recompute each decoder layer's activations in the backward pass instead of keeping them "
                            "(memory for ~1/3 more compute). auto: the launcher turns it on on the CPU only when "
                            "a micro-batch of 8 full contexts would not fit without it (core/memory_plan.py); off on "
                            "GPUs")
    compile: bool = Field(False, description="torch.compile each decoder layer of the policy (inductor; on the CPU "
                          "it needs a C++ compiler): fuses the elementwise work between the matmuls. Off by default: "
                          "the first steps pay the compilation (scripts/bench_learner_mfu.py measures both)")
    ppo_epochs: int = Field(1, ge=1, description="passes over each batch (verl's ppo_epochs)")
    ppo_mini_batch_size: int | None = Field(
        None, ge=1, description="groups per optimizer update (verl's ppo_mini_batch_size, in prompts); None: the "
                                "whole batch. Several updates per step: with decoupled_loss they are clipped to the "
                                "policy before the first one")
    save_every: int = Field(0, ge=0, description="save a checkpoint (Hugging Face weights + the full training "
                            "state) every N steps (0: only at the end)")
    resume: str | None = Field(None, description="a checkpoint directory (<output_dir>/checkpoints/step_N) to "
                               "continue from, or 'auto' for the newest complete one (`horizonrl train ... resume=`)")
    batch_timeout_s: float = Field(600.0, gt=0, description="fail if no batch arrives for this long")
    batch_resend_s: float = Field(60.0, gt=0, description="ask the buffer again after this long without an answer "
                                  "(a restarted buffer lost the request; asking again is safe)")
    weight_sync_timeout_s: float = Field(300.0, gt=0)
    step_timeout_s: float = Field(3600.0, gt=0, description="a learner step (advantages and updates) running longer "
                                  "fails the learner, which the launcher restarts from its newest checkpoint; at a "
                                  "stop signal a step is abandoned after monitor.stop_timeout_s / 2")
    lora: LoraConfig | None = Field(None, description="train low-rank adapters instead of every weight "
                                    "(learner.lora.rank=16); the engines then take each adapter "
                                    "version, megabytes, in place of the model. None: full training")
    weight_bucket_mb: float = Field(256.0, gt=0, description="weights travel to the engines in buckets of at most "
                                    "this many MB, each gathered and sent as it fills (a bigger tensor goes alone); "
                                    "a model smaller than one bucket is one collective per update")

    @model_validator(mode="before")
    @classmethod
    def _moved_behav_imp_weight_cap(cls, data: Any) -> Any:
        if isinstance(data, dict) and "behav_imp_weight_cap" in data:
            raise ValueError("learner.behav_imp_weight_cap is now algorithm.rollout_correction: is_level=token with "
                             f"is_cap={data['behav_imp_weight_cap']} (docs/algorithms.md, \"Rollout correction\")")
        return data

    @property
    def checkpointing(self) -> bool:
        """activation_checkpointing, "auto" not resolved by a launcher (a learner started by hand) read as off."""
        return self.activation_checkpointing is True

    @property
    def micro_batch_token_cap(self) -> int | None:
        """max_tokens_per_micro_batch, "auto" not resolved by a launcher read as no cap."""
        return None if self.max_tokens_per_micro_batch == "auto" else self.max_tokens_per_micro_batch

    @property
    def clip_low(self) -> float:
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def clip_high(self) -> float:
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high


class BufferConfig(_Frozen):
    max_staleness: int = Field(4, ge=0, description="drop groups with learner version - behaviour version above this")
    capacity_groups: int = Field(16, ge=1, description="complete groups held before backpressure (about 2 learner "
                                 "steps' worth keeps staleness low)")
    skip_equal_reward_groups: bool = Field(True, description="drop groups whose rewards are all equal (no signal)")
    equal_reward_fallback_groups: int = Field(
        32, ge=1, description="once this many equal-reward groups completed while a batch request waits, "
                              "top it up with them, so a saturated policy does not starve the learner")
    equal_reward_fallback_s: float = Field(
        300.0, ge=0, description="top a waiting batch request up with equal-reward groups after this long")
    group_timeout_s: float = Field(600.0, gt=0, description="drop a group still incomplete after this long")
    wal: bool = Field(True, description="keep the write-ahead log (<output_dir>/buffer_wal): acknowledged trajectories "
                      "survive a crash of any process; off only to measure its cost")
    wal_fsync: Literal["always", "batch", "never"] = Field(
        "batch", description="always: fsync every record; batch: one fsync per batch of records, before their "
                             "acknowledgements (group commit); never: leave it to the OS (survives a process crash, "
                             "not a machine crash)")
    wal_segment_mb: float = Field(64.0, gt=0, description="start a new log segment past this size")
    wal_compact_mb: float = Field(512.0, gt=0, description="compact (drop the payloads of trained and dropped "
                                  "trajectories) when the log grows past this")
    future_hold_s: float = Field(60.0, gt=0, description="a trajectory whose weight version the buffer has not heard "
                                 "of yet waits this long for it, then is rejected as from the future")
    on_budget_change: Literal["keep", "drop_previous_budget"] = Field(
        "keep", description="when the turn budget rises (algorithm.rounds_ctrl), keep groups played under the previous "
                            "budget, or drop them (counted as previous_budget): docs/horizon.md")
    staleness_rule: Literal["oldest_token", "completion"] = Field(
        "oldest_token", description="oldest_token: a group is as old as its oldest token (max_staleness bounds it); "
                                    "completion: max_staleness bounds the group's newest token (how long it waited "
                                    "once complete) and max_start_staleness its oldest (docs/horizon.md)")
    max_start_staleness: int | None = Field(
        None, ge=0, description="with staleness_rule=completion: the bound on a group's oldest token (None: 3 x "
                                "max_staleness); the loss's off-policy correction carries the older turns")


class NetworkConfig(_Frozen):
    """Where the processes of a run find each other.

    The coordinator's address (``host``, ``control_port``, ``report_port``) is the one every process is
    given. Every other server socket binds on its own host at its port here, or, where that port is 0
    once the run has started, at a free port it registers with the coordinator (protocol/registry.py);
    its clients follow the registration, also when it restarts elsewhere. ``launcher.type=local``
    resolves every port before it starts anything (one machine, loopback); the cluster launchers
    resolve only the coordinator's."""

    host: str = "127.0.0.1"  # the coordinator's address (and, on one machine, everyone's); loopback unless configured
    control_port: int = Field(0, ge=0, le=65535)  # 0: the launcher picks a free one (transport.free_ports)
    report_port: int = Field(0, ge=0, le=65535)
    trajectory_port: int = Field(0, ge=0, le=65535)
    batch_port: int = Field(0, ge=0, le=65535)
    weight_port: int = Field(0, ge=0, le=65535)
    dist_port: int = Field(0, ge=0, le=65535)  # the learner's own FSDP process group
    bind_host: str | None = Field(None, description="the address every process other than the coordinator binds "
                                  "its server sockets on (e.g. 0.0.0.0); None: the address it advertises (its "
                                  "launcher's HORIZONRL_ADVERTISE_HOST, else its address on the route to host)")
    curve_keys_dir: str | None = Field(None, description="CurveZMQ keys (`horizonrl keys DIR` makes them); required "
                                       "when host is not a loopback address")

    def endpoint(self, port: int) -> str:
        return tcp_endpoint(self.host, port)

    def advertised_host(self) -> str:
        """The address this process gives the others for what it binds (loopback on one machine)."""
        return advertise_host(self.host)

    def bind_address(self) -> str:
        return self.bind_host or self.advertised_host()

    @property
    def resolved(self) -> bool:
        """The coordinator's ports are known: every process can start (the rest registers)."""
        return bool(self.control_port and self.report_port)


class WandbConfig(_Frozen):
    """Weights & Biases logging (coordinator/wandb_log.py); absent: none."""

    project: str = "horizonrl"
    entity: str | None = None
    mode: Literal["online", "offline"] = Field("online", description="offline: written under <output_dir>/wandb, "
                                                                    "uploaded later with `wandb sync`")
    tags: list[str] = []


class MonitorConfig(_Frozen):
    tensorboard: bool = False  # also start TensorBoard on loopback and print its address
    tensorboard_port: int = Field(6006, ge=1, le=65535)
    heartbeat_timeout_s: float = Field(60.0, gt=0)
    stop_timeout_s: float = Field(600.0, gt=0, description="at Ctrl-C/SIGTERM, how long the learner may take to finish "
                                  "its step and write the checkpoint before it is killed (a second Ctrl-C forces)")
    episode_sample_every_s: float = Field(
        30.0, ge=0, description="each actor sends one finished episode per environment as text this often; the "
                                "coordinator writes it to TensorBoard (episodes/<env>) and <output_dir>/episodes.jsonl "
                                "(0: never)")
    record_fraction: float = Field(
        0.1, ge=0, le=1, description="share of GRPO groups whose episodes the buffer records as text in "
                                     "<output_dir>/episodes/ (docs/episodes.md; `horizonrl view RUN_DIR` shows them)")
    record_failures: bool = Field(True, description="also record every failed episode (environment, engine, timeout)")
    record_max_mb: float = Field(1024.0, ge=0, description="stop recording once <output_dir>/episodes/ holds this much")
    wandb: WandbConfig | None = Field(None, description="also log to Weights & Biases, e.g. "
                                                        "monitor.wandb={project: my-project, mode: offline}")


class SupervisionConfig(_Frozen):
    """What the launcher does when a process of the run dies (docs/faults.md)."""

    restart: bool = Field(True, description="restart a dead actor, buffer, coordinator or managed environment "
                          "server (off: any death stops the run)")
    max_restarts: int = Field(5, ge=0, description="restarts of one process within window_s; one more death stops "
                              "the run")
    window_s: float = Field(600.0, gt=0)
    backoff_s: float = Field(1.0, ge=0, description="wait before the first restart; doubles with each restart in the "
                             "window")
    max_backoff_s: float = Field(30.0, ge=0)
    recover: Literal["auto", "off"] = Field(
        "auto", description="auto: when a learner rank dies, stop the other ranks and restart the learner from its "
                            "newest checkpoint (AReaL's recover.mode=auto); off: the run stops")
    max_learner_restarts: int = Field(3, ge=0, description="learner restarts within window_s")

    @field_validator("recover", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        # YAML reads a bare `off` (and `on`) as a boolean
        return {False: "off", True: "auto"}.get(value, value) if isinstance(value, bool) else value


class ResourcesConfig(_Frozen):
    """Which devices each process of the run uses (core/placement.py, docs/gpu.md). GPUs are named by their
    position among the GPUs the launcher sees (0 = the first in CUDA_VISIBLE_DEVICES, or the first GPU when it
    is unset), so one config fits any allocation of the same size."""

    device: Literal["auto", "cuda", "cpu"] = Field(
        "auto", description="auto: GPUs when any are visible, else the CPU; cuda: refuse to start without GPUs; cpu: "
                            "the CPU even where GPUs are visible (they are hidden from every process)")
    learner_gpus: list[int] | None = Field(
        None, description="the GPU of each learner rank, one per rank (learner.num_ranks); default: the first ones")
    actor_gpus: list[list[int]] | None = Field(
        None, description="the GPUs of each actor's engine, one list per actor (rollout.num_actors) of "
                          "rollout.engine.tensor_parallel_size GPUs, e.g. [[2, 3], [4, 5]]; default: the GPUs after "
                          "the learner's, in order")
    learner_cpus: list[int] | None = Field(
        None, description="CPU cores (ids as `taskset` names them) of the learner ranks and of the coordinator and "
                          "buffer; default: any. With actor_cpus, partitions a host so that learner and engines do "
                          "not compete for cores, as on separate GPUs (docs/benchmarks.md)")
    actor_cpus: list[list[int]] | None = Field(
        None, description="CPU cores of each actor — its process, and its vLLM engine's processes and their OpenMP "
                          "threads unless engine_cpus places them — one list per actor (rollout.num_actors), e.g. "
                          "[[1], [2, 3]]; default: any")
    engine_cpus: list[list[int]] | None = Field(
        None, description="CPU cores of each actor's vLLM engine alone — its engine-core and worker processes and "
                          "their OpenMP threads — one list per actor; the actor's own process (its client: "
                          "environments, tokenizing, trajectories) stays on actor_cpus. An engine on cores of its "
                          "own is what a GPU is to a GPU host's engine (docs/benchmarks.md); default: actor_cpus, "
                          "else, for several engines on one host, each its own share of the launcher's cores")
    learner_memory_fraction: float = Field(
        0.4, gt=0, lt=1, description="colocated mode only (the learner and an engine on one GPU): the share of the "
                                     "GPU's memory the learner may allocate (torch's per-process memory fraction); "
                                     "with rollout.engine.gpu_memory_utilization at most 0.95 of the GPU (docs/gpu.md)")

    @field_validator("learner_cpus", "actor_cpus", "engine_cpus")
    @classmethod
    def _cpu_ids(cls, ids):
        flat = [] if ids is None else [i for x in ids for i in (x if isinstance(x, list) else [x])]
        if any(i < 0 for i in flat) or (ids is not None and any(isinstance(x, list) and not x for x in ids)) or (
                ids is not None and not ids):
            raise ValueError("CPU cores are non-empty lists of core ids 0, 1, ...")
        return ids

    @field_validator("learner_gpus")
    @classmethod
    def _learner_ids(cls, ids: list[int] | None) -> list[int] | None:
        if ids is not None and any(i < 0 for i in ids):
            raise ValueError("GPU positions are 0, 1, ... among the visible GPUs")
        return ids

    @field_validator("actor_gpus")
    @classmethod
    def _actor_ids(cls, groups: list[list[int]] | None) -> list[list[int]] | None:
        if groups is not None and any(i < 0 for g in groups for i in g):
            raise ValueError("GPU positions are 0, 1, ... among the visible GPUs")
        return groups


class RayLauncherConfig(_Frozen):
    """``launcher.type=ray`` (docs/cluster.md): the run's processes as Ray actors in one placement group."""

    address: str | None = Field(None, description="the Ray cluster to attach to (ray.init(address=...): 'auto', "
                                "'HEAD:6379', 'ray://HEAD:10001'); None: start a Ray instance on this machine for "
                                "the run and stop it after (tests, one machine)")
    num_cpus: float | None = Field(None, gt=0, description="a started instance's logical CPUs (default: what the "
                                   "run's bundles need, at least this machine's cores)")
    num_gpus: int | None = Field(None, ge=0, description="a started instance's GPUs; logical ones work on a CPU "
                                 "machine (each process then sees a CUDA_VISIBLE_DEVICES but no GPU, and runs on "
                                 "the CPU): how the tests place GPU bundles without GPUs. Default: Ray's count")
    gpus: bool | None = Field(None, description="give learner ranks and engines GPU bundles; None: when the "
                              "cluster has GPUs (and resources.device is not cpu)")
    cpus_per_process: float = Field(1.0, gt=0, description="the CPUs of each process's bundle")
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="the placement group's strategy over the bundles; each engine is one bundle, so its "
                            "tensor-parallel GPUs are on one node whatever this says")
    ready_timeout_s: float = Field(600.0, gt=0, description="how long the placement group may wait for resources "
                                   "before the run fails with what it asked for")


class SlurmLauncherConfig(_Frozen):
    """``horizonrl slurm CONFIG > job.sbatch`` (docs/cluster.md): one allocation, one ``srun --exact`` step per
    process, the learner's ranks under torchrun."""

    nodes: int = Field(1, ge=1, description="nodes of the allocation (the steps are placed on them by Slurm)")
    gpus_per_node: int = Field(0, ge=0, description="GPUs per node to allocate (--gres=gpu:N); 0: a CPU run")
    partition: str | None = None
    account: str | None = None
    time: str = Field("24:00:00", description="the job's time limit (--time)")
    cpus_per_process: int = Field(2, ge=1, description="--cpus-per-task of each step")
    mem_per_process_gb: int = Field(16, ge=1, description="--mem of each step (one process; an engine or learner "
                                    "rank on a GPU node needs host memory for its weights)")
    control_port: int = Field(29400, ge=1, le=65535, description="the coordinator's ports on the first node "
                              "(control_port and control_port + 1): fixed, since nothing can pick them for "
                              "processes that start on other nodes")
    torchrun_port: int = Field(29402, ge=1, le=65535, description="the learner's torchrun rendezvous port")
    max_restarts: int | None = Field(None, ge=0, description="restarts of an actor or buffer step, and of the "
                                     "learner's step (a gang), within supervision.window_s (default: "
                                     "supervision.max_restarts and supervision.max_learner_restarts)")
    setup: list[str] = Field([], description="shell lines run before the steps, e.g. `source .venv/bin/activate` or "
                             "`module load cuda`")
    python: str = Field("python", description="the interpreter on the nodes")
    sbatch: list[str] = Field([], description="extra #SBATCH options, e.g. ['--qos=high']")


class LauncherConfig(_Frozen):
    """What starts and restarts the run's processes (docs/cluster.md). Whatever does, they find each other by
    registering with the coordinator (network)."""

    type: Literal["local", "inline", "ray", "slurm"] = Field(
        "local", description="local: subprocesses of `horizonrl train` on this machine, supervised by it; inline: "
                             "every role a thread of the one `horizonrl train` process, for debugging and tests "
                             "(one learner rank, no restarts; docs/architecture.md); ray: Ray "
                             "actors in one placement group, supervised the same way (supervision.*); slurm: "
                             "`horizonrl slurm CONFIG > job.sbatch`, then sbatch it (its script applies "
                             "supervision.* in bash)")
    ray: RayLauncherConfig = RayLauncherConfig()
    slurm: SlurmLauncherConfig = SlurmLauncherConfig()


class EvalConfig(_Frozen):
    episodes: int = Field(100, ge=0, description="held-out episodes before and after training (0: skip)")
    samples_per_task: int = Field(1, ge=1, description="episodes per held-out task before and after training: "
                                  "the first eval.episodes test-split tasks are each played this many times (for "
                                  "an environment with fewer test tasks than the episodes wanted, e.g. TextCraft)")
    max_turns: int | None = Field(None, ge=1, description="turn budget of held-out episodes (default: the "
                                  "schedule's last value)")
    temperature: float = Field(1.0, gt=0)
    every: int = Field(0, ge=0, description="held-out evaluation during training every N learner steps, and at step "
                       "0 and the last step (0: off): actor 0 plays episodes_during_training test-split episodes per "
                       "environment with its current weights (never trained on) and the coordinator logs "
                       "eval/success_rate and eval/<env>/success_rate at that step (docs/learning.md)")
    episodes_during_training: int = Field(32, ge=1, description="held-out episodes per environment of each "
                                          "evaluation during training: the first N test-split task ids, the same "
                                          "every time")
    final_wait_s: float = Field(300.0, gt=0, description="how long the coordinator holds the run open after the "
                                "learner's last step for that step's evaluation")
    stop_after_plateau: int = Field(0, ge=0, description="end training early when held-out success (eval.every) "
                                    "has not beaten its best by more than eval.plateau_min_delta for this many "
                                    "evaluations in a row: the learner saves and stops at its next step boundary "
                                    "(0: off)")
    plateau_min_delta: float = Field(0.02, ge=0, description="the rise in held-out success that counts as "
                                     "progress for eval.stop_after_plateau")


class TrainConfig(_Frozen):
    run: RunConfig = RunConfig()
    model: ModelConfig
    envs: list[EnvSpec] = Field(..., min_length=1)
    rollout: RolloutConfig = RolloutConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    learner: LearnerConfig = LearnerConfig()
    buffer: BufferConfig = BufferConfig()
    network: NetworkConfig = NetworkConfig()
    monitor: MonitorConfig = MonitorConfig()
    supervision: SupervisionConfig = SupervisionConfig()
    eval: EvalConfig = EvalConfig()
    resources: ResourcesConfig = Field(ResourcesConfig(), description="devices of the learner ranks and the actors' "
                                       "engines (docs/gpu.md); default: the visible GPUs split in order")
    launcher: LauncherConfig = LauncherConfig()

    @model_validator(mode="after")
    def _check(self) -> "TrainConfig":
        if self.rollout.n < 2:
            raise ValueError("rollout.n must be >= 2: GRPO compares episodes within a group")
        if self.rollout.synchronous and self.buffer.skip_equal_reward_groups:
            raise ValueError("rollout.synchronous needs buffer.skip_equal_reward_groups=false: the actors make "
                             "exactly one batch per weight version, so a dropped group would leave it short")
        if self.buffer.capacity_groups < self.learner.groups_per_step:
            raise ValueError(f"buffer.capacity_groups ({self.buffer.capacity_groups}) is below learner.groups_per_step "
                             f"({self.learner.groups_per_step}): the buffer stops taking trajectories at capacity, so "
                             f"the learner would wait forever for a batch; set buffer.capacity_groups to about "
                             f"{2 * self.learner.groups_per_step} (two steps' worth)")
        if self.buffer.max_staleness < self.rollout.weight_sync_every - 1:
            raise ValueError(f"buffer.max_staleness ({self.buffer.max_staleness}) is below "
                             "rollout.weight_sync_every - 1 "
                             f"({self.rollout.weight_sync_every - 1}): between two weight updates the learner moves "
                             f"that many steps past the engines' weights, so every group would be dropped as stale; "
                             f"set buffer.max_staleness to at least {self.rollout.weight_sync_every}")
        for name in ("actor_cpus", "engine_cpus"):
            per_actor = getattr(self.resources, name)
            if per_actor is not None and len(per_actor) != self.rollout.num_actors:
                raise ValueError(f"resources.{name} has {len(per_actor)} core lists for rollout.num_actors="
                                 f"{self.rollout.num_actors}: give one list per actor")
        if self.learner.pack_tokens is not None and self.algorithm.adv_estimator in ("gae", "reinforce_plus_plus"):
            raise ValueError(f"learner.pack_tokens packs trajectories into one row, but adv_estimator="
                             f"{self.algorithm.adv_estimator} computes returns along each row, which would run from "
                             "one trajectory into the next: unset learner.pack_tokens, or use an outcome estimator "
                             "(grpo)")
        if self.rollout.agent is not None and self.rollout.context.policy != "cut":
            raise ValueError(f"rollout.context.policy={self.rollout.context.policy} applies to episodes the actor "
                             "plays itself; an agent program (rollout.agent) keeps its own history: leave it cut")
        if self.eval.stop_after_plateau and not self.eval.every:
            raise ValueError("eval.stop_after_plateau needs held-out evaluations during training: set eval.every "
                             "(e.g. eval.every=10)")
        return self

    @property
    def output_dir(self) -> Path:
        return Path(self.run.output_dir)

    @property
    def run_dir(self) -> RunDir:
        """Every path of the run directory, by name (core/run_dirs.py)."""
        return RunDir(self.run.output_dir)

    @property
    def step_token_budget(self) -> int:
        """The most tokens one learner step may be given: groups_per_step groups of rollout.n trajectories, each at
        the context limit in each of its segments (the buffer refuses longer ones at its door; the learner refuses a
        bigger batch)."""
        context = self.rollout.context
        segments = context.max_segments if context.policy != "cut" else 1
        return self.learner.groups_per_step * self.rollout.n * self.rollout.max_context_tokens * segments


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message says what to fix."""


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """``["a.b=1", "c=[1,2]"]`` -> ``{"a": {"b": 1}, "c": [1, 2]}`` (values parsed as YAML)."""
    tree: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form dotted.key=value")
        try:
            value = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"override {item!r}: value is not valid YAML ({exc})") from None
        node = tree
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r} conflicts with another override of {part!r}")
        node[parts[-1]] = value
    return tree


def deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_typed_config(model: type[BaseModel], path: str | Path | None, overrides: list[str] | None = None,
                      what: str = "config") -> Any:
    """Read YAML into ``model``, apply dotted overrides, validate once. Raises ConfigError with what to fix."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
    data = deep_merge(data, parse_overrides(overrides or []))
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        lines = [f"  {'.'.join(str(p) for p in err['loc']) or '(top)'}: {err['msg']}" for err in exc.errors()]
        raise ConfigError(f"invalid {what}:\n" + "\n".join(lines)) from None


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> TrainConfig:
    """The training run's config (see :func:`load_typed_config`)."""
    return load_typed_config(TrainConfig, path, overrides)


def dump_config(config: BaseModel) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
