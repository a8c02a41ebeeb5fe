"""What each AgentGym-RL setting becomes in horizonrl: its defaults (what a script that leaves a setting out
runs with), the table of settings mapped one to one or not at all (with why), and the mappings that take
several settings together (the environment, the run's length, KL, the context, batches, the output)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Callable

from horizonrl.apps.import_agentgym_rl.shell import ShellCommand
from horizonrl.core.config import ConfigError

TRAINER_MODULES = ("verl.agent_trainer.main_ppo", "verl.trainer.main_ppo")
EVAL_MODULES = ("verl.agent_trainer.main_generation", "verl.trainer.main_generation")

# What AgentGym-RL's run uses for a setting its script leaves out, for the settings mapped here:
# its verl/agent_trainer/config/ppo_trainer.yaml, plus the actor's AdamW weight decay (read with
# a default of 1e-2) and the learning-rate schedule (constant after the warm-up, whatever
# optim.warmup_style says).
AGENTGYM_RL_DEFAULTS: dict[str, Any] = {
    "data.train_file": "~/data/rlhf/gsm8k/train.parquet",
    "data.max_prompt_length": 2048,
    "data.max_response_length": 2048,
    "data.train_batch_size": 1024,
    "actor_rollout_ref.actor.ppo_mini_batch_size": 256,
    "actor_rollout_ref.actor.ppo_micro_batch_size": None,
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": None,
    "actor_rollout_ref.actor.grad_clip": 1.0,
    "actor_rollout_ref.actor.clip_ratio": 0.2,
    "actor_rollout_ref.actor.entropy_coeff": 0.001,
    "actor_rollout_ref.actor.use_kl_loss": False,
    "actor_rollout_ref.actor.kl_loss_coef": 0.001,
    "actor_rollout_ref.actor.kl_loss_type": "low_var_kl",
    "actor_rollout_ref.actor.ppo_epochs": 1,
    "actor_rollout_ref.actor.optim.lr": 1e-6,
    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": 0.0,
    "actor_rollout_ref.actor.optim.weight_decay": 0.01,
    "actor_rollout_ref.agentgym.task_name": "textcraft",
    "actor_rollout_ref.rollout.temperature": 1.0,
    "actor_rollout_ref.rollout.top_p": 1.0,
    "actor_rollout_ref.rollout.gpu_memory_utilization": 0.5,
    "actor_rollout_ref.rollout.enforce_eager": True,
    "actor_rollout_ref.rollout.max_model_len": 32768,
    "actor_rollout_ref.rollout.max_num_seqs": 1024,
    "actor_rollout_ref.rollout.max_tokens": 1024,
    "actor_rollout_ref.rollout.n": 1,
    "algorithm.gamma": 1.0,
    "algorithm.lam": 1.0,
    "algorithm.adv_estimator": "gae",
    "algorithm.kl_penalty": "kl",
    "algorithm.rounds_ctrl.type": "fixed",
    "algorithm.rounds_ctrl.rounds": 15,
    "algorithm.rounds_ctrl.steps_scaling_inter": 100,
    "algorithm.kl_ctrl.type": "fixed",
    "algorithm.kl_ctrl.kl_coef": 0.001,
    "critic.optim.lr": 1e-5,
    "trainer.total_epochs": 30,
    "trainer.total_training_steps": None,
    "trainer.project_name": "verl_examples",
    "trainer.experiment_name": "gsm8k",
    "trainer.logger": ["console", "wandb"],
    "trainer.save_freq": -1,
}

# The environments horizonrl has, and the max rounds AgentGym-RL evaluates each with
# (examples/eval/<env>_eval.sh: agentgym.max_rounds).
ENVIRONMENTS = ("babyai", "sciworld", "searchqa", "textcraft")
EVAL_MAX_ROUNDS = {"babyai": 20, "sciworld": 30, "searchqa": 30, "textcraft": 30, "webarena": 15}

_PLACEMENT = "GPU placement is set by learner.num_ranks and rollout.num_actors (each with GPUs of its own)"
_ENGINE = "a vLLM setting of AgentGym-RL's hybrid engine (training and generation on the same GPUs)"
_RECOMPUTE = ("AgentGym-RL recomputes the old log-probs with the actor; horizonrl trains against the engine's own "
              "(behaviour) log-probs")


@dataclass(frozen=True)
class Direct:
    target: str
    convert: Callable[[Any], Any] | None = None


@dataclass(frozen=True)
class Unmapped:
    kind: str  # "ignored" | "no equivalent"
    reason: str
    neutral: tuple = ()  # values that behave as horizonrl does anyway: reported as ignored


def _kl_loss_type(value: Any) -> str:
    names = {"low_var_kl": "low_var_kl", "kl": "k1", "mse": "k2"}
    if value in names:
        return names[value]
    if value in ("abs", "full"):
        raise ConfigError(f"kl_loss_type={value}: horizonrl has no {value!r} KL estimator (it has low_var_kl, "
                          "kl as k1, mse as k2)")
    raise ConfigError(f"kl_loss_type={value}: not one of AgentGym-RL's KL estimators (low_var_kl, kl, mse, abs)")


def _adv_estimator(value: Any) -> Any:
    if value == "remax":
        raise ConfigError("algorithm.adv_estimator=remax: horizonrl has no ReMax estimator (it has grpo, rloo, "
                          "reinforce_plus_plus, gae, gigpo)")
    return value


def _engine_dtype(value: Any) -> str:
    names = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16", "half": "float16",
             "float32": "float32", "fp32": "float32", "float": "float32", "auto": "auto"}
    if str(value) not in names:
        raise ConfigError(f"actor_rollout_ref.rollout.dtype={value}: not a dtype horizonrl's engine takes "
                          "(bfloat16, float16, float32)")
    return names[str(value)]


def _rounds(value: Any) -> list:
    return value if isinstance(value, list) else [value]


RULES: dict[str, Direct | Unmapped | str] = {
    # --- mapped one to one
    "actor_rollout_ref.model.path": Direct("model.path"),
    "data.train_batch_size": Direct("learner.groups_per_step"),
    "actor_rollout_ref.actor.ppo_mini_batch_size": Direct("learner.ppo_mini_batch_size"),
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": Direct("learner.micro_batch_size"),
    "actor_rollout_ref.actor.grad_clip": Direct("learner.grad_clip"),
    "actor_rollout_ref.actor.clip_ratio": Direct("learner.clip_ratio"),
    "actor_rollout_ref.actor.entropy_coeff": Direct("learner.entropy_coeff"),
    "actor_rollout_ref.actor.ppo_epochs": Direct("learner.ppo_epochs"),
    "actor_rollout_ref.actor.optim.lr": Direct("learner.lr"),
    "actor_rollout_ref.actor.optim.weight_decay": Direct("learner.weight_decay"),
    "actor_rollout_ref.rollout.n": Direct("rollout.n"),
    "actor_rollout_ref.rollout.temperature": Direct("rollout.temperature"),
    "actor_rollout_ref.rollout.top_p": Direct("rollout.top_p"),
    "actor_rollout_ref.rollout.max_tokens": Direct("rollout.max_tokens_per_turn"),
    "actor_rollout_ref.rollout.gpu_memory_utilization": Direct("rollout.engine.gpu_memory_utilization"),
    "actor_rollout_ref.rollout.enforce_eager": Direct("rollout.engine.enforce_eager"),
    "actor_rollout_ref.rollout.max_num_seqs": Direct("rollout.engine.max_num_seqs"),
    # AgentGym-RL, too, keeps fp32 weights in training and generates in this dtype
    "actor_rollout_ref.rollout.dtype": Direct("rollout.engine.dtype", _engine_dtype),
    "actor_rollout_ref.rollout.tensor_model_parallel_size": Direct("rollout.engine.tensor_parallel_size"),
    "algorithm.adv_estimator": Direct("algorithm.adv_estimator", _adv_estimator),
    "algorithm.gamma": Direct("algorithm.gamma"),
    "algorithm.lam": Direct("algorithm.lam"),
    "algorithm.rounds_ctrl.type": Direct("algorithm.rounds_ctrl.type"),
    "algorithm.rounds_ctrl.rounds": Direct("algorithm.rounds_ctrl.rounds", _rounds),
    "algorithm.rounds_ctrl.steps_scaling_inter": Direct("algorithm.rounds_ctrl.steps_scaling_inter"),
    "trainer.save_freq": Direct("learner.save_every", lambda v: max(int(v), 0)),
    "trainer.experiment_name": Direct("run.name"),
    # --- mapped together with others (see convert())
    "data.train_file": "combined", "data.max_prompt_length": "combined", "data.max_response_length": "combined",
    "actor_rollout_ref.rollout.prompt_length": "combined", "actor_rollout_ref.rollout.response_length": "combined",
    "actor_rollout_ref.rollout.max_model_len": "combined", "actor_rollout_ref.agentgym.task_name": "combined",
    "actor_rollout_ref.actor.use_kl_loss": "combined", "actor_rollout_ref.actor.kl_loss_coef": "combined",
    "actor_rollout_ref.actor.kl_loss_type": "combined", "algorithm.kl_penalty": "combined",
    "algorithm.kl_ctrl.type": "combined", "algorithm.kl_ctrl.kl_coef": "combined",
    "algorithm.kl_ctrl.horizon": "combined", "algorithm.kl_ctrl.target_kl": "combined",
    "actor_rollout_ref.actor.ppo_micro_batch_size": "combined",
    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": "combined",
    "trainer.total_epochs": "combined", "trainer.total_training_steps": "combined",
    "trainer.project_name": "combined", "trainer.logger": "combined", "trainer.default_local_dir": "combined",
    "trainer.nnodes": "combined", "trainer.n_gpus_per_node": "combined",
    "critic.optim.lr": "combined",
    # --- not mapped
    "data.tokenizer": Unmapped("no equivalent", "horizonrl uses model.path's own tokenizer", (None,)),
    "data.val_files": Unmapped("no equivalent", "held-out evaluation uses the environment's test split, before "
                                "and after training (eval.episodes; `horizonrl eval --ids FILE` takes id files)"),
    "data.prompt_key": Unmapped("ignored", "horizonrl's tasks are environment ids", ("item_id",)),
    "data.val_batch_size": Unmapped("ignored", "validation batching"),
    "data.return_raw_input_ids": Unmapped("ignored", "data loading detail of verl"),
    "data.return_raw_chat": Unmapped("ignored", "data loading detail of verl"),
    "data.shuffle": Unmapped("ignored", "horizonrl draws each group's task at random from the train split"),
    "data.seed": Unmapped("ignored", "seeds verl's data sampler; run.seed seeds horizonrl's task draws"),
    "actor_rollout_ref.hybrid_engine": Unmapped("ignored", "horizonrl's engines and learner are separate "
                                                 "processes; " + _PLACEMENT),
    "actor_rollout_ref.model.external_lib": Unmapped("no equivalent", "model.path must load with "
                                                      "transformers' AutoModelForCausalLM", (None,)),
    "actor_rollout_ref.model.override_config": Unmapped("no equivalent", "edit the model's config.json", ({},)),
    "actor_rollout_ref.model.enable_gradient_checkpointing": Unmapped("ignored", "memory/speed trade-off of "
                                                                       "verl's actor"),
    "actor_rollout_ref.model.use_remove_padding": Unmapped("ignored", "speed setting of verl's actor"),
    "actor_rollout_ref.actor.strategy": Unmapped("ignored", "horizonrl's learner is FSDP2 over learner.num_ranks"),
    "actor_rollout_ref.actor.use_dynamic_bsz": Unmapped("no equivalent", "micro-batches are learner.micro_batch_size "
                                                         "trajectories", (False,)),
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": Unmapped("ignored", "used only with use_dynamic_bsz"),
    "actor_rollout_ref.actor.shuffle": Unmapped("ignored", "order of mini-batches within a step", (False,)),
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": Unmapped("no equivalent", "horizonrl has no sequence "
                                                                        "parallelism", (1,)),
    "actor_rollout_ref.actor.optim.min_lr_ratio": Unmapped("ignored", "AgentGym-RL's actor keeps the lr constant "
                                                            "after the warm-up whatever this says"),
    "actor_rollout_ref.actor.optim.warmup_style": Unmapped("ignored", "AgentGym-RL's actor keeps the lr constant "
                                                            "after the warm-up whatever this says"),
    "actor_rollout_ref.actor.optim.total_training_steps": Unmapped("ignored", "filled in by AgentGym-RL's trainer; "
                                                                    "trainer.total_training_steps sets the run length"),
    "actor_rollout_ref.actor.optim.betas": Unmapped("no equivalent", "horizonrl's AdamW uses betas (0.9, 0.999)",
                                                     ([0.9, 0.999],)),
    "actor_rollout_ref.actor.fsdp_config.": Unmapped("ignored", "sharding and offload of verl's actor; horizonrl "
                                                      "shards with FSDP2 over learner.num_ranks"),
    "actor_rollout_ref.ref.": Unmapped("ignored", "the reference policy (learner.use_kl_loss) is a frozen copy of "
                                        "model.path on the learner's ranks"),
    "actor_rollout_ref.agentgym.env_addr": Unmapped("ignored", "horizonrl runs the environment itself (in the actor "
                                                     "processes; `horizonrl env serve` for a server of its own)"),
    "actor_rollout_ref.agentgym.max_retries": Unmapped("ignored", "retries of AgentGym-RL's environment client"),
    "actor_rollout_ref.agentgym.timeout": Unmapped("ignored", "HTTP timeout of AgentGym-RL's environment client; "
                                                    "rollout.episode_timeout_s bounds an episode in horizonrl"),
    "actor_rollout_ref.agentgym.max_rounds": Unmapped("ignored", "AgentGym-RL's trainer takes the turn budget from "
                                                       "algorithm.rounds_ctrl (its evaluation reads this; here that "
                                                       "is eval.max_turns)"),
    "actor_rollout_ref.rollout.name": Unmapped("ignored", "horizonrl's engine is vLLM", ("vllm",)),
    "actor_rollout_ref.rollout.top_k": Unmapped("no equivalent", "horizonrl samples without a top-k cut", (-1, 0)),
    "actor_rollout_ref.rollout.ignore_eos": Unmapped("no equivalent", "horizonrl's engine stops at EOS", (False,)),
    "actor_rollout_ref.rollout.free_cache_engine": Unmapped("ignored", _ENGINE),
    "actor_rollout_ref.rollout.load_format": Unmapped("ignored", _ENGINE),
    "actor_rollout_ref.rollout.max_num_batched_tokens": Unmapped("ignored", "vLLM scheduling setting"),
    "actor_rollout_ref.rollout.log_prob_micro_batch_size": Unmapped("ignored", _RECOMPUTE),
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": Unmapped("ignored", _RECOMPUTE),
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz": Unmapped("ignored", _RECOMPUTE),
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": Unmapped("ignored", _RECOMPUTE),
    "actor_rollout_ref.rollout.disable_log_stats": Unmapped("ignored", "vLLM logging"),
    "actor_rollout_ref.rollout.enable_chunked_prefill": Unmapped("ignored", "vLLM scheduling setting"),
    "actor_rollout_ref.rollout.do_sample": Unmapped("no equivalent", "horizonrl always samples", (True,)),
    "actor_rollout_ref.rollout.send_interval": Unmapped("ignored", "request pacing of AgentGym-RL's rollout"),
    "actor_rollout_ref.rollout.rollout_log_dir": Unmapped("ignored", "horizonrl records episodes under "
                                                           "<output_dir>/episodes (monitor.record_fraction)"),
    "critic.": Unmapped("ignored", "critic internals (horizonrl's critic: algorithm.critic_lr, algorithm.vf_coef)"),
    "critic.cliprange_value": Unmapped("no equivalent", "horizonrl's critic loss ½(V − R)² is not clipped"),
    "reward_model.": Unmapped("no equivalent", "rewards come from the environment", (False, None)),
    "custom_reward_function.": Unmapped("no equivalent", "rewards come from the environment", (None,)),
    "trainer.val_generations_to_log_to_wandb": Unmapped("ignored", "horizonrl logs sample episodes every "
                                                         "monitor.episode_sample_every_s"),
    "trainer.resume_mode": Unmapped("ignored", "resume with `horizonrl train CONFIG resume=auto`"),
    "trainer.resume_from_path": Unmapped("no equivalent", "verl checkpoints cannot be resumed; start from a "
                                          "Hugging Face export with model.path", (False, None)),
    "trainer.test_freq": Unmapped("no equivalent", "horizonrl evaluates before and after training "
                                   "(eval.episodes)", (-1,)),
    "trainer.critic_warmup": Unmapped("no equivalent", "the critic trains from the first step", (0,)),
    "trainer.default_hdfs_dir": Unmapped("ignored", "checkpoint copies to HDFS", (None,)),
    "trainer.remove_previous_ckpt_in_save": Unmapped("ignored", "checkpoint housekeeping"),
    "trainer.del_local_ckpt_after_load": Unmapped("ignored", "checkpoint housekeeping"),
    "trainer.storage_mode": Unmapped("ignored", "checkpoint storage"),
}


# A default of AgentGym-RL's that the script leaves out is written only where it matters.
DEFAULT_APPLIES: dict[str, Callable[[dict[str, Any]], bool]] = {
    "trainer.experiment_name": lambda s: False,  # verl's example name, not the run's
    "algorithm.gamma": lambda s: s["algorithm.adv_estimator"] in ("gae", "reinforce_plus_plus"),
    "algorithm.lam": lambda s: s["algorithm.adv_estimator"] == "gae",
    "algorithm.rounds_ctrl.steps_scaling_inter": lambda s: s["algorithm.rounds_ctrl.type"] != "fixed",
}


def rule_for(key: str) -> Direct | Unmapped | str | None:
    if key in RULES:
        return RULES[key]
    prefixes = [p for p in RULES if p.endswith(".") and key.startswith(p)]
    return RULES[max(prefixes, key=len)] if prefixes else None




@dataclass
class Override:
    """One ``key=value`` of the trainer's command line."""

    key: str
    text: str  # the value as the shell handed it over
    value: Any
    added: bool = False  # written +key=value (Hydra adds a key its config does not have)


