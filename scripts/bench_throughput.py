"""The throughput benchmarks: the same as ``horizonrl bench``, from a checkout.

    python scripts/bench_throughput.py --quick
    python scripts/bench_throughput.py --parts rollout,training --out runs/bench

See docs/benchmarks.md for every workload and the latest figures.
"""

import argparse
import sys

from horizonrl.apps.bench.cli import add_bench_command

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="bench_throughput")
    sub = parser.add_subparsers(dest="command")
    add_bench_command(sub)
    args = parser.parse_args(["bench", *sys.argv[1:]])
    raise SystemExit(args.func(args))
