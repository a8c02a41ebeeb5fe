"""TRL's GRPO beside horizonrl: the same format-warmed SmolLM2 checkpoint, the same BabyAI task, the same clock.

    pip install -e ".[peer-trl]"                                   # trl==1.16.0; make demo / make test leave it out
    python scripts/peer_trl.py train --out runs/peer-trl --budget-min B
    python scripts/peer_trl.py evaluate --out runs/peer-trl        # held-out success of every saved step_N

``train`` runs TRL's ``GRPOTrainer`` (TRL's loss, advantages, optimizer loop and its own transformers generation)
on the episodes horizonrl plays for ``configs/smollm2_babyai.yaml``: the same environment and settings, the train
split's task ids, the same system prompt, chat layout and action format, the same turn limit, group size, groups
per optimizer step, learning rate, temperature and tokens per turn, all read from that config. The multi-turn
episodes go in through TRL's ``rollout_func`` (its hook for environments that are not tool calls): every turn of
the batch's episodes is generated together by TRL's own generation call, the observations are appended as tokens
with ``env_mask`` 0, and the episode's return is the reward. It stops at the first optimizer step past
``--budget-min`` minutes of training (or at ``--max-steps``), saves a Hugging Face checkpoint every
``--save-every`` steps and at the end into ``--out/step_N``, and writes ``--out/timeline.jsonl`` (one line per
step: wall seconds since training began and since the script began, episodes, trajectories/s, the step's mean
reward and success, the peak memory of the process tree so far).

``evaluate`` runs ``horizonrl eval`` on each checkpoint with the held-out settings ``horizonrl demo`` uses for
the config (its test split, ``eval.episodes``, turn budget, token limits, temperature, engine dtype) and writes
``--out/heldout.jsonl`` (step, wall seconds, success rate, per level). The mapping, setting by setting, and
what does not map: docs/benchmarks.md, "A peer: TRL".
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout without installing it

from horizonrl.actors.engine import Generation  # noqa: E402
from horizonrl.actors.episode import Episode, SamplingSettings, run_episode  # noqa: E402
from horizonrl.core.config import TrainConfig, load_config  # noqa: E402
from horizonrl.core.schedule import TurnBudgetSchedule  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "smollm2_babyai.yaml"
TIMELINE = "timeline.jsonl"
HELDOUT = "heldout.jsonl"
MEMORY_SAMPLE_S = 0.5
TRL_VERSION = "1.16.0"  # the version read for what follows (rollout_func, env_mask, _generate_single_turn)
# horizonrl's learner.loss_agg_mode -> TRL's loss_type with the same normaliser: token-mean divides by the loss tokens
# of the whole step (TRL's "dapo", its default), seq-mean-token-mean averages each sequence first ("grpo").
LOSS_TYPES = {"token-mean": "dapo", "seq-mean-token-mean": "grpo"}


# ------------------------------------------------------------------------------------- the settings, mapped


def max_turns_of(config: TrainConfig) -> int:
    return TurnBudgetSchedule.from_config(config.algorithm.rounds_ctrl).final_max_turns


def check_mappable(config: TrainConfig) -> None:
    """Refuse a config whose training TRL's GRPOTrainer cannot reproduce (say which setting)."""
    if len(config.envs) != 1:
        raise ValueError(f"one environment expected, the config has {len(config.envs)}")
    if config.algorithm.adv_estimator != "grpo":
        raise ValueError(f"algorithm.adv_estimator={config.algorithm.adv_estimator}: TRL's GRPOTrainer is GRPO only")
    if config.algorithm.rounds_ctrl.type != "fixed" or len(config.algorithm.rounds_ctrl.rounds) != 1:
        raise ValueError("algorithm.rounds_ctrl must be one fixed turn budget (TRL has no turn schedule)")
    lc = config.learner
    if lc.lr_schedule != "constant":
        raise ValueError("learner.lr_schedule must be constant (a decay would depend on TRL's max_steps)")
    if lc.ppo_epochs != 1 or lc.ppo_mini_batch_size is not None:
        raise ValueError("learner.ppo_epochs=1 and ppo_mini_batch_size=null expected (one update per batch)")
    if lc.loss_agg_mode not in LOSS_TYPES:
        raise ValueError(f"learner.loss_agg_mode={lc.loss_agg_mode} has no TRL loss_type (one of {list(LOSS_TYPES)})")
    if lc.clip_ratio_c is not None or lc.decoupled_loss:
        raise ValueError("learner.clip_ratio_c and decoupled_loss have no TRL counterpart; leave them unset")
    if (lc.groups_per_step * config.rollout.n) % lc.micro_batch_size:
        raise ValueError("learner.micro_batch_size must divide groups_per_step * rollout.n")