def value_text(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (list, dict)) or value is None else str(value)


def gpus_text(given: dict[str, Override]) -> str:
    nodes = given["trainer.nnodes"].value if "trainer.nnodes" in given else 1
    per_node = given["trainer.n_gpus_per_node"].value if "trainer.n_gpus_per_node" in given else 8
    return f"{nodes} × {per_node}" + ("" if {"trainer.nnodes", "trainer.n_gpus_per_node"} & set(given)
                                      else ", AgentGym-RL's default")


def map_environment(settings, given, command, script_path, data_root, put, messages) -> None:
    task = settings["actor_rollout_ref.agentgym.task_name"]
    source = f"actor_rollout_ref.agentgym.task_name={task}"
    if "actor_rollout_ref.agentgym.task_name" not in given:
        guess = _env_from_train_file(settings, command, script_path, data_root)
        if guess:
            task, source = guess, f"data.train_file={settings['data.train_file']}"
            messages.append(f"note: environment {task!r} taken from data.train_file (the script does not set "
                            "actor_rollout_ref.agentgym.task_name)")
        else:
            source += " (AgentGym-RL's default)"
            messages.append(f"note: the script does not set actor_rollout_ref.agentgym.task_name; AgentGym-RL's "
                            f"default is {task!r}")
    task = str(task).lower()
    if task not in ENVIRONMENTS:
        raise ConfigError(f"{source}: horizonrl has no {task!r} environment (it has {', '.join(ENVIRONMENTS)})")
    put("envs", [{"name": task}], source)
    if task in EVAL_MAX_ROUNDS:
        put("eval.max_turns", EVAL_MAX_ROUNDS[task], f"AgentGym-RL's examples/eval/{task}_eval.sh max_rounds")
    if task == "searchqa":
        messages.append("note: searchqa: set envs[0].settings.data_dir (Search-R1 data) or retriever_url; without "
                        "them horizonrl's SearchQA uses a small synthetic corpus")


