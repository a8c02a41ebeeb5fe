"""Train the tiny model with every advantage estimator through the real asynchronous loop.

For each estimator in ``--estimators``: a full ``horizonrl train`` run (coordinator, buffer,
learner, two vLLM actors) on the given config, then the final checkpoint's held-out success
(test-split tasks, a fresh vLLM engine) against the starting policy's on the same tasks,
plus the actors' own rollout success early and late in the run (from TensorBoard).

    python scripts/compare_estimators.py --config configs/signpost_test.yaml \
        --model .cache/tiny-signpost --steps 60 --out runs/estimators

Writes ``<out>/estimators.json`` and prints one line per estimator.
"""

from __future__ import annotations

import argparse
import glob
import json
import shutil
import time
from pathlib import Path

ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus", "gae")


def rollout_success(run_dir: Path) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = glob.glob(str(run_dir / "tensorboard" / "events.*"))
    if not files:
        return []
    acc = EventAccumulator(files[0])
    acc.Reload()
    if "rollout/success_rate" not in acc.Tags()["scalars"]:
        return []
    return [e.value for e in acc.Scalars("rollout/success_rate")]


def mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 3) if values else None


def main() -> int:
    from horizonrl.core.config import load_config
    from horizonrl.apps.demo import held_out_success
    from horizonrl.launcher import launch
    from horizonrl.core.run_dirs import latest_checkpoint

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=Path("configs/signpost_test.yaml"))
    p.add_argument("--model", default=".cache/tiny-signpost")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--estimators", default=",".join(ESTIMATORS))
    p.add_argument("--eval-episodes", type=int, default=100)
    p.add_argument("--out", type=Path, default=Path("runs/estimators"))
    p.add_argument("overrides", nargs="*", help="extra dotted overrides for every run, e.g. learner.lr=3e-4")
    args = p.parse_args()

    args.out.mkdir(parents=True, exist_ok=True)
    common = [f"model.path={args.model}", f"learner.total_steps={args.steps}",
              f"eval.episodes={args.eval_episodes}", *args.overrides]
    base = load_config(args.config, common)
    before = held_out_success(args.model, base)
    env = base.envs[0].name
    print(f"starting policy: held-out {env} success {before[env]['success_rate']:.2f}", flush=True)
    results = {"config": str(args.config), "steps": args.steps, "overrides": args.overrides,
               "before": before[env]["success_rate"], "runs": {}}
    for name in args.estimators.split(","):
        run_dir = args.out / name
        shutil.rmtree(run_dir, ignore_errors=True)  # a previous comparison's run: this one starts fresh
        config = load_config(args.config, [*common, f"algorithm.adv_estimator={name}", f"run.output_dir={run_dir}"])
        start = time.perf_counter()
        rc = launch(config)
        wall = time.perf_counter() - start
        row = {"exit_code": rc, "train_wall_s": round(wall, 1)}
        checkpoint = latest_checkpoint(run_dir)
        if rc == 0 and checkpoint is not None:
            rollout = rollout_success(run_dir)
            row |= {"rollout_success_first8": mean(rollout[:8]), "rollout_success_last8": mean(rollout[-8:]),
                    "held_out_after": held_out_success(str(checkpoint), config)[env]["success_rate"]}
        results["runs"][name] = row
        print(f"{name:22s} {json.dumps(row)}", flush=True)
        (args.out / "estimators.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0 if all(r["exit_code"] == 0 for r in results["runs"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