def grpo_arguments(config: TrainConfig, out_dir: Path, max_steps: int, gradient_checkpointing: bool) -> dict:
    """``GRPOConfig`` keyword arguments: the config's settings where TRL has them, TRL's defaults elsewhere
    (docs/benchmarks.md lists each). Pure, so a test reads the mapping without TRL."""
    check_mappable(config)
    lc, r, alg = config.learner, config.rollout, config.algorithm
    episodes_per_step = lc.groups_per_step * r.n
    return dict(
        output_dir=str(out_dir / "trl"),
        max_steps=max_steps,
        # One optimizer step = groups_per_step groups of n episodes, in micro-batches of micro_batch_size; TRL
        # generates the whole step's episodes at once (steps_per_generation defaults to the accumulation steps).
        num_generations=r.n,
        per_device_train_batch_size=lc.micro_batch_size,
        gradient_accumulation_steps=episodes_per_step // lc.micro_batch_size,
        num_iterations=1,  # one pass over each batch (learner.ppo_epochs=1)
        learning_rate=lc.lr,
        lr_scheduler_type="constant_with_warmup" if lc.lr_warmup_steps else "constant",  # TRL's default: linear
        warmup_steps=lc.lr_warmup_steps,
        weight_decay=lc.weight_decay,
        max_grad_norm=lc.grad_clip,
        epsilon=lc.clip_low,
        epsilon_high=lc.clip_high,
        loss_type=LOSS_TYPES[lc.loss_agg_mode],
        entropy_coef=lc.entropy_coeff,
        scale_rewards="group" if alg.norm_adv_by_std_in_grpo else "none",
        beta=lc.kl_loss_coef if lc.use_kl_loss else 0.0,
        # Sampling: max_completion_length is TRL's max_new_tokens of one generate() call, i.e. one turn here.
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=0,
        max_completion_length=r.max_tokens_per_turn,
        # bf16 autocast over fp32 master weights on the CPU (TRL refuses bf16 without use_cpu on a machine with no
        # GPU); learner.compute_dtype=bfloat16 with param_dtype=float32 is the same split.
        use_cpu=True,
        bf16=lc.compute_dtype == "bfloat16",
        gradient_checkpointing=gradient_checkpointing,
        use_vllm=False,
        seed=config.run.seed,
        logging_steps=1,
        report_to="none",
        save_strategy="no",  # the timeline callback saves step_N itself, with its wall time
        disable_tqdm=True,
    )


# ------------------------------------------------------------------------------------- the episodes


def train_rows(env: Any, system_prompt: str | None) -> list[dict]:
    """The dataset: one row per train-split task, its prompt the task's first observation as horizonrl shows it.
    TRL hands ``rollout_func`` the prompts only, so the task id rides in the user message (templates ignore it)."""
    async def first_observations() -> list[tuple[int, str]]:
        return [(task_id, await env.reset(task_id)) for task_id in env.task_ids("train")]

    rows = []
    for task_id, observation in asyncio.run(first_observations()):
        prompt = [] if system_prompt is None else [{"role": "system", "content": system_prompt, "task_id": -1}]
        rows.append({"prompt": [*prompt, {"role": "user", "content": observation, "task_id": task_id}],
                     "task_id": task_id})
    return rows


def task_ids_of(prompts: Sequence[list[dict]], n: int) -> list[int]:
    """Each prompt's task id; TRL's sampler repeats each task n times in a row (one GRPO group)."""
    ids = [int(prompt[-1]["task_id"]) for prompt in prompts]
    if len(ids) % n or any(len(set(ids[i:i + n])) != 1 for i in range(0, len(ids), n)):
        raise RuntimeError(f"expected groups of {n} prompts of one task in a row, got task ids {ids}")
    return ids