def _candidates(path: str, command: ShellCommand, script_path: Path | None, data_root: Path | None) -> list[Path]:
    given = Path(path).expanduser()
    if given.is_absolute():
        return [given]
    bases = ([data_root] if data_root else []) + [Path.cwd()] + ([script_path.parent] if script_path else [])
    out = []
    for base in bases:
        for candidate in (base / command.cwd / given, base / given):
            if candidate not in out:
                out.append(candidate)
    return out


def _item_env(item: Any) -> str | None:
    item_id = item.get("item_id") if isinstance(item, dict) else item
    match = re.fullmatch(r"\s*([A-Za-z][A-Za-z0-9]*)_(\d+)\s*", str(item_id))
    return match.group(1).lower() if match else None


def _load_ids(path: Path) -> list[Any]:
    text = path.read_text(encoding="utf-8").strip()
    if text.startswith("["):
        rows = json.loads(text)
    else:
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    if not isinstance(rows, list):
        raise ValueError("not a JSON list")
    return rows


def _env_from_train_file(settings, command, script_path, data_root) -> str | None:
    path = str(settings["data.train_file"])
    for candidate in _candidates(path, command, script_path, data_root):
        if candidate.is_file():
            try:
                names = {_item_env(row) for row in _load_ids(candidate)} - {None}
            except (OSError, ValueError):
                break
            if len(names) == 1:
                return names.pop()
            break
    match = re.match(r"([A-Za-z]+)", Path(path).name)
    name = match.group(1).lower() if match else ""
    return name if name in ENVIRONMENTS or name in EVAL_MAX_ROUNDS else None


