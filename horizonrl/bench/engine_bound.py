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

from pathlib import Path

from horizonrl.bench.report import make_result, progress, summarize


def run(quick: bool, out_dir: Path, *, model: str | None = None, training_result: dict | None = None) -> dict:
    from horizonrl.bench import training
    from horizonrl.bench.rollout import bare_engine_tokens_per_s, tiny_model
    from horizonrl.config import load_config
    from horizonrl.schedule import TurnBudgetSchedule

    model = tiny_model(model)
    if training_result is None:
        progress("engine", "no training part in this run: one short async training run for the numerator")
        training_result = _single_mode_training(quick, out_dir, model)
    async_row = next(row for row in training_result["rows"] if row["label"] == "async")
    per_run = async_row["tokens_per_s"]
    cfg = load_config(training.CONFIG, [f"model.path={model}"])
    per_actor = -(-cfg.learner.groups_per_step // cfg.rollout.num_actors) * cfg.rollout.n
    spec = cfg.envs[0]
    bare = bare_engine_tokens_per_s(model, num_engines=cfg.rollout.num_actors, concurrency=per_actor,
                                    env_settings=dict(spec.settings),
                                    max_turns=TurnBudgetSchedule.from_config(cfg.algorithm.rounds_ctrl).final_max_turns,
                                    episodes=64 if quick else 192, repeats=2 if quick else 3)
    bare_summary = summarize(bare)
    # Each training run's tokens/s over the bare engines' median (the runs cannot be paired).
    ratio = {key: per_run[key] / bare_summary["median"] for key in ("median", "min", "max")} | {"n": per_run["n"]}
    rows = [{"label": "async training / engines", "tokens_per_s": per_run},
            {"label": "bare engines", "tokens_per_s": bare_summary}]
    settings = {"model": model, "num_engines": cfg.rollout.num_actors, "requests_in_flight_per_engine": per_actor,
                "env": spec.name, "env_settings": dict(spec.settings)}
    return make_result("engine", rows, {"async training / bare engines tokens/s": ratio}, settings,
                       chart={"metric": "tokens_per_s", "ylabel": "generated tokens/s"})


def _single_mode_training(quick: bool, out_dir: Path, model: str) -> dict:
    from horizonrl.bench import training
    from horizonrl.config import load_config

    steps, warmup = (16, 4) if quick else (30, 4)
    cfg = load_config(training.CONFIG, [f"model.path={model}"])
    per_actor = -(-cfg.learner.groups_per_step // cfg.rollout.num_actors)
    run_dir = out_dir / "engine" / "async-training"
    run_dir.mkdir(parents=True, exist_ok=True)
    training.run_training(training.train_command(training.CONFIG, model, run_dir, steps,
                                                 [f"rollout.groups_in_flight={per_actor}"]),
                          run_dir.parent / "async-training.log")
    m = training.window_metrics(training.read_scalars(run_dir), warmup, steps, cfg.rollout.num_actors)
    return {"rows": [{"label": "async", "tokens_per_s": summarize([m["tokens_per_s"]])}]}