class LockstepTurns:
    """horizonrl's engine interface (``generate``) over one batched sampler, in lock step: a batch is sampled once
    every episode still playing has asked for its next turn, so turn k of every episode is generated together,
    as TRL's own multi-turn (tool) loop does. ``sample(prompts) -> generated ids`` is TRL's generation call."""

    def __init__(self, sample: Callable[[list[list[int]]], list[list[int]]], *, temperature: float, top_p: float,
                 max_tokens: int, stop_token_ids: Sequence[int]) -> None:
        self.sample = sample
        self.temperature, self.top_p, self.max_tokens = temperature, top_p, max_tokens
        self.stop_token_ids = set(stop_token_ids)
        self.playing = 0
        self.batch_sizes: list[int] = []
        self._waiting: list[tuple[list[int], int, asyncio.Future]] = []

    @contextlib.contextmanager
    def episode(self):
        """Count an episode as playing while its ``run_episode`` runs: the batch waits for it."""
        self.playing += 1
        try:
            yield
        finally:
            self.playing -= 1
            self._sample_when_all_wait()

    async def generate(self, prompt_ids, *, max_tokens, temperature, top_p, stop_token_ids) -> Generation:
        # One sampler serves one setting (TRL's generation config); the episode must ask for that one.
        if (temperature, top_p) != (self.temperature, self.top_p) or set(stop_token_ids) != self.stop_token_ids:
            raise ValueError(f"an episode asked for temperature={temperature} top_p={top_p} stop={stop_token_ids}; "
                             f"TRL samples with {self.temperature}, {self.top_p}, {sorted(self.stop_token_ids)}")
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((list(prompt_ids), min(max_tokens, self.max_tokens), future))
        self._sample_when_all_wait()
        return await future

    def _sample_when_all_wait(self) -> None:
        if not self._waiting or len(self._waiting) < self.playing:
            return
        batch, self._waiting = self._waiting, []
        self.batch_sizes.append(len(batch))
        try:
            outputs = self.sample([prompt for prompt, _, _ in batch])
        except Exception as exc:  # noqa: BLE001 - every waiting episode fails as an engine failure
            for _, _, future in batch:
                future.set_exception(exc)
            return
        for (_, limit, future), ids in zip(batch, outputs, strict=True):
            ids = list(ids)[:limit]  # the context's room, when it is below a turn's tokens
            finish = "stop" if ids and ids[-1] in self.stop_token_ids else "length"
            future.set_result(Generation(ids, [0.0] * len(ids), finish))


async def play_batch(task_ids: Sequence[int], turns: LockstepTurns, chat: Any, envs: list, *, max_turns: int,
                     sampling: SamplingSettings) -> list[Episode]:
    """One episode per task id (envs[i] plays the i-th), with horizonrl's own episode loop."""
    async def play(task_id: int, env: Any) -> Episode:
        with turns.episode():
            return await run_episode(turns, env, chat, task_id, max_turns=max_turns, sampling=sampling)

    return list(await asyncio.gather(*(play(t, env) for t, env in zip(task_ids, envs))))


def rollout_output(episodes: Sequence[Episode]) -> dict:
    """What TRL's ``rollout_func`` returns: each episode's first prompt, then everything after it as the
    "completion" (the generated turns, and the observations between them with ``env_mask`` 0), and the fields
    the reward function reads. TRL recomputes the log-probabilities itself (no vLLM), so ``logprobs`` is None."""
    for ep in episodes:
        if ep.failure:  # horizonrl never trains on these; TRL cannot leave one out of a group
            raise RuntimeError(f"an episode failed ({ep.failure}: {ep.failure_message}); not the agent's fault")
        if ep.sample_starts:
            raise RuntimeError("the chat template rewrote history; TRL takes one sequence per episode")
    return {
        "prompt_ids": [ep.token_ids[:ep.prompt_length] for ep in episodes],
        "completion_ids": [ep.token_ids[ep.prompt_length:] for ep in episodes],
        "env_mask": [ep.loss_mask[ep.prompt_length:] for ep in episodes],
        "logprobs": None,
        "episode_return": [ep.reward for ep in episodes],
        "episode_success": [float(ep.success) for ep in episodes],
    }