def read_train_file(settings, given, command, script_path, data_root, messages, train_items=None) -> int | None:
    """The number of rows in data.train_file (what AgentGym-RL's epochs count), or None if unreadable."""
    if "data.train_file" not in given:
        return None  # AgentGym-RL's default is verl's GSM8K example file: nothing to count
    path = str(settings["data.train_file"])
    shown = f"data.train_file={given['data.train_file'].text}"
    why = ("horizonrl trains on the environment's own train split (each group's task drawn from its train ids), "
           "not on a list of ids")
    for candidate in _candidates(path, command, script_path, data_root):
        if not candidate.is_file():
            continue
        try:
            rows = _load_ids(candidate)
        except (OSError, ValueError) as exc:
            messages.append(f"no equivalent: {shown}: {why}; {candidate} could not be read as an id file ({exc})")
            return None
        names = sorted({_item_env(row) for row in rows} - {None})
        messages.append(f"no equivalent: {shown}: {why}; its {len(rows)} ids ({', '.join(names) or 'no env'}) set "
                        f"only the run length here (read from {candidate})")
        return len(rows)
    looked = ", ".join(str(c) for c in _candidates(path, command, script_path, data_root))
    size = (f"--train-items gives its size, {train_items}" if train_items is not None
            else "so its size is unknown (--data-root DIR or --train-items N)")
    messages.append(f"no equivalent: {shown}: {why}; not found (looked in {looked}), {size}")
    return None


