"""``horizonrl demo``: the main job on the CPU with the tiny model.

1. build (or reuse) the tiny model, format-warmed on random-policy episodes;
2. held-out success of the starting policy;
3. a full asynchronous training run (coordinator, buffer, learner, actors);
4. held-out success of the final checkpoint, loaded in vLLM (the evaluation engine)
   and in transformers (a forward pass), and a summary in ``<output_dir>/demo_summary.json``.

The console shows the demo's own lines and the training run's status block; what the evaluation
engines write goes to ``<output_dir>/logs/eval-before.log`` and ``eval-after.log`` (``--verbose``:
to the console too, with every line of the training run).
"""

from __future__ import annotations

import json
import shutil
import time
from contextlib import nullcontext
from pathlib import Path

from horizonrl.core.config import TinyModelRecipe, TrainConfig, load_config
from horizonrl.launcher.console import output_to_file
from horizonrl.core.run_dirs import latest_checkpoint

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"
# The default recipe (model.tiny), which the integration tests use too: 1,500 random-policy episodes,
# 200 warm-up steps.
TINY_MODEL_RECIPE = TinyModelRecipe().model_dump()


def held_out_specs(config: TrainConfig, episodes: int | None = None) -> list:
    """The before/after evaluation of each environment: ``eval.episodes`` test tasks (or ``episodes``),
    ``eval.samples_per_task`` each, sampled as in training (its system prompt, token limits)."""
    from horizonrl.actors.evaluate import EvalSpec

    return [EvalSpec.for_run(config, spec, episodes=episodes or config.eval.episodes,
                             samples=config.eval.samples_per_task) for spec in config.envs]


def held_out_success(model_path: str, config: TrainConfig) -> dict[str, dict]:
    from horizonrl.actors.evaluate import evaluate
    from horizonrl.envs import make_env

    return {spec.env: evaluate(model_path, spec, make_env, config.rollout.engine) for spec in held_out_specs(config)}