def episode_return(episode_return: list[float], **_: Any) -> list[float]:
    """TRL's reward function: the episode's return (the sum of its turn rewards), horizonrl's GRPO reward."""
    return list(episode_return)


@dataclass
class RolloutStats:
    """What the episodes of the current optimizer step did (read and reset at each step's end)."""

    episodes: int = 0
    successes: int = 0
    reward_sum: float = 0.0
    turns: int = 0
    invalid_actions: int = 0
    rollout_s: float = 0.0
    generate_calls: int = 0
    total_episodes: int = 0

    def add(self, episodes: Sequence[Episode], seconds: float, generate_calls: int) -> None:
        self.episodes += len(episodes)
        self.total_episodes += len(episodes)
        self.successes += sum(ep.success for ep in episodes)
        self.reward_sum += sum(ep.reward for ep in episodes)
        self.turns += sum(ep.num_turns for ep in episodes)
        self.invalid_actions += sum(ep.invalid_actions for ep in episodes)
        self.rollout_s += seconds
        self.generate_calls += generate_calls

    def take(self) -> dict:
        n = max(self.episodes, 1)
        out = {"episodes": self.episodes, "success_rate": self.successes / n, "mean_reward": self.reward_sum / n,
               "mean_turns": self.turns / n, "invalid_action_rate": self.invalid_actions / max(self.turns, 1),
               "rollout_s": round(self.rollout_s, 2), "generate_calls": self.generate_calls}
        self.episodes = self.successes = self.turns = self.invalid_actions = self.generate_calls = 0
        self.reward_sum = self.rollout_s = 0.0
        return out


@dataclass
class EpisodePlayer:
    """TRL's ``rollout_func``: plays the batch's episodes on reusable environments, one per slot."""

    config: TrainConfig
    chat: Any
    make_env: Callable[[str, dict], Any]
    stats: RolloutStats = field(default_factory=RolloutStats)
    envs: list = field(default_factory=list)

    def __call__(self, prompts: list, trainer: Any) -> dict:
        r, spec = self.config.rollout, self.config.envs[0]
        task_ids = task_ids_of(prompts, r.n)
        while len(self.envs) < len(task_ids):
            self.envs.append(self.make_env(spec.name, dict(spec.settings)))
        # No turn or episode timeout: a lock-step turn lasts as long as the whole batch's generate, and TRL has none.
        sampling = SamplingSettings(r.temperature, r.top_p, r.max_tokens_per_turn, r.max_context_tokens,
                                    r.system_prompt)
        turns = LockstepTurns(lambda batch: trl_generate(trainer, batch), temperature=r.temperature, top_p=r.top_p,
                              max_tokens=r.max_tokens_per_turn, stop_token_ids=self.chat.stop_token_ids)
        started = time.perf_counter()
        episodes = asyncio.run(play_batch(task_ids, turns, self.chat, self.envs, max_turns=max_turns_of(self.config),
                                          sampling=sampling))
        self.stats.add(episodes, time.perf_counter() - started, len(turns.batch_sizes))
        return rollout_output(episodes)


def trl_generate(trainer: Any, prompts: list[list[int]]) -> list[list[int]]:
    """One turn of every prompt, by TRL's own generation path: ``_generate_single_turn`` (TRL 1.16), the call its
    tool loop makes for each turn after the first (``num_generations=1``: each prompt is its own history). With
    ``use_vllm=False`` it is transformers' ``generate`` under TRL's generation config, cut after the first eos."""
    completion_ids, _ = trainer._generate_single_turn(prompts, None, {}, num_generations=1)
    return [list(ids) for ids in completion_ids]


# ------------------------------------------------------------------------------------- clock, memory, checkpoints


