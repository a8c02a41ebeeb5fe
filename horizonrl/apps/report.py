"""``horizonrl report RUN_DIR [RUN_DIR ...]``: the learning curves of one or several runs, read back
from their TensorBoard events, as one PNG and one markdown table.

Each run's scalars come from ``<run_dir>/tensorboard/events.*`` (or ``<run_dir>/events.*`` when
RUN_DIR is the TensorBoard directory itself), as the coordinator wrote them. The chart has one
panel per quantity (``QUANTITIES``) and one line per run, against the learner step; the table has
one row per run: learner steps, wall time, and each quantity's first → last value. A quantity a
run did not log (no periodic evaluation, no KL to a reference) shows as "—"; a directory without
events is an error.

A resumed run writes a new events file into the same directory: files are read oldest first and a
step logged again by a later file replaces the earlier value.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from horizonrl.core.run_dirs import RunDir

MISSING = "—"
HELD_OUT_TAG = "eval/success_rate"  # the periodic held-out evaluation (eval.every), all environments
HELD_OUT_ENV_PREFIX = "eval/"  # eval/<env>/success_rate, one per environment
KL_REF_TAG = "loss/kl_ref"
ELAPSED_TAG = "time/elapsed_s"  # seconds since the coordinator started, at each learner step
CHART_NAME = "learning.png"
TABLE_NAME = "learning.md"
SUMMARY_NAME = "learning.json"


class ReportError(ValueError):
    """A run directory that cannot be reported on; the message says which and why."""


@dataclass(frozen=True)
class Quantity:
    """One panel of the chart and one column of the table: the first of ``tags`` a run logged."""

    name: str
    tags: tuple[str, ...]
    description: str
    rate: bool = False  # a share of episodes: drawn on 0..1, so that runs and panels compare at a glance


QUANTITIES = (
    # rollout/reward_mean counts every episode the actors finished; batch/reward_mean only the groups the
    # buffer let through (equal-reward groups are dropped), so it is the fallback, not the first choice.
    Quantity("reward", ("rollout/reward_mean", "batch/reward_mean"), "mean episode reward"),
    Quantity("held-out success", (HELD_OUT_TAG,), "held-out success rate (test split, eval.every)", rate=True),
    Quantity("rollout success", ("rollout/success_rate",), "success rate of the actors' episodes", rate=True),
    Quantity("turns", ("batch/turns_mean",), "mean turns per trained episode"),
    Quantity("max-turn budget", ("schedule/max_turns",), "turn budget of the step (ScalingInter schedule)"),
    Quantity("entropy", ("loss/entropy",), "policy entropy per generated token"),
    Quantity("KL", ("loss/approx_kl",), "approx. KL between behaviour and updated policy"),
    Quantity("KL to reference", (KL_REF_TAG,), "KL to the frozen reference (learner.use_kl_loss)"),
)
# Quantities whose first → last in the table is a mean over the first / last --smooth points (noisy
# per-step values); held-out success and the budget are reported as logged.
SMOOTHED = {"reward", "rollout success", "turns", "entropy", "KL", "KL to reference"}


Series = list[tuple[int, float]]  # (learner step, value), by step


@dataclass
class RunCurves:
    label: str
    path: Path
    scalars: dict[str, Series]
    wall_s: float | None  # seconds the run took (summed over resumed segments), None if unknown

    def series(self, quantity: Quantity) -> tuple[str, Series] | None:
        """The (tag, points) of the first of the quantity's tags this run logged, or None."""
        for tag in quantity.tags:
            if self.scalars.get(tag):
                return tag, self.scalars[tag]
        return None

    @property
    def steps(self) -> int:
        return max((step for points in self.scalars.values() for step, _ in points), default=0)

    def held_out_envs(self) -> dict[str, Series]:
        """Per-environment held-out success: ``eval/<env>/success_rate``."""
        return {tag[len(HELD_OUT_ENV_PREFIX):-len("/success_rate")]: points for tag, points in self.scalars.items()
                if tag.startswith(HELD_OUT_ENV_PREFIX) and tag.endswith("/success_rate") and tag.count("/") == 2
                and points}


