"""``horizonrl bench``: what the asynchronous design buys, measured side by side on this machine.

Parts (``--parts``, comma-separated; default all, run in this order):

  transport    ZMQ+msgpack vs pickle over multiprocessing.Queue, 1k/8k/32k tokens, 1 and 4 producers
  weight_sync  our flat-buffer broadcast vs a raw torch.distributed broadcast, tiny and ~100M models
  rollout      async actor loop vs turn-lockstep, on the real Signpost env and a heavy-tailed workload
  training     async pipeline vs synchronous (generate, train, broadcast, repeat), real system
  engine       async training's generated tokens/s ÷ the bare engines' (no env, no learner)

``--workload heavy-tail`` runs the training part on the rollout part's long-tailed workload
(configs/bench_heavy_tail.yaml) instead of Signpost (configs/signpost_test.yaml), where every episode
takes the same two turns.

``--partition`` runs the training and engine parts on partitioned cores (the learner's side and each
engine on cores of their own, the bare engines on the same cores): the fair comparison on a CPU host.

Each part prints a table (median [min–max] over repeats; ratios taken within each repeat);
``<out>/results.json`` and ``<out>/chart.png`` hold all parts run. ``--quick`` finishes in a
few minutes, the full mode in under half an hour on a 2-core machine (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

PARTS = ("transport", "weight_sync", "rollout", "training", "engine")
REPO = Path(__file__).resolve().parents[3]
# The training part's workload: its config (the engine part always replays Signpost prompts).
TRAINING_WORKLOADS = {"signpost": REPO / "configs" / "signpost_test.yaml",
                      "heavy-tail": REPO / "configs" / "bench_heavy_tail.yaml"}


def add_bench_command(sub) -> None:
    p = sub.add_parser("bench", help="throughput benchmarks: async vs synchronous, transport, weight sync",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {', '.join(PARTS)}")
    p.add_argument("--quick", action="store_true", help="fewer repeats and smaller workloads (minutes)")
    p.add_argument("--out", type=Path, default=Path("runs/bench"), help="where results.json and chart.png go")
    p.add_argument("--model", default=None, help="model for rollout/training/engine (default: the tiny model, "
                                                 "built into .cache/ on first use)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for the training runs of the training and engine parts (repeatable), "
                        "e.g. --set rollout.weight_sync_every=2")
    p.add_argument("--workload", choices=sorted(TRAINING_WORKLOADS), default="signpost",
                   help="the training part's environment: Signpost (two turns each) or the long-tailed heavy-tail "
                        "workload of the rollout part (default: signpost)")
    p.add_argument("--partition", nargs="?", const="actors", default=None, choices=("actors", "engines"),
                   help="training and engine parts on partitioned CPU cores, as on separate GPUs: the learner's "
                        "side on half of them and each actor, client and engine, on a core of its own (actors, "
                        "the default); or each engine alone on a core, the actors' clients with the learner "
                        "(engines); the bare engines on the same cores")
    p.set_defaults(func=run_bench)


def run_bench(args) -> int:
    from horizonrl.apps.bench.report import print_table, progress, write_results

    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts:
        print(f"error: unknown part(s) {unknown}; choose from {', '.join(PARTS)}", file=sys.stderr)
        return 2
    if args.workload != "signpost" and "training" not in parts:
        print(f"error: --workload {args.workload} applies to the training part only; add it to --parts",
              file=sys.stderr)
        return 2
    args.parts_selected = parts
    args.core_partition = None
    if args.partition:
        from horizonrl.apps.bench.partition import CorePartition

        try:
            args.core_partition = CorePartition.of_this_host(args.partition)
        except RuntimeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        progress("bench", f"partition: {args.core_partition.describe()}")
    args.out.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []
    started = time.perf_counter()
    for part in (p for p in PARTS if p in parts):
        t0 = time.perf_counter()
        progress(part, "starting" + (" (quick)" if args.quick else ""))
        result = _run_part(part, args, results)
        result["wall_s"] = round(time.perf_counter() - t0, 1)
        results.append(result)
        print_table(result)
        write_results(results, args.out)  # after every part: a later failure loses nothing
    paths = write_results(results, args.out)
    print(f"\nbench done in {(time.perf_counter() - started) / 60:.1f} min: {paths['json']}, {paths['chart']}")
    return 0


def _run_part(part: str, args, done: list[dict]) -> dict:
    if part == "transport":
        from horizonrl.apps.bench import transport

        return transport.run(args.quick, args.out)
    if part == "weight_sync":
        from horizonrl.apps.bench import weight_sync

        return weight_sync.run(args.quick, args.out)
    if part == "rollout":
        from horizonrl.apps.bench import rollout

        bare = None
        # part 3's bare engines share part 1's start-up
        if "engine" in args.parts_selected and args.core_partition is None:
            from horizonrl.apps.bench.engine_bound import bare_spec

            bare = bare_spec(args.quick, rollout.tiny_model(args.model))
        return rollout.run(args.quick, args.out, model=args.model, bare=bare)
    if part == "training":
        from horizonrl.apps.bench import training

        partition = args.core_partition
        return training.run(args.quick, args.out, model=args.model, config=TRAINING_WORKLOADS[args.workload],
                            extra_overrides=(partition.overrides() if partition else []) + args.overrides,
                            settings_note=partition.describe() if partition else None)
    from horizonrl.apps.bench import engine_bound

    training_result = next((r for r in done if r["part"] == "training"), None)
    rollout_result = next((r for r in done if r["part"] == "rollout"), None)
    if args.overrides and args.core_partition is None and training_result is None:
        raise SystemExit("error: --set applies to the engine part's own training runs, which it makes only with "
                         "--partition (without it, it reuses the training part's)")
    return engine_bound.run(args.quick, args.out, model=args.model, training_result=training_result,
                            rollout_result=rollout_result, partition=args.core_partition, overrides=args.overrides)