def map_run_length(settings, given, items, put, describe, messages) -> None:
    total = settings["trainer.total_training_steps"]
    if total is not None:
        put("learner.total_steps", int(total), describe("trainer.total_training_steps"))
        if "trainer.total_epochs" in given:
            messages.append(f"ignored: {describe('trainer.total_epochs')}: trainer.total_training_steps sets the "
                            "run length")
    elif items is not None:
        batch = int(settings["data.train_batch_size"])
        per_epoch = items // batch  # verl's dataloader drops the last partial batch
        if per_epoch < 1:
            raise ConfigError(f"data.train_file has {items} ids, fewer than one batch "
                              f"({describe('data.train_batch_size')}): AgentGym-RL would not start")
        total = per_epoch * int(settings["trainer.total_epochs"])
        put("learner.total_steps", total, f"{describe('trainer.total_epochs')} × ({items} ids // "
                                          f"{batch} per step)")
    else:
        messages.append(f"note: learner.total_steps left at horizonrl's default: the run length is "
                        f"{describe('trainer.total_epochs')} × (ids in data.train_file // data.train_batch_size), "
                        "and the id file was not found (--data-root DIR or --train-items N), nor is "
                        "trainer.total_training_steps set")
    ratio = float(settings["actor_rollout_ref.actor.optim.lr_warmup_steps_ratio"] or 0.0)
    if ratio > 0:
        if total is None:
            messages.append(f"note: {describe('actor_rollout_ref.actor.optim.lr_warmup_steps_ratio')} not mapped: "
                            "the run length is unknown")
        else:
            put("learner.lr_warmup_steps", int(ratio * total),
                describe("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio") + f" × {total} steps")


