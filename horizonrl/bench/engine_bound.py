"""Part 3 — engine-bound ratio: how close asynchronous training comes to the bare engines.

numerator:   generated tokens/s over all actors during an async training run (part 2's
             ``async`` runs; measured here with one short run if part 2 was not run);
denominator: generated tokens/s of the same number of bare engines, same model, same
             sampling, same requests in flight, on replayed multi-turn Signpost prompts of the
             same turn budget — no environment, no learner, no weight sync.

The ratio is the share of the rollout side's physical limit that training keeps. The bare
engines have the whole machine; during training they share it with the learner, so on a
machine with fewer cores than processes the ratio also measures CPU contention.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from horizonrl.bench.report import make_result, progress, summarize
from horizonrl.bench.rollout import BareSpec


def bare_spec(quick: bool, model: str) -> BareSpec:
    """The bare engines that match the training part's run: engines, requests in flight, turn budget."""
    from horizonrl.bench import training
    from horizonrl.core.config import load_config
    from horizonrl.core.schedule import TurnBudgetSchedule

    cfg = load_config(training.CONFIG, [f"model.path={model}"])
    per_engine = training.groups_per_actor(cfg) * cfg.rollout.n
    return BareSpec(num_engines=cfg.rollout.num_actors, concurrency=per_engine, env_settings=dict(cfg.envs[0].settings),
                    max_turns=TurnBudgetSchedule.from_config(cfg.algorithm.rounds_ctrl).final_max_turns,
                    episodes=64 if quick else 192, repeats=2 if quick else 3)


def run(quick: bool, out_dir: Path, *, model: str | None = None, training_result: dict | None = None,
        rollout_result: dict | None = None) -> dict:
    """Part 3. Reuses part 2's async runs and part 1's bare-engine measurement when they ran."""
    from horizonrl.bench.rollout import bare_engine_tokens_per_s, tiny_model

    model = tiny_model(model)
    spec = bare_spec(quick, model)
    if training_result is None:
        progress("engine", "no training part in this run: one short async training run for the numerator")
        training_result = _single_mode_training(quick, out_dir, model)
    per_run = next(row for row in training_result["rows"] if row["label"] == "async")["tokens_per_s"]
    if rollout_result is not None and "bare_engines" in rollout_result:
        bare = rollout_result["bare_engines"]["tokens_per_s"]
    else:
        bare = bare_engine_tokens_per_s(model, spec)
    bare_summary = summarize(bare)
    # Each training run's tokens/s over the bare engines' median (the runs cannot be paired).
    ratio = {key: per_run[key] / bare_summary["median"] for key in ("median", "min", "max")} | {"n": per_run["n"]}
    rows = [{"label": "async training / engines", "tokens_per_s": per_run},
            {"label": "bare engines", "tokens_per_s": bare_summary}]
    settings = {"model": model, **spec.__dict__}
    return make_result("engine", rows, {"async training / bare engines tokens/s": ratio}, settings,
                       chart={"metric": "tokens_per_s", "ylabel": "generated tokens/s"})


def _single_mode_training(quick: bool, out_dir: Path, model: str) -> dict:
    from horizonrl.bench import training
    from horizonrl.core.config import load_config

    steps, warmup = (9, 2) if quick else (30, 4)
    cfg = load_config(training.CONFIG, [f"model.path={model}"])
    run_dir = out_dir / "engine" / "async-training"
    shutil.rmtree(run_dir, ignore_errors=True)  # a previous benchmark's run: this one starts fresh
    run_dir.mkdir(parents=True, exist_ok=True)
    training.run_training(training.train_command(training.CONFIG, model, run_dir, steps,
                                                 [f"rollout.groups_in_flight={training.groups_per_actor(cfg)}"]),
                          run_dir.parent / "async-training.log")
    m = training.window_metrics(training.read_scalars(run_dir), warmup, steps, cfg.rollout.num_actors)
    return {"rows": [{"label": "async", "tokens_per_s": summarize([m["tokens_per_s"]])}]}
