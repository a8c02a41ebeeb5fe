"""The tables (and a held-out chart) of the ScalingInter-RL study that scripts/scaling_inter_study.sh runs.

    python scripts/scaling_inter_table.py OUT_DIR [--chart PATH]

Reads OUT_DIR/<arm>-s<seed>/ (the training runs' TensorBoard events and resolved config.yaml) and
OUT_DIR/eval-<name>-T<turns>.json (`horizonrl eval` results; eval-start-* is the starting model) and prints, as
markdown (either study, the tiny model's or SmolLM2's; each arm is named by the turn budgets its runs
trained with):

- one row per run: held-out success (test-split episodes) before -> after at each evaluated budget, the
  periodic held-out success during training (eval.every, at the long budget; none where eval.every is 0), the
  actors' own success (at the budget they played with) over the first and last three learner steps, learner steps,
  generated tokens (rollout/generated_tokens_total: every episode the actors played, trained on or not), the
  episodes played and how many of them the buffer dropped (as groups of equal rewards, which carry no signal,
  and as too stale),
  the share of turns whose reply named no valid action, and wall time;
- one row per arm: the mean over its seeds and the range.

--chart PATH also draws the periodic held-out success of every run against the learner step and against
generated tokens, a colour per arm and a line style per seed.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from statistics import mean

from horizonrl.apps.report import read_run

ARMS = {"fixed_short": "fixed short", "fixed_long": "fixed long", "scaling": "stepwise"}
COLOURS = {"fixed_short": "C0", "fixed_long": "C3", "scaling": "C2"}


def evals(out: Path, name: str) -> dict[int, float]:
    found = {}
    for path in out.glob(f"eval-{name}-T*.json"):
        turns = int(re.search(r"-T(\d+)\.json$", path.name).group(1))
        found[turns] = json.loads(path.read_text())["success_rate"]
    return dict(sorted(found.items(), reverse=True))


def tokens_text(tokens: float) -> str:
    return f"{tokens / 1e6:.2f} M" if tokens >= 1e6 else f"{tokens / 1e3:.0f} k"


def eval_episodes(out: Path) -> int:
    """Episodes per held-out evaluation (the starting model's; every evaluation of a study uses the same)."""
    return max((json.loads(p.read_text())["episodes"] for p in out.glob("eval-start-T*.json")), default=0)


def arm_label(arm: str, run_dir: Path) -> str:
    """The arm's name with the turn budgets its run trained with, from the run's resolved config."""
    import yaml

    rounds = yaml.safe_load((run_dir / "config.yaml").read_text())["algorithm"]["rounds_ctrl"]["rounds"]
    return f"{ARMS[arm]} ({'→'.join(str(r) for r in rounds)})"


def runs(out: Path) -> list[dict]:
    rows = []
    for arm in ARMS:
        for run_dir in sorted(out.glob(f"{arm}-s*")):
            if not run_dir.is_dir():
                continue
            curves = read_run(run_dir)
            last = lambda tag: curves.scalars[tag][-1][1] if curves.scalars.get(tag) else float("nan")  # noqa: E731
            rows.append({
                "arm": arm, "label": arm_label(arm, run_dir), "seed": int(run_dir.name.rsplit("-s", 1)[1]),
                "dir": run_dir,
                "steps": curves.steps,
                "tokens": last("rollout/generated_tokens_total"),
                "tokens_by_step": dict(curves.scalars.get("rollout/generated_tokens_total", [])),
                "invalid": last("rollout/agent/invalid_action_rate"),
                "episodes": last("rollout/episodes_total"),
                "dropped_equal": last("buffer/dropped_equal_rewards"),
                "dropped_stale": last("buffer/dropped_stale"),
                "wall_s": curves.wall_s or float("nan"),
                "held_out": curves.scalars.get("eval/success_rate", []),
                "rollout_success": [v for _, v in curves.scalars.get("rollout/success_rate", [])],
                "final": evals(out, run_dir.name),
            })
    return rows


def table(out: Path, rows: list[dict]) -> str:
    start = evals(out, "start")
    budgets = list(start) or sorted({t for r in rows for t in r["final"]}, reverse=True)
    long = max(budgets, default=0)
    episodes = eval_episodes(out)
    head = (["arm", "seed"] + [f"held-out @{t} turns ({episodes} ep.)" for t in budgets]
            + [f"held-out during training @{long}", "actors' success, first → last 3 steps", "learner steps",
               "generated tokens", "episodes played (dropped: equal rewards / stale)", "invalid replies",
               "wall time"])
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        cells = [r["label"], str(r["seed"])]
        cells += [f"{start.get(t, float('nan')):.3f} → **{r['final'].get(t, float('nan')):.3f}**" for t in budgets]
        cells.append(" ".join(f"{v:.2f}" for _, v in r["held_out"]) or "—")
        played = r["rollout_success"]
        cells.append(f"{mean(played[:3]):.2f} → {mean(played[-3:]):.2f}" if played else "—")
        cells += [str(r["steps"]), tokens_text(r["tokens"]),
                  f"{r['episodes']:.0f} ({r['dropped_equal']:.0f} / {r['dropped_stale']:.0f})",
                  f"{r['invalid']:.2f}", f"{r['wall_s'] / 60:.1f} min"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| arm | seeds | " + " | ".join(f"after @{t} turns: mean (range)" for t in budgets)
              + " | generated tokens: mean | wall time: mean |", "|" + " --- |" * (4 + len(budgets))]
    for arm in ARMS:
        mine = [r for r in rows if r["arm"] == arm]
        if not mine:
            continue
        cells = [mine[0]["label"], str(len(mine))]
        for t in budgets:
            values = [r["final"][t] for r in mine if t in r["final"]]
            cells.append(f"{sum(values) / len(values):.3f} ({min(values):.3f}–{max(values):.3f})" if values else "—")
        cells.append(tokens_text(sum(r["tokens"] for r in mine) / len(mine)))
        cells.append(f"{sum(r['wall_s'] for r in mine) / len(mine) / 60:.1f} min")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def chart(rows: list[dict], path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 3.4), layout="constrained")
    by_step, by_tokens = fig.subplots(1, 2)
    styles = ["-", "--", ":", "-."]
    for r in rows:
        if not r["held_out"]:
            continue
        steps = [s for s, _ in r["held_out"]]
        values = [v for _, v in r["held_out"]]
        tokens = [r["tokens_by_step"].get(s, 0.0) / 1e6 for s in steps]
        style = dict(color=COLOURS[r["arm"]], linestyle=styles[r["seed"] % len(styles)], marker="o", markersize=3)
        by_step.plot(steps, values, label=f"{r['label']}, seed {r['seed']}", **style)
        by_tokens.plot(tokens, values, **style)
    for ax, xlabel in ((by_step, "learner step"), (by_tokens, "generated tokens (millions)")):
        ax.set_xlabel(xlabel, fontsize=9)
        ax.set_ylabel("held-out success @8 turns", fontsize=9)
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=8)
    for boundary in (20, 40):
        by_step.axvline(boundary, color=COLOURS["scaling"], alpha=0.25, linewidth=0.8)
    fig.legend(*by_step.get_legend_handles_labels(), loc="outside right center", fontsize=8)
    fig.savefig(path, dpi=90)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--chart", type=Path, default=None)
    args = parser.parse_args()
    rows = runs(args.out_dir)
    print(table(args.out_dir, rows))
    if args.chart:
        chart(rows, args.chart)
        print(f"\nchart: {args.chart}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