def event_files(run_dir: Path) -> list[Path]:
    """The run's TensorBoard event files, oldest first; ReportError if it has none."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir}: no such directory")
    for where in (RunDir(run_dir).tensorboard, run_dir):
        files = [f for f in where.glob("events.*") if f.is_file()] if where.is_dir() else []
        if files:
            return sorted(files, key=_written_at)
    raise ReportError(f"{run_dir}: no TensorBoard events (looked for {RunDir(run_dir).tensorboard / 'events.*'} and "
                      f"{run_dir / 'events.*'}); is it the output_dir of a `horizonrl train` run?")


def _written_at(path: Path) -> tuple[float, str]:
    # SummaryWriter names files events.out.tfevents.<unix time>.<host>.<pid>.<n>
    parts = path.name.split(".")
    try:
        return float(parts[3]), path.name
    except (IndexError, ValueError):
        return path.stat().st_mtime, path.name


def read_run(run_dir: Path, label: str | None = None) -> RunCurves:
    """Every scalar of one run, merged over its event files."""
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    scalars: dict[str, dict[int, float]] = {}
    wall_s, known = 0.0, False
    for path in event_files(run_dir):
        acc = EventAccumulator(str(path), size_guidance={SCALARS: 0})  # 0: keep every point, no reservoir sampling
        acc.Reload()
        stamps: list[float] = []
        elapsed = 0.0
        for tag in acc.Tags().get("scalars", []):
            for event in acc.Scalars(tag):
                scalars.setdefault(tag, {})[event.step] = event.value  # a later file's value wins
                stamps.append(event.wall_time)
                if tag == ELAPSED_TAG:
                    elapsed = max(elapsed, event.value)
        if elapsed:
            wall_s, known = wall_s + elapsed, True
        elif len(stamps) > 1:
            wall_s, known = wall_s + max(stamps) - min(stamps), True
    if not _uses_kl_loss(Path(run_dir)):
        # the learner logs loss/kl_ref as 0 when there is no reference model: not a measurement
        scalars.pop(KL_REF_TAG, None)
    return RunCurves(label or Path(run_dir).resolve().name, Path(run_dir),
                     {tag: sorted(points.items()) for tag, points in scalars.items()}, wall_s if known else None)


def _uses_kl_loss(run_dir: Path) -> bool:
    """``learner.use_kl_loss`` of the run's resolved config (``config.yaml``); True when unknown."""
    import yaml

    for path in (RunDir(run_dir).config, RunDir(run_dir.parent).config):
        if path.is_file():
            try:
                config = yaml.safe_load(path.read_text()) or {}
                return bool(config.get("learner", {}).get("use_kl_loss", False))
            except (yaml.YAMLError, AttributeError):
                return True
    return True


def read_runs(run_dirs: list[Path], labels: list[str] | None = None) -> list[RunCurves]:
    if labels and len(labels) != len(run_dirs):
        raise ReportError(f"{len(labels)} --label for {len(run_dirs)} run directories: give one per run, or none")
    names = labels or _default_labels(run_dirs)
    return [read_run(d, name) for d, name in zip(run_dirs, names)]


def _default_labels(run_dirs: list[Path]) -> list[str]:
    """Each run's directory name; the parent's name too where two runs would share a label."""
    names = [Path(d).resolve().name for d in run_dirs]
    return [f"{Path(d).resolve().parent.name}/{n}" if names.count(n) > 1 else n for d, n in zip(run_dirs, names)]


def smoothed(values: list[float], n: int) -> list[float]:
    """Trailing mean over the last ``n`` points (fewer at the start)."""
    n = max(1, n)
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= n:
            total -= values[i - n]
        out.append(total / min(i + 1, n))
    return out


def first_last(points: Series, n: int) -> tuple[float, float]:
    """Mean of the first ``n`` and of the last ``n`` values."""
    values = [v for _, v in points]
    n = max(1, min(n, len(values)))
    return sum(values[:n]) / n, sum(values[-n:]) / n


def summary(run: RunCurves, smooth: int = 1) -> dict:
    """The table's row of one run, as numbers (None: not logged)."""
    row: dict = {"run": run.label, "path": str(run.path), "steps": run.steps, "wall_s": run.wall_s, "tags": {}}
    for q in QUANTITIES:
        found = run.series(q)
        if found is None:
            row[q.name] = None
            continue
        tag, points = found
        first, last = first_last(points, smooth if q.name in SMOOTHED else 1)
        row[q.name] = {"first": first, "last": last, "first_step": points[0][0], "last_step": points[-1][0],
                       "points": len(points)}
        row["tags"][q.name] = tag
    row["held_out_by_env"] = {env: {"first": points[0][1], "last": points[-1][1], "first_step": points[0][0],
                                    "last_step": points[-1][0]} for env, points in sorted(run.held_out_envs().items())}
    return row


def fmt(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return MISSING
    if abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.3g}"


def fmt_change(cell: dict | None) -> str:
    return MISSING if cell is None else f"{fmt(cell['first'])} → {fmt(cell['last'])}"


