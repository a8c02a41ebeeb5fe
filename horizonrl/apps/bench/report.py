"""What every benchmark part shares: summaries, paired ratios, the table, results.json and chart.png.

A part's result is a plain dict (JSON as it stands)::

    {"part": "weight_sync",
     "rows": [{"label": "tiny / horizonrl", "MB_per_s": {"median", "min", "max", "n"}, "bytes": 1.4e6}, ...],
     "ratios": {"tiny: horizonrl / raw MB/s": {"median", "min", "max", "n"}, ...},
     "settings": {...},
     "chart": {"metric": "MB_per_s", "ylabel": "MB/s", "log": True}}   # optional

A row value is either a summary (printed ``median [min–max]``) or a plain scalar/string.
A part's ``run(quick, out_dir, **options)`` writes its own ``out_dir/<part>/results.json`` and
``chart.png``; whoever runs several parts passes all their results to :func:`write_results`
once more for the combined ``out_dir/results.json`` and ``chart.png``.

Ratios are measured *within one run*: each repeat measures baseline and candidate back to
back (the order alternating between repeats, see :func:`alternate`), the ratio is taken per
repeat (:func:`paired_ratio`), and its median/min/max are over those per-repeat ratios — so
load that others put on the machine during one repeat hits both sides of that ratio.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Sequence, TextIO, TypeVar

T = TypeVar("T")

SUMMARY_KEYS = ("median", "min", "max", "n")


def summarize(values: Sequence[float]) -> dict[str, float]:
    """``{"median", "min", "max", "n"}`` of ``values`` (which must not be empty)."""
    values = [float(v) for v in values]
    if not values:
        raise ValueError("cannot summarize an empty list of measurements")
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def is_summary(value: Any) -> bool:
    return isinstance(value, dict) and all(key in value for key in SUMMARY_KEYS)


def paired_ratio(candidate: Sequence[float], baseline: Sequence[float]) -> dict[str, float]:
    """Summary of ``candidate[i] / baseline[i]``: one ratio per repeat, both measured in repeat ``i``."""
    if len(candidate) != len(baseline):
        raise ValueError(f"{len(candidate)} candidate and {len(baseline)} baseline measurements do not pair up")
    return summarize([c / b for c, b in zip(candidate, baseline)])


def alternate(repeat: int, items: Sequence[T]) -> list[T]:
    """The order to measure ``items`` in during ``repeat``: as given on even repeats, reversed on odd ones.

    Alternating keeps a systematic first-or-second advantage (warm caches, a neighbour's job
    starting) out of the ratios.
    """
    return list(items) if repeat % 2 == 0 else list(reversed(items))


def make_result(part: str, rows: list[dict], ratios: dict[str, dict], settings: dict,
                chart: dict | None = None) -> dict:
    result = {"part": part, "rows": rows, "ratios": ratios, "settings": settings}
    if chart is not None:
        result["chart"] = chart
    return result


def progress(part: str, message: str) -> None:
    """One progress line on stderr, so a long benchmark visibly moves while stdout stays the table."""
    print(f"[{time.strftime('%H:%M:%S')}] {part}: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------- table


def format_number(x: float) -> str:
    x = float(x)
    if x == 0 or 0.01 <= abs(x) < 10_000:
        return f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}"
    if abs(x) >= 10_000:
        return f"{x:,.0f}"
    return f"{x:.2e}"


def format_value(value: Any) -> str:
    if is_summary(value):
        return f"{format_number(value['median'])} [{format_number(value['min'])}–{format_number(value['max'])}]"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    return format_number(value)


def print_table(result: dict, file: TextIO | None = None) -> None:
    """A fixed-width table of the rows (``median [min–max]``), then the ratios and the settings."""
    out = file if file is not None else sys.stdout
    rows = result["rows"]
    columns = ["label"] + [key for key in _ordered_keys(rows) if key != "label"]
    cells = [[format_value(row.get(col, "")) for col in columns] for row in rows]
    widths = [max([len(col)] + [len(line[i]) for line in cells]) for i, col in enumerate(columns)]

    print(f"\n== {result['part']} ==", file=out)
    print("  ".join(col.ljust(w) for col, w in zip(columns, widths)), file=out)
    print("  ".join("-" * w for w in widths), file=out)
    for line in cells:
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths)), file=out)
    if result.get("ratios"):
        print("ratios (per repeat, median [min–max]):", file=out)
        width = max(len(name) for name in result["ratios"])
        for name, summary in result["ratios"].items():
            print(f"  {name.ljust(width)}  {format_value(summary)}", file=out)
    if result.get("settings"):
        print("settings: " + json.dumps(result["settings"], default=str), file=out)


def _ordered_keys(rows: list[dict]) -> list[str]:
    keys: dict[str, None] = {}
    for row in rows:
        keys.update(dict.fromkeys(row))
    return list(keys)


# ------------------------------------------------------------------------------------- results


def machine_info() -> dict[str, Any]:
    """What the figures depend on (no hostname): CPUs, Python, torch, accelerator."""
    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": platform.python_version(),
    }
    if hasattr(os, "sched_getaffinity"):
        info["cpus_usable"] = len(os.sched_getaffinity(0))
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        info["cuda_device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        info["torch"] = None
        info["cuda_device"] = None
    return info


def write_results(results: list[dict], out_dir: Path | str) -> dict[str, Path]:
    """Write ``results.json`` (the results plus machine info) and ``chart.png`` into ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "results.json"
    payload = {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine_info(), "results": results}
    json_path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    chart_path = out_dir / "chart.png"
    write_chart(results, chart_path)
    return {"json": json_path, "chart": chart_path}


def write_chart(results: list[dict], path: Path) -> None:
    """One subplot per part: the chart metric of every row as a bar with min–max error bars."""
    import matplotlib

    matplotlib.use("Agg")  # no display here, and none needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(11, 4.2 * len(results)), squeeze=False)
    for ax, result in zip(axes[:, 0], results):
        _plot_part(ax, result)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_part(ax, result: dict) -> None:
    chart = result.get("chart") or {}
    metric = chart.get("metric") or next(
        (key for row in result["rows"] for key, value in row.items() if is_summary(value)), None)
    rows = [row for row in result["rows"] if metric is not None and is_summary(row.get(metric))]
    if not rows:
        ax.set_title(f"{result['part']}: nothing to plot")
        ax.axis("off")
        return
    medians = [row[metric]["median"] for row in rows]
    lower = [row[metric]["median"] - row[metric]["min"] for row in rows]
    upper = [row[metric]["max"] - row[metric]["median"] for row in rows]
    positions = range(len(rows))
    colors = [f"C{i % 10}" for i in _group_colors(rows)]
    ax.bar(positions, medians, yerr=[lower, upper], capsize=3, color=colors)
    ax.set_xticks(list(positions), [row["label"] for row in rows], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(chart.get("ylabel", metric))
    if chart.get("log"):
        ax.set_yscale("log")
    ratios = "; ".join(f"{name} {summary['median']:.2f}" for name, summary in result.get("ratios", {}).items())
    title = f"{result['part']} — bars: median, whiskers: min–max"
    if ratios:
        title += "\n" + "\n".join(textwrap.wrap("ratios: " + ratios, 130))
    ax.set_title(title, fontsize=9)


def _group_colors(rows: list[dict]) -> list[int]:
    # Same colour for the same series (the part of the label after the last "/"), e.g. "raw".
    series: dict[str, int] = {}
    return [series.setdefault(str(row["label"]).rsplit("/", 1)[-1].strip(), len(series)) for row in rows]