class MemoryPeak:
    """Peak summed RSS and PSS of this process and its children, sampled every ``MEMORY_SAMPLE_S`` in a thread
    (PSS as scripts/launcher_footprint.py sums it: shared pages split between their users)."""

    def __init__(self) -> None:
        import psutil

        self._root = psutil.Process()
        self.peak_rss = self.peak_pss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-peak", daemon=True)

    def start(self) -> "MemoryPeak":
        self.sample()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.sample()

    def sample(self) -> None:
        import psutil

        rss = pss = 0
        for proc in (self._root, *self._root.children(recursive=True)):
            try:
                info = proc.memory_full_info()
            except psutil.Error:
                continue
            rss, pss = rss + info.rss, pss + info.pss
        self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)

    def _run(self) -> None:
        while not self._stop.wait(MEMORY_SAMPLE_S):
            self.sample()

    def mib(self) -> dict:
        return {"peak_rss_mib": round(self.peak_rss / 2**20), "peak_pss_mib": round(self.peak_pss / 2**20)}


def save_checkpoint(trainer: Any, path: Path) -> float:
    """A Hugging Face checkpoint that vLLM loads: weights, config, generation config, and (Trainer.save_model saves
    the processing class) the tokenizer with its chat template. Returns the seconds it took."""
    started = time.perf_counter()
    trainer.save_model(str(path))
    return time.perf_counter() - started


@dataclass
class Clock:
    script_start: float  # time.monotonic() when the script began
    budget_s: float | None
    max_steps: int
    save_every: int
    train_start: float | None = None
    step_start: float | None = None


