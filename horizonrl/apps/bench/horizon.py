"""Adaptive vs fixed groups in flight under a rising turn budget (docs/benchmarks.md, docs/horizon.md).

Two ``horizonrl train`` runs of ``configs/bench_rising_budget.yaml`` (budget 6 -> 13 -> 20, a KV cache that fits
the episodes in flight at 6 turns but not at 20), identical except ``rollout.concurrency.mode``: ``fixed``
(``rollout.groups_in_flight``) and ``adaptive`` (the actors' KV-cache band, actors/concurrency.py), run back to
back in alternating order per repeat. From each run's TensorBoard scalars, per budget stage and overall: the
engine's preemptions, generated tokens/s, learner steps/min, the learner's idle share (waiting for a batch), the
groups in flight and the KV-cache use at the stage's steps.

    python -m horizonrl.apps.bench.horizon --out runs/bench-horizon [--repeats 1] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

from horizonrl.apps.bench.report import alternate, progress
from horizonrl.apps.bench.training import REPO, read_scalars, run_training, train_command

CONFIG = REPO / "configs" / "bench_rising_budget.yaml"
MODES = ("fixed", "adaptive")


def stage_bounds(rounds: list[int], steps_per_stage: int, total: int) -> list[tuple[str, int, int]]:
    """(label, first, last) learner steps of each budget stage: the clock from ``first`` to ``last``, both completed
    (the first stage's clock starts at step 1, after the start-up)."""
    out = []
    for k, budget in enumerate(rounds):
        first, last = max(1, k * steps_per_stage), min(total, (k + 1) * steps_per_stage)
        if last > first:
            out.append((f"budget {budget}", first, last))
    return out + [("overall", 1, total)]


def window(s: dict[str, dict[int, float]], first: int, last: int) -> dict[str, float]:
    """The stage's figures from a run's scalars (tag -> {step: value})."""
    def delta(tag: str) -> float:
        return s[tag][last] - s[tag][first] if tag in s else float("nan")

    def mean(tag: str) -> float:
        values = [s[tag][k] for k in range(first + 1, last + 1) if k in s.get(tag, {})]
        return sum(values) / len(values) if values else float("nan")

    wall = delta("time/elapsed_s")
    return {
        "preemptions": delta("rollout/engine_preemptions"),
        "tokens_per_s": delta("rollout/generated_tokens_total") / wall,
        "steps_per_min": (last - first) / wall * 60,
        "learner_idle_share": sum(s["time/batch_wait_s"][k] for k in range(first + 1, last + 1)) / wall,
        "groups_in_flight": mean("rollout/groups_in_flight"),
        "kv_cache_usage": mean("rollout/kv_cache_usage"),
        "turns_mean": mean("batch/turns_mean"),
        "window_s": wall,
    }


def run(out_dir: Path, *, model: str | None, repeats: int, extra: list[str]) -> dict:
    from horizonrl.apps.bench.rollout import tiny_model
    from horizonrl.core.config import load_config

    model = tiny_model(model)
    cfg = load_config(CONFIG, [f"model.path={model}", *extra])
    rc = cfg.algorithm.rounds_ctrl
    steps = cfg.learner.total_steps
    stages = stage_bounds(rc.rounds, rc.steps_scaling_inter, steps)
    results: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for r in range(repeats):
        for mode in alternate(r, list(MODES)):
            run_dir = out_dir / f"{mode}-{r}"
            progress("horizon", f"repeat {r + 1}/{repeats}: {mode}, {steps} learner steps ({run_dir})")
            started = time.perf_counter()
            shutil.rmtree(run_dir, ignore_errors=True)
            run_dir.mkdir(parents=True, exist_ok=True)
            run_training(train_command(CONFIG, model, run_dir, steps, [*extra, f"rollout.concurrency.mode={mode}"]),
                         out_dir / f"{mode}-{r}.log")
            s = read_scalars(run_dir)
            results[mode].append({label: window(s, a, b) for label, a, b in stages})
            progress("horizon", f"  {mode}: done in {time.perf_counter() - started:.0f} s with start-up")
    return {"config": str(CONFIG.relative_to(REPO)), "model": model, "steps": steps, "repeats": repeats,
            "overrides": extra, "stages": [label for label, _, _ in stages], "results": results}


COLUMNS = (("preemptions", "{:.0f}"), ("tokens_per_s", "{:,.0f}"), ("steps_per_min", "{:.1f}"),
           ("learner_idle_share", "{:.1%}"), ("groups_in_flight", "{:.1f}"), ("kv_cache_usage", "{:.0%}"),
           ("turns_mean", "{:.1f}"))


def table(result: dict) -> str:
    """A markdown table: one row per stage, each cell "fixed / adaptive" (medians over repeats)."""
    head = ["stage (fixed / adaptive)"] + [name for name, _ in COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for stage in result["stages"]:
        cells = [stage]
        for name, fmt in COLUMNS:
            pair = []
            for mode in MODES:
                values = [rep[stage][name] for rep in result["results"][mode]]
                pair.append(fmt.format(statistics.median(values)) if values else "-")
            cells.append(" / ".join(pair))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench-horizon"),
                        help="where the runs and results.json go")
    parser.add_argument("--repeats", type=int, default=1, help="runs per mode; the table shows medians")
    parser.add_argument("--model", default=None, help="a model directory (default: the tiny model, built once)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override")
    parser.add_argument("--report", action="store_true", help="print the table of --out's results.json only")
    args = parser.parse_args()
    path = args.out / "results.json"
    if args.report:
        result = json.loads(path.read_text())
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        result = run(args.out, model=args.model, repeats=args.repeats, extra=args.set)
        path.write_text(json.dumps(result, indent=1))
    print(table(result))


if __name__ == "__main__":
    main()
