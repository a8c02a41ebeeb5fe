"""Which episodes a staleness rule lets the learner train on, by length (docs/horizon.md).

Runs the heavy-tail training workload (configs/bench_heavy_tail.yaml: log-normal turns, median 3, up to 24)
once per ``buffer.staleness_rule`` with a tight ``buffer.max_staleness`` (2, Signpost's), one after the other,
then reads each run's buffer log: of the episodes whose fate is settled, the share served to the learner
(trained, or in a batch when the run ended) among short and long ones (long: more than ``--long-turns``
turns), and the reasons the rest were dropped.

    python scripts/staleness_long_episodes.py --steps 12 --out runs/staleness-long
    python scripts/staleness_long_episodes.py --report runs/staleness-long   # only read finished runs
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from horizonrl.apps.bench.rollout import tiny_model
from horizonrl.apps.bench.training import REPO, run_training, train_command
from horizonrl.buffer.accounting import buffer_state
from horizonrl.buffer.records import Accepted, decode_record
from horizonrl.buffer.wal import WriteAheadLog
from horizonrl.core.run_dirs import RunDir

RULES = ("oldest_token", "completion")


def episode_lengths(run_dir: Path) -> dict[str, int]:
    """Turns of every healthy episode the buffer accepted (trajectory id -> turns)."""
    turns: dict[str, int] = {}
    for payload in WriteAheadLog(RunDir(run_dir).buffer_wal).replay():
        record = decode_record(payload)
        if isinstance(record, Accepted):
            t = record.trajectory
            if not t.failure:
                turns[t.trajectory_id] = t.num_turns
    return turns


def shares(run_dir: Path, long_turns: int) -> dict:
    state = buffer_state(run_dir)
    served = state.in_flight_ids() | {i for i, fate in state.fates.items() if fate == "trained"}
    counts: dict[str, Counter] = {"short": Counter(), "long": Counter()}
    for trajectory_id, turns in episode_lengths(run_dir).items():
        kind = "long" if turns > long_turns else "short"
        fate = "served" if trajectory_id in served else state.fates.get(trajectory_id, "held")
        counts[kind][fate] += 1
    out = {}
    for kind, c in counts.items():
        settled = sum(n for fate, n in c.items() if fate != "held")
        out[kind] = {"episodes": sum(c.values()), "settled": settled, "served": c["served"],
                     "served_share": round(c["served"] / settled, 3) if settled else None,
                     "fates": dict(c)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="learner steps per run")
    parser.add_argument("--max-staleness", type=int, default=2)
    parser.add_argument("--long-turns", type=int, default=6, help="an episode of more turns than this is long")
    parser.add_argument("--out", type=Path, default=Path("runs/staleness-long"))
    parser.add_argument("--report", type=Path, help="only report the runs already in this directory")
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    out = args.report or args.out
    if not args.report:
        model = tiny_model(args.model)
        for rule in RULES:
            run_dir = (out / rule).resolve()
            extra = [f"buffer.staleness_rule={rule}", f"buffer.max_staleness={args.max_staleness}",
                     "rollout.groups_in_flight=4"]
            out.mkdir(parents=True, exist_ok=True)
            run_training(train_command(REPO / "configs/bench_heavy_tail.yaml", model, run_dir, args.steps, extra),
                         out / f"{rule}.log")
    result = {rule: shares(out / rule, args.long_turns) for rule in RULES if (out / rule).is_dir()}
    print(f"{'rule':<14}{'short served':>16}{'long served':>16}")
    for rule, r in result.items():
        cell = lambda k: f"{r[k]['served']}/{r[k]['settled']} ({r[k]['served_share']})"  # noqa: E731
        print(f"{rule:<14}{cell('short'):>16}{cell('long'):>16}")
    (out / "shares.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