def check_transformers_load(path: Path) -> int:
    """Load the checkpoint with transformers and run one forward pass; returns the parameter count."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits
    if not torch.isfinite(logits).all():
        raise RuntimeError(f"checkpoint {path} produces non-finite logits")
    return sum(p.numel() for p in model.parameters())


def run_demo(config_path: Path | None, overrides: list[str], *, tensorboard: bool = False,
             verbose: bool = False) -> int:
    from horizonrl.launcher import launch
    from horizonrl.apps.tiny_model import ensure_tiny_model

    started = time.perf_counter()
    config = load_config(config_path or DEFAULT_CONFIG, overrides)
    if config.output_dir.exists() and config.learner.resume is None:
        print(f"[demo] replacing the previous demo run in {config.output_dir}", flush=True)
        shutil.rmtree(config.output_dir)
    model_dir = Path(config.model.path)
    if config.model.pretrained is not None:
        from horizonrl.apps.warmup_data import ensure_pretrained

        recipe = config.model.pretrained
        print(f"[demo] {recipe.packaged} in {model_dir}" + (
            f" (imported and format-warmed: {recipe.format_warmup.steps} SFT steps on random-policy episodes; "
            "built once, then reused)" if recipe.format_warmup else " (imported once, then reused)"), flush=True)
        build_in_child(ensure_pretrained, config)
    else:
        print(f"[demo] tiny model in {model_dir} (built once, then reused)", flush=True)
        ensure_tiny_model(model_dir, envs=tuple(s.name for s in config.envs),
                          env_settings={s.name: dict(s.settings) for s in config.envs},
                          **config.model.tiny.model_dump())

    print(f"[demo] held-out success of the starting policy ({config.eval.episodes} episodes per env)...", flush=True)
    with _quiet_unless(verbose, config.output_dir / "logs" / "eval-before.log"):
        before = held_out_success(str(model_dir), config)
    _print_eval("before", before)

    train_start = time.perf_counter()
    rc = launch(config, tensorboard=tensorboard, verbose=verbose)
    train_s = time.perf_counter() - train_start
    if rc != 0:
        print(f"[demo] training failed (exit code {rc}); logs in {config.output_dir / 'logs'}", flush=True)
        return rc
    checkpoint = latest_checkpoint(config.output_dir)
    if checkpoint is None:
        print("[demo] training finished but saved no checkpoint", flush=True)
        return 1
    last_step = int(checkpoint.name.rsplit("_", 1)[-1])
    if last_step < config.learner.total_steps:
        why = (f": held-out success had stopped rising (eval.stop_after_plateau={config.eval.stop_after_plateau})"
               if config.eval.stop_after_plateau else "")
        print(f"[demo] training ended at step {last_step} of {config.learner.total_steps}{why}", flush=True)
    with _quiet_unless(verbose, config.output_dir / "logs" / "eval-after.log"):
        params = check_transformers_load(checkpoint)
    print(f"[demo] {checkpoint} loads in transformers ({params:,} parameters); evaluating it in vLLM...", flush=True)
    with _quiet_unless(verbose, config.output_dir / "logs" / "eval-after.log"):
        after = held_out_success(str(checkpoint), config)
    _print_eval("after", after)

    summary = {
        "config": str(config.output_dir / "config.yaml"),
        "checkpoint": str(checkpoint),
        "learner_steps": last_step,
        "train_wall_s": round(train_s, 1),
        "total_wall_s": round(time.perf_counter() - started, 1),
        "before": before,
        "after": after,
    }
    (config.output_dir / "demo_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print("\n[demo] held-out success rate (test split):")
    print(before_after_table(before, after))
    print(f"[demo] training took {train_s / 60:.1f} min; TensorBoard: tensorboard --logdir "
          f"{config.output_dir / 'tensorboard'}; summary: {config.output_dir / 'demo_summary.json'}")
    return 0


# A SmolLM2 import and format warm-up takes 15-30 minutes on 2 cores; a build still running after this is stuck.
BUILD_TIMEOUT_S = 4 * 3600.0


def build_in_child(build, *args, timeout_s: float = BUILD_TIMEOUT_S) -> None:
    """``build(*args)`` in a child process, so that what building takes goes back to the system before training
    starts. A format warm-up of SmolLM2 in this process left ~10 GB here (the model, its optimizer and
    activations, kept by the allocator) beside the run's own learner and engine, and the kernel's OOM killer
    ended the demo on a 24 GiB machine."""
    import multiprocessing

    child = multiprocessing.get_context("spawn").Process(target=build, args=args, name="demo-model-build")
    child.start()
    timed_out = False
    try:
        child.join(timeout_s)
        timed_out = child.is_alive()
    finally:
        if child.is_alive():  # timed out, or interrupted (Ctrl-C reaches the child too): do not leave it behind
            child.terminate()
            child.join(30)
    if timed_out:
        raise TimeoutError(f"building the model took over {timeout_s:.0f} s; stopped it (pid {child.pid})")
    if child.exitcode != 0:
        raise RuntimeError(f"building the model failed (exit code {child.exitcode}): the error is above")


def before_after_table(before: dict[str, dict], after: dict[str, dict]) -> str:
    """One row per environment, and one per category (BabyAI level, TextCraft depth, ...) under an
    environment that has several: held-out success before -> after, and the episodes counted."""
    rows = []
    for name in before:
        rows.append((name, before[name]["success_rate"], after[name]["success_rate"], after[name]["episodes_valid"]))
        categories = before[name].get("categories", {})
        if len(categories) > 1:
            for category, b in categories.items():
                a = after[name].get("categories", {}).get(category)
                if a is not None:
                    rows.append((f"  {category}", b["success_rate"], a["success_rate"], a["episodes_valid"]))
    width = max(len(r[0]) for r in rows)
    lines = [f"  {'':{width}}  before  ->  after  (episodes)"]
    lines += [f"  {label:{width}}    {b:.2f}  ->   {a:.2f}  ({n:.0f})" for label, b, a, n in rows]
    return "\n".join(lines)


def _quiet_unless(verbose: bool, log_path: Path):
    """An evaluation's output (its vLLM engine's log lines, transformers' progress bars) into ``log_path``,
    unless ``verbose``."""
    return nullcontext() if verbose else output_to_file(log_path)


def _print_eval(label: str, results: dict[str, dict]) -> None:
    for name, r in results.items():
        print(f"[demo] {label}: {name} success {r['success_rate']:.2f} (mean turns {r['mean_turns']:.1f}, "
              f"{r['episodes']} episodes, {r['generated_tokens_per_s']:.0f} generated tokens/s)", flush=True)