def timeline_callback(trainer_ref: dict, out_dir: Path, clock: Clock, stats: RolloutStats, memory: MemoryPeak):
    """A ``TrainerCallback`` (built here, so this module imports without TRL) that writes one timeline line per
    optimizer step, saves step_N every ``save_every`` steps and at the last, and stops at the budget."""
    from transformers import TrainerCallback

    class Timeline(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            clock.train_start = clock.step_start = time.monotonic()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.monotonic()
            train_s = now - clock.train_start
            last = state.global_step >= clock.max_steps or (clock.budget_s is not None and train_s >= clock.budget_s)
            record = {"step": state.global_step, "wall_s": round(train_s, 2),
                      "script_wall_s": round(now - clock.script_start, 2), "step_s": round(now - clock.step_start, 2),
                      **stats.take(), "episodes_total": stats.total_episodes,
                      "trajectories_per_s": round(stats.total_episodes / max(train_s, 1e-9), 4), **memory.mib()}
            if last or state.global_step % clock.save_every == 0:
                record["checkpoint"] = f"step_{state.global_step}"
                record["save_s"] = round(save_checkpoint(trainer_ref["trainer"], out_dir / record["checkpoint"]), 2)
            with open(out_dir / TIMELINE, "a") as f:
                f.write(json.dumps(record) + "\n")
            print(f"[peer-trl] step {record['step']}: {record['step_s']:.0f} s, train success "
                  f"{record['success_rate']:.2f}, reward {record['mean_reward']:.3f}, {train_s / 60:.1f} min"
                  + (f", saved {record['checkpoint']}" if "checkpoint" in record else ""), flush=True)
            clock.step_start = time.monotonic()
            if last:
                control.should_training_stop = True
            return control

    return Timeline()


# ------------------------------------------------------------------------------------- train


def train(args: argparse.Namespace) -> int:
    script_start = time.monotonic()
    config = load_config(args.config, args.overrides)
    model = args.model or config.model.path
    out_dir = Path(args.out)
    if (out_dir / TIMELINE).exists():
        print(f"error: {out_dir} already holds a run; pass a new --out", file=sys.stderr)
        return 2
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    max_steps = args.max_steps or 10**6  # the budget ends it; a constant lr does not depend on max_steps
    grpo_kwargs = grpo_arguments(config, out_dir, max_steps, args.gradient_checkpointing)
    memory = MemoryPeak().start()
    trainer, player = build_trainer(config, model, grpo_kwargs)
    clock = Clock(script_start, None if args.budget_min is None else args.budget_min * 60, max_steps, args.save_every)
    trainer_ref = {"trainer": trainer}
    trainer.add_callback(timeline_callback(trainer_ref, out_dir, clock, player.stats, memory))
    write_settings(out_dir, args, model, grpo_kwargs, trainer)
    print(f"[peer-trl] TRL {grpo_kwargs['num_generations']}x{config.learner.groups_per_step} episodes per step, "
          f"budget {args.budget_min} min, max steps {args.max_steps}, model {model}", flush=True)
    try:
        trainer.train()
    finally:
        memory.stop()
    return print_summary(out_dir, memory)


def build_trainer(config: TrainConfig, model_path: str, grpo_kwargs: dict):
    """TRL's GRPOTrainer on the model (fp32 master weights, TRL's default), with the episode player."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL 1.16: known
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from horizonrl.core.chat import ChatTokenizer
    from horizonrl.envs import make_env

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    chat = ChatTokenizer(tokenizer)
    if not chat.append_only:
        raise SystemExit("the model's chat template rewrites history; one TRL sequence per episode cannot hold it")
    spec = config.envs[0]
    dataset = Dataset.from_list(train_rows(make_env(spec.name, dict(spec.settings)), config.rollout.system_prompt))
    player = EpisodePlayer(config, chat, make_env)
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_path, dtype="float32"),
                          reward_funcs=[episode_return], args=GRPOConfig(**grpo_kwargs), train_dataset=dataset,
                          processing_class=tokenizer, rollout_func=player)
    if set(trainer.eos_token_ids) != set(chat.stop_token_ids):  # TRL's generate must stop where horizonrl's turns end
        raise SystemExit(f"TRL stops at {trainer.eos_token_ids}, horizonrl's turns at {chat.stop_token_ids}")
    return trainer, player


def write_settings(out_dir: Path, args: argparse.Namespace, model: str, grpo_kwargs: dict, trainer: Any) -> None:
    """What ran: the command, the GRPOConfig, the versions, and how accelerate set up the precision (bf16
    autocast wraps the model's forward, so TRL's generate runs under it too)."""
    import torch
    import transformers
    import trl

    (out_dir / "settings.json").write_text(json.dumps({
        "command": sys.argv, "model": model, "config": str(args.config), "budget_min": args.budget_min,
        "max_steps": args.max_steps, "save_every": args.save_every, "grpo_config": grpo_kwargs,
        "versions": {"trl": trl.__version__, "torch": torch.__version__, "transformers": transformers.__version__},
        "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(),
        "mixed_precision": str(trainer.accelerator.mixed_precision), "native_amp": trainer.accelerator.native_amp,
        "forward_under_autocast": hasattr(trainer.model, "_original_forward")}, indent=1))


def print_summary(out_dir: Path, memory: MemoryPeak) -> int:
    records = read_jsonl(out_dir / TIMELINE)
    if not records:
        print("[peer-trl] no optimizer step finished", flush=True)
        return 1
    last = records[-1]
    step_times = [r["step_s"] for r in records]
    summary = {"steps": last["step"], "train_wall_s": last["wall_s"], "script_wall_s": last["script_wall_s"],
               "episodes": last["episodes_total"], "trajectories_per_s": last["trajectories_per_s"],
               "mean_step_s": round(sum(step_times) / len(step_times), 1), **memory.mib(),
               "checkpoints": [r["checkpoint"] for r in records if "checkpoint" in r]}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"[peer-trl] {summary['steps']} steps in {summary['train_wall_s'] / 60:.1f} min of training "
          f"({summary['script_wall_s'] / 60:.1f} min in all), {summary['mean_step_s']} s per step, "
          f"{summary['trajectories_per_s']:.3f} trajectories/s, peak PSS {summary['peak_pss_mib']} MiB "
          f"(RSS {summary['peak_rss_mib']} MiB)", flush=True)
    print(json.dumps(summary), flush=True)
    return 0


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ------------------------------------------------------------------------------------- evaluate


def eval_command(config: TrainConfig, checkpoint: Path, episodes: int | None, result_json: Path) -> list[str]:
    """``horizonrl eval`` with the held-out settings ``horizonrl demo`` evaluates this config with
    (horizonrl/apps/demo.py ``held_out_specs``): the test split, its turn budget, token limits, temperature,
    samples per task and seed, and the rollout engine's dtype and KV cache."""
    spec, r = config.envs[0], config.rollout
    max_turns = config.eval.max_turns or max_turns_of(config)
    command = [sys.executable, "-m", "horizonrl", "eval", "--model", str(checkpoint), "--env", spec.name,
               "--env-settings", json.dumps(dict(spec.settings)), "--split", "test",
               "--episodes", str(episodes or config.eval.episodes), "--max-turns", str(max_turns),
               "--temperature", str(config.eval.temperature), "--max-tokens-per-turn", str(r.max_tokens_per_turn),
               "--max-context-tokens", str(r.max_context_tokens), "--seed", str(config.run.seed),
               "--samples", str(config.eval.samples_per_task), "--dtype", r.engine.dtype,
               "--kv-cache-gib", str(r.engine.kv_cache_gib_or_default), "--json", str(result_json)]
    if r.system_prompt is not None:
        command += ["--system-prompt", r.system_prompt]
    return command


def evaluate(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides)
    out_dir = Path(args.out)
    saved = [r for r in read_jsonl(out_dir / TIMELINE) if "checkpoint" in r]
    if args.steps:
        saved = [r for r in saved if r["step"] in set(args.steps)]
    if not saved:
        print(f"error: no saved step_N in {out_dir / TIMELINE}", file=sys.stderr)
        return 2
    done = {(h["step"], h["episodes_requested"]) for h in read_jsonl(out_dir / HELDOUT)}
    for record in saved:
        episodes = args.episodes or config.eval.episodes
        if (record["step"], episodes) in done:
            continue
        checkpoint = (out_dir / record["checkpoint"]).resolve()
        result_json = checkpoint / f"heldout_{episodes}.json"
        command = eval_command(config, checkpoint, episodes, result_json)
        print(f"[peer-trl] step {record['step']}: {' '.join(command)}", flush=True)
        subprocess.run(command, check=True, cwd=REPO, stdout=subprocess.DEVNULL if args.quiet else None)
        result = json.loads(result_json.read_text())
        line = {"step": record["step"], "wall_s": record["wall_s"], "script_wall_s": record["script_wall_s"],
                "episodes_requested": episodes, "episodes_valid": result["episodes_valid"],
                "success_rate": result["success_rate"], "by_level": result["by_category"],
                "infra_failures": result["infra_failures"], "command": command}
        with open(out_dir / HELDOUT, "a") as f:
            f.write(json.dumps(line) + "\n")
        print(f"[peer-trl] step {line['step']} ({line['wall_s'] / 60:.1f} min): held-out success "
              f"{line['success_rate']:.3f} over {line['episodes_valid']} episodes", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="TRL's GRPO under a wall-clock budget, step_N checkpoints and a timeline")
    t.add_argument("--out", required=True, help="run directory (new): step_N/, timeline.jsonl, summary.json")
    t.add_argument("--config", type=Path, default=CONFIG, help="the horizonrl config whose settings are mapped")
    t.add_argument("--model", default=None, help="the format-warmed checkpoint (default: the config's model.path)")
    t.add_argument("--budget-min", type=float, default=None, help="stop at the first step past this many minutes")
    t.add_argument("--max-steps", type=int, default=None, help="stop after this many optimizer steps")
    t.add_argument("--save-every", type=int, default=5, help="save step_N every N steps (and at the last)")
    t.add_argument("--gradient-checkpointing", action="store_true",
                   help="TRL's default; off by default as horizonrl's learner.activation_checkpointing")
    t.add_argument("--torch-threads", type=int, default=None,
                   help="torch's intra-op threads (default: torch's own, one per core: what a TRL user gets)")
    t.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override (repeatable), e.g. rollout.n=2 for a quick check of the mechanics")
    t.set_defaults(func=train)
    e = sub.add_parser("evaluate", help="horizonrl eval on every step_N of a run -> heldout.jsonl")
    e.add_argument("--out", required=True, help="the run directory of `train`")
    e.add_argument("--config", type=Path, default=CONFIG)
    e.add_argument("--episodes", type=int, default=None, help="held-out episodes (default: the config's eval.episodes)")
    e.add_argument("--steps", type=int, nargs="*", default=None, help="only these steps")
    e.add_argument("--quiet", action="store_true", help="leave out horizonrl eval's table")
    e.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override (repeatable), as given to train")
    e.set_defaults(func=evaluate)
    args = parser.parse_args(argv)
    if args.command == "train" and args.budget_min is None and args.max_steps is None:
        parser.error("train needs --budget-min or --max-steps")
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