def fmt_wall(seconds: float | None) -> str:
    if seconds is None:
        return MISSING
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def markdown_table(rows: list[dict], smooth: int = 1) -> str:
    """One row per run; held-out success also per environment when any run evaluated several."""
    names = [q.name for q in QUANTITIES]
    held_out = "held-out success (before → after)"
    header = ["run", "steps", "wall time"] + [held_out if n == "held-out success" else n for n in names]
    lines = [_md_row(header), _md_row(["---"] * len(header))]
    for row in rows:
        cells = [_held_out_cell(row[n]) if n == "held-out success" else fmt_change(row[n]) for n in names]
        lines.append(_md_row([row["run"], str(row["steps"]), fmt_wall(row["wall_s"])] + cells))
    smoothed_note = (f"; reward, rollout success, turns, entropy and KL as means of the first / last {smooth} points"
                     if smooth > 1 else "")
    note = (f"First → last logged value of each quantity against the learner step{smoothed_note}; held-out success "
            f"from the first to the last periodic evaluation (eval.every), with their steps. {MISSING}: not logged "
            f"by that run.")
    out = "\n".join(lines) + "\n\n" + note + "\n"
    envs = sorted({env for row in rows for env in row["held_out_by_env"]})
    if len(envs) > 1:
        lines = [_md_row(["run"] + envs), _md_row(["---"] * (len(envs) + 1))]
        for row in rows:
            lines.append(_md_row([row["run"]] + [_held_out_cell(row["held_out_by_env"].get(e)) for e in envs]))
        out += "\nHeld-out success by environment (before → after):\n\n" + "\n".join(lines) + "\n"
    return out


def _held_out_cell(cell: dict | None) -> str:
    if cell is None:
        return MISSING
    return f"{fmt(cell['first'])} → {fmt(cell['last'])} (steps {cell['first_step']}–{cell['last_step']})"


def _md_row(cells: list[str]) -> str:
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def draw_chart(runs: list[RunCurves], path: Path, smooth: int = 1) -> Path:
    """One panel per quantity, one line per run (the same colour for a run in every panel)."""
    from matplotlib.figure import Figure  # a Figure without pyplot renders with Agg: no display needed

    cols = 2
    rows = math.ceil(len(QUANTITIES) / cols)
    fig = Figure(figsize=(6.0 * cols, 2.8 * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    colours = [f"C{i % 10}" for i in range(len(runs))]
    for ax, q in zip(axes, QUANTITIES):
        drawn = 0
        for run, colour in zip(runs, colours):
            found = run.series(q)
            if found is None:
                continue
            _, points = found
            steps = [s for s, _ in points]
            values = [v for _, v in points]
            if q.name in SMOOTHED and smooth > 1:
                ax.plot(steps, values, color=colour, alpha=0.25, linewidth=0.8)
                values = smoothed(values, smooth)
            marker = "o" if len(points) <= 30 else None  # sparse curves (the periodic evaluation) as points too
            ax.plot(steps, values, color=colour, marker=marker, markersize=3, linewidth=1.4)
            drawn += 1
        ax.set_title(f"{q.name}: {q.description}", fontsize=9)
        ax.set_xlabel("learner step", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if q.rate:
            ax.set_ylim(-0.03, 1.03)
        if not drawn:
            ax.text(0.5, 0.5, f"not logged ({', '.join(q.tags)})", ha="center", va="center", fontsize=8,
                    color="grey", transform=ax.transAxes)
    for ax in axes[len(QUANTITIES):]:
        ax.set_visible(False)
    # One legend for the figure: a run has the same colour in every panel.
    fig.legend(*_run_handles(runs, colours), loc="outside upper center", ncol=min(len(runs), 4), fontsize=9)
    fig.savefig(path, dpi=100)
    return path


def _run_handles(runs: list[RunCurves], colours: list[str]):
    from matplotlib.lines import Line2D

    return [Line2D([], [], color=c, linewidth=2) for c in colours], [r.label for r in runs]


def report(run_dirs: list[Path], out_dir: Path | None = None, *, smooth: int = 1,
           labels: list[str] | None = None) -> dict:
    """Read the runs, write ``learning.png``, ``learning.md`` and ``learning.json`` into ``out_dir``
    (default: ``<first run>/report``); returns the paths, the rows and the table text."""
    if not run_dirs:
        raise ReportError("give at least one run directory")
    if smooth < 1:
        raise ReportError(f"--smooth must be >= 1, got {smooth}")
    runs = read_runs([Path(d) for d in run_dirs], labels)
    out_dir = Path(out_dir) if out_dir is not None else RunDir(run_dirs[0]).report
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = [summary(run, smooth) for run in runs]
    table = markdown_table(rows, smooth)
    chart = draw_chart(runs, out_dir / CHART_NAME, smooth)
    (out_dir / TABLE_NAME).write_text(f"![learning curves]({CHART_NAME})\n\n{table}")
    (out_dir / SUMMARY_NAME).write_text(json.dumps(rows, indent=1) + "\n")
    return {"chart": chart, "table_path": out_dir / TABLE_NAME, "summary_path": out_dir / SUMMARY_NAME,
            "rows": rows, "table": table}


def main(run_dirs: list[Path], out_dir: Path | None, *, smooth: int = 1, labels: list[str] | None = None) -> int:
    import sys

    try:
        result = report(run_dirs, out_dir, smooth=smooth, labels=labels)
    except ReportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(result["table"])
    print(f"chart: {result['chart']}\ntable: {result['table_path']}\nvalues: {result['summary_path']}")
    return 0