def map_kl(settings, given, put, describe, messages) -> None:
    use_kl_loss = bool(settings["actor_rollout_ref.actor.use_kl_loss"])
    put("learner.use_kl_loss", use_kl_loss, describe("actor_rollout_ref.actor.use_kl_loss"))
    reward_kl = ("algorithm.kl_ctrl.type", "algorithm.kl_ctrl.kl_coef", "algorithm.kl_ctrl.horizon",
                 "algorithm.kl_ctrl.target_kl", "algorithm.kl_penalty")
    if use_kl_loss:
        put("learner.kl_loss_coef", settings["actor_rollout_ref.actor.kl_loss_coef"],
            describe("actor_rollout_ref.actor.kl_loss_coef"))
        put("learner.kl_loss_type", _kl_loss_type(settings["actor_rollout_ref.actor.kl_loss_type"]),
            describe("actor_rollout_ref.actor.kl_loss_type"))
        for key in reward_kl:
            if key in given:
                messages.append(f"ignored: {describe(key)}: with use_kl_loss=True AgentGym-RL puts the KL in the loss "
                                "(kl_loss_coef) and does not read this")
        return
    for key in ("actor_rollout_ref.actor.kl_loss_coef", "actor_rollout_ref.actor.kl_loss_type"):
        if key in given:
            messages.append(f"ignored: {describe(key)}: use_kl_loss is false")
    coef = settings["algorithm.kl_ctrl.kl_coef"]
    if coef:
        messages.append(f"no equivalent: {describe('algorithm.kl_ctrl.kl_coef')}: with use_kl_loss=false AgentGym-RL "
                        "subtracts kl_coef × KL(policy || reference) from the reward; horizonrl has the KL only as a "
                        f"loss term (learner.use_kl_loss=true learner.kl_loss_coef={coef} is the nearest)")
    for key in reward_kl:
        if key in given and key != "algorithm.kl_ctrl.kl_coef":
            messages.append(f"no equivalent: {describe(key)}: part of the KL penalty in the reward, which horizonrl "
                            "does not have")


