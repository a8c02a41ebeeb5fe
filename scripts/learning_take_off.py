"""The BabyAI learning test's take-off distribution: its whole procedure (tests/integration/test_learning.py's
``learning_run``: held-out before, the demo's training for the test's steps, held-out after) run N times, one at a
time, and the bounds a test built on it can hold.

    python scripts/learning_take_off.py --runs 10 --out runs/take-off.jsonl [--steps 40]

Each run appends one JSON line (the test's report plus its wall time) to ``--out``, so an interrupted measurement
goes on where it stopped (``--runs`` counts what the file already holds). At the end it prints, for the held-out
rise (after - before) and the actors' own rise (late - early): mean, standard deviation, min and max, and the bound
``mean - z * sd`` below which a run falls with probability ``--false-failure`` under a normal fit (z = 3.09 for
1 in 1,000), next to the smallest rise seen.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
Z = {1e-3: 3.090, 1e-4: 3.719}  # one-sided normal quantiles


def learning_module():
    """tests/integration/test_learning.py as a module (tests/ is not a package; its helpers sit beside it)."""
    import importlib.util

    sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "integration")]
    spec = importlib.util.spec_from_file_location("learning_under_measure", REPO / "tests/integration/test_learning.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def demo_model() -> Path:
    """The model the test trains: tests/conftest.py's ``demo_tiny_model`` (tests/suite_models.py; built once into
    .cache/tiny-demo). Call after :func:`learning_module`, which puts tests/ on the path."""
    import suite_models

    return suite_models.demo_model()


def summary(rows: list[dict], false_failure: float) -> dict:
    z = Z[false_failure]
    out = {"runs": len(rows), "false_failure": false_failure, "z": z}
    for name, rise in (("held_out_rise", lambda r: r["after"] - r["before"]),
                       ("rollout_rise", lambda r: r["rollout_late"] - r["rollout_early"])):
        values = [rise(r) for r in rows]
        mean, sd = statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0
        out[name] = {"mean": round(mean, 4), "sd": round(sd, 4), "min": round(min(values), 4),
                     "max": round(max(values), 4), "bound": round(mean - z * sd, 4)}
    out["before"] = [r["before"] for r in rows]
    out["after"] = [r["after"] for r in rows]
    out["wall_s"] = round(statistics.fmean(r["wall_s"] for r in rows), 1)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--out", type=Path, required=True, help="JSON lines, one per run (appended)")
    parser.add_argument("--steps", type=int, default=None, help="learner steps a run (default: the test's)")
    parser.add_argument("--false-failure", type=float, choices=sorted(Z), default=1e-3)
    args = parser.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    rows = [json.loads(line) for line in args.out.read_text().splitlines()] if args.out.exists() else []
    learning, model = learning_module(), demo_model()
    steps = args.steps or learning.STEPS
    if any(row.get("steps", learning.STEPS) != steps for row in rows):
        parser.error(f"{args.out} holds runs of another number of steps than {steps}: measure into a new file")
    while len(rows) < args.runs:
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="take-off-") as work:
            report = learning.learning_run(model, Path(work), steps)
        report["wall_s"] = round(time.perf_counter() - start, 1)
        rows.append(report)
        with open(args.out, "a") as out:
            out.write(json.dumps(report) + "\n")
        print(f"run {len(rows)}/{args.runs}: held-out {report['before']:.3f} -> {report['after']:.3f}, actors "
              f"{report['rollout_early']:.3f} -> {report['rollout_late']:.3f} ({report['wall_s']:.0f} s)", flush=True)
    print(json.dumps(summary(rows, args.false_failure), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
