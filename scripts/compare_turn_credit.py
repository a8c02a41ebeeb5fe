"""Outcome-only GRPO against turn-level GiGPO on a long-horizon task, through the real asynchronous loop — or any
other arms, each a set of overrides (``--arm NAME=KEY=VALUE,KEY=VALUE``, repeated; e.g. the context policies).

For each seed, for each arm (interleaved, so a cut-short comparison still has both arms of the
seeds it finished): a full ``horizonrl train`` run of the config with the arm's overrides
(``algorithm.adv_estimator`` for ``--estimators``) and ``run.seed`` set, then the last checkpoint's held-out
success (``eval.episodes`` test-split tasks, a fresh engine) against the starting policy's on the same tasks and
seed. From the run's TensorBoard it also
reads the held-out evaluations during training (``eval/success_rate``, every ``eval.every`` steps) and the
actors' own success per learner step (``rollout/success_rate``), and reports the first learner step at
which each reaches ``--threshold`` (the rollout curve as a running mean over ``--smooth`` steps).

    python scripts/compare_turn_credit.py --config configs/signpost_long.yaml --model .cache/tiny-signpost \
        --seeds 0,1 --steps 40 --threshold 0.3 --out runs/turn-credit
    python scripts/compare_turn_credit.py --arm cut=rollout.context.policy=cut \
        --arm window=rollout.context.policy=window --out runs/context-policy rollout.max_context_tokens=128

Also read from TensorBoard per run: the tokens generated per second of training, and the episodes that ended at
the context or went on in context windows.

Appends one JSON line per run to ``<out>/runs.jsonl`` (a rerun skips what the file already holds) and
writes the markdown table to ``<out>/table.md``.
"""

from __future__ import annotations

import argparse
import glob
import json
import shutil
import time
from pathlib import Path


def scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every TensorBoard scalar of the run: tag -> (step, value) in step order. The event files are read once."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    points: dict[str, dict[int, float]] = {}
    for path in sorted(glob.glob(str(run_dir / "tensorboard" / "events.*"))):
        acc = EventAccumulator(path, size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            points.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return {tag: sorted(values.items()) for tag, values in points.items()}


def first_step_at(points: list[tuple[int, float]], threshold: float, smooth: int = 1) -> int | None:
    """The first step whose value (the mean of it and the ``smooth`` − 1 before it) is ≥ threshold."""
    for i in range(len(points)):
        window = [v for _, v in points[max(0, i - smooth + 1):i + 1]]
        if sum(window) / len(window) >= threshold:
            return points[i][0]
    return None


def parse_arm(text: str) -> tuple[str, list[str]]:
    """``NAME=KEY=VALUE,KEY=VALUE`` -> (NAME, [KEY=VALUE, ...])."""
    name, sep, overrides = text.partition("=")
    if not sep or not name or "=" not in overrides:
        raise argparse.ArgumentTypeError(f"--arm {text!r}: expected NAME=KEY=VALUE[,KEY=VALUE...]")
    return name, overrides.split(",")


def arm_of(row: dict) -> str:
    return row.get("arm", row.get("estimator", "?"))  # rows written before arms were named by their estimator


def last_value(series: dict[str, list[tuple[int, float]]], tag: str) -> float:
    points = series.get(tag, [])
    return points[-1][1] if points else 0.0


def one_run(args, common: list[str], arm: str, overrides: list[str], seed: int) -> dict:
    from horizonrl.apps.demo import held_out_success
    from horizonrl.core.config import load_config
    from horizonrl.core.run_dirs import latest_checkpoint
    from horizonrl.launcher import launch

    run_dir = args.out / f"{arm}-s{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)  # an interrupted run of this arm starts again from scratch
    config = load_config(args.config, [*common, *overrides, f"run.seed={seed}", f"run.output_dir={run_dir}"])
    env = config.envs[0].name
    start = time.perf_counter()
    rc = launch(config)
    wall = time.perf_counter() - start
    row = {"arm": arm, "overrides": overrides, "seed": seed, "exit_code": rc, "train_wall_s": round(wall)}
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is None:
        return row
    series = scalars(run_dir)
    held_out, rollout = series.get("eval/success_rate", []), series.get("rollout/success_rate", [])
    row |= {
        "learner_steps": int(checkpoint.name.rsplit("_", 1)[-1]),
        "held_out_during": [[s, round(v, 3)] for s, v in held_out],
        "rollout_first5": round(sum(v for _, v in rollout[:5]) / max(1, len(rollout[:5])), 3),
        "rollout_last5": round(sum(v for _, v in rollout[-5:]) / max(1, len(rollout[-5:])), 3),
        "steps_to_threshold_held_out": first_step_at(held_out, args.threshold),
        "steps_to_threshold_rollout": first_step_at(rollout, args.threshold, args.smooth),
        "generated_tokens_per_s": round(last_value(series, "rollout/generated_tokens_total") / wall, 1),
        "episodes": last_value(series, "rollout/episodes_total"),
        "stop_context_limit": last_value(series, "rollout/stop/context_limit"),
        "context_windows": last_value(series, "rollout/context_windows"),
        "held_out_after": held_out_success(str(checkpoint), config)[env]["success_rate"],
    }
    return row


def progress(row: dict, out: Path) -> dict:
    """The row plus the mean episode return (Signpost: the share of crossroads passed) of the held-out
    evaluations during training and of the actors' episodes, first and last 5 steps, read from TensorBoard."""
    run_dir = out / f"{arm_of(row)}-s{row['seed']}"
    series = scalars(run_dir)
    rollout = [v for _, v in series.get("rollout/reward_mean", [])]
    held_out = series.get("eval/signpost/mean_reward", [])
    return row | {"held_out_return_during": [[s, round(v, 3)] for s, v in held_out],
                  "rollout_return_first5": round(sum(rollout[:5]) / max(1, len(rollout[:5])), 3),
                  "rollout_return_last5": round(sum(rollout[-5:]) / max(1, len(rollout[-5:])), 3)}


def table(rows: list[dict], before: dict[int, float], threshold: float) -> str:
    lines = ["| arm | seed | held-out before → after | held-out during training (step: success) | "
             f"first step ≥ {threshold} (held-out / rollout) | rollout success first → last 5 steps | "
             "learner steps | training wall |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in sorted(rows, key=lambda r: (arm_of(r), r["seed"])):
        if "held_out_after" not in r:
            lines.append(f"| {arm_of(r)} | {r['seed']} | failed (exit {r['exit_code']}) | | | | | |")
            continue
        during = " ".join(f"{s}: {v:.2f}" for s, v in r["held_out_during"])
        reach = " / ".join("not reached" if r[key] is None else str(r[key])
                           for key in ("steps_to_threshold_held_out", "steps_to_threshold_rollout"))
        lines.append(f"| {arm_of(r)} | {r['seed']} | {before.get(r['seed'], float('nan')):.3f} → "
                     f"**{r['held_out_after']:.3f}** | {during} | {reach} | {r['rollout_first5']:.2f} → "
                     f"{r['rollout_last5']:.2f} | {r['learner_steps']} | {r['train_wall_s'] / 60:.1f} min |")
    if any("held_out_return_during" in r for r in rows):
        lines += ["", "| arm | seed | held-out return during training (step: return) | "
                  "rollout return first → last 5 steps |", "| --- | --- | --- | --- |"]
        for r in sorted(rows, key=lambda r: (arm_of(r), r["seed"])):
            if "held_out_return_during" in r:
                during = " ".join(f"{s}: {v:.2f}" for s, v in r["held_out_return_during"])
                lines.append(f"| {arm_of(r)} | {r['seed']} | {during} | {r['rollout_return_first5']:.2f} → "
                             f"{r['rollout_return_last5']:.2f} |")
    if any("generated_tokens_per_s" in r for r in rows):
        lines += ["", "| arm | seed | generated tokens/s | episodes | ended at the context | context windows |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for r in sorted(rows, key=lambda r: (arm_of(r), r["seed"])):
            if "generated_tokens_per_s" in r:
                lines.append(f"| {arm_of(r)} | {r['seed']} | {r['generated_tokens_per_s']:.0f} | {r['episodes']:.0f} | "
                             f"{r['stop_context_limit']:.0f} | {r['context_windows']:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    from horizonrl.apps.demo import held_out_success
    from horizonrl.core.config import load_config

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=Path("configs/signpost_long.yaml"))
    p.add_argument("--model", default=".cache/tiny-signpost")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--estimators", default="grpo,gigpo", help="one arm per estimator (unless --arm is given)")
    p.add_argument("--arm", type=parse_arm, action="append", default=[],
                   help="an arm: NAME=KEY=VALUE[,KEY=VALUE...] (repeat; replaces --estimators)")
    p.add_argument("--threshold", type=float, default=0.3)
    p.add_argument("--smooth", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path("runs/turn-credit"))
    p.add_argument("--report-only", action="store_true", help="train nothing: the table of the finished runs, "
                   "with the mean returns read from their TensorBoard")
    p.add_argument("overrides", nargs="*", help="extra dotted overrides for every run")
    args = p.parse_args()

    args.out.mkdir(parents=True, exist_ok=True)
    jsonl = args.out / "runs.jsonl"
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()] if jsonl.exists() else []
    common = [f"model.path={args.model}", f"learner.total_steps={args.steps}", *args.overrides]
    seeds = [int(s) for s in args.seeds.split(",")]
    arms = dict(args.arm) or {e: [f"algorithm.adv_estimator={e}"] for e in args.estimators.split(",")}
    before_path = args.out / "before.json"
    before = {int(k): v for k, v in json.loads(before_path.read_text()).items()} if before_path.exists() else {}
    if args.report_only:
        report = table([progress(r, args.out) if "held_out_after" in r else r for r in rows], before, args.threshold)
        (args.out / "table.md").write_text(report)
        print(report, flush=True)
        return 0
    for seed in seeds:
        if seed not in before:  # the starting policy on the same tasks with the same sampling seed
            config = load_config(args.config, [*common, f"run.seed={seed}"])
            before[seed] = held_out_success(args.model, config)[config.envs[0].name]["success_rate"]
            before_path.write_text(json.dumps(before) + "\n")
        for arm, overrides in arms.items():
            if any(arm_of(r) == arm and r["seed"] == seed for r in rows):
                continue
            row = one_run(args, common, arm, overrides, seed)
            rows.append(row)
            with open(jsonl, "a") as out:
                out.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)
            (args.out / "table.md").write_text(table(rows, before, args.threshold))
    print(table(rows, before, args.threshold), flush=True)
    return 0 if all(r["exit_code"] == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