def map_context(settings, given, put) -> None:
    """AgentGym-RL caps a whole episode at min(max_model_len, prompt_length + response_length) tokens."""
    prompt_key = ("actor_rollout_ref.rollout.prompt_length" if "actor_rollout_ref.rollout.prompt_length" in given
                  else "data.max_prompt_length")
    response_key = ("actor_rollout_ref.rollout.response_length" if "actor_rollout_ref.rollout.response_length" in given
                    else "data.max_response_length")
    prompt, response = int(settings[prompt_key]), int(settings[response_key])
    model_len = int(settings["actor_rollout_ref.rollout.max_model_len"])
    put("rollout.max_context_tokens", min(model_len, prompt + response),
        f"min({_short(given, settings, 'actor_rollout_ref.rollout.max_model_len')}, "
        f"{_short(given, settings, prompt_key)} + {_short(given, settings, response_key)})")


def _short(given, settings, key) -> str:
    return f"{key}={given[key].text if key in given else value_text(settings[key])}"


def map_micro_batch(settings, given, put, describe, messages) -> None:
    key = "actor_rollout_ref.actor.ppo_micro_batch_size"
    if settings[key] is None or settings["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"] is not None:
        if key in given and settings[key] is not None:
            messages.append(f"ignored: {describe(key)}: ppo_micro_batch_size_per_gpu is set (verl refuses both)")
        return
    gpus = 1
    for gpu_key, default in (("trainer.nnodes", 1), ("trainer.n_gpus_per_node", 8)):
        gpus *= int(given[gpu_key].value) if gpu_key in given else default
    put("learner.micro_batch_size", max(1, int(settings[key]) // gpus), f"{describe(key)} // {gpus} GPUs")


def map_output(settings, given, command, put, messages) -> None:
    if "trainer.default_local_dir" in given:
        put("run.output_dir", str(settings["trainer.default_local_dir"]),
            _given_text(given, "trainer.default_local_dir"))
    elif "trainer.project_name" in given or "trainer.experiment_name" in given:
        path = f"checkpoints/{settings['trainer.project_name']}/{settings['trainer.experiment_name']}"
        put("run.output_dir", path, "AgentGym-RL's default checkpoints/<project_name>/<experiment_name>")
    if command.cwd != PurePosixPath(".") and "actor_rollout_ref.model.path" in given:
        model = str(settings["actor_rollout_ref.model.path"])
        if not Path(model).expanduser().is_absolute():
            messages.append(f"note: model.path={model} is relative to {command.cwd}/ in the script (it `cd`s there); "
                            "horizonrl reads it relative to where `horizonrl train` starts")
    logger = settings["trainer.logger"]
    loggers = logger if isinstance(logger, list) else [logger]
    mode = command.env.get("WANDB_MODE", "online").lower()
    if "wandb" in loggers:
        how = f"trainer.logger={given['trainer.logger'].text}" if "trainer.logger" in given else \
            "trainer.logger=[console,wandb] (AgentGym-RL's default)"
        if mode in ("disabled", "dryrun"):
            messages.append(f"ignored: {how}: WANDB_MODE={mode}")
            return
        wandb = {"project": str(settings["trainer.project_name"]), "mode": "offline" if mode == "offline" else "online"}
        put("monitor.wandb", wandb, how + f", trainer.project_name, WANDB_MODE={mode}")
        messages.append(f"note: {how}: logs to Weights & Biases as well (monitor.wandb, project "
                        f"{wandb['project']!r}; needs `pip install wandb`); remove monitor.wandb for TensorBoard only")
    elif "trainer.project_name" in given:
        messages.append(f"ignored: {_given_text(given, 'trainer.project_name')}: no wandb in trainer.logger")


def _given_text(given: dict[str, Override], key: str) -> str:
    return f"{key}={given[key].text}"
