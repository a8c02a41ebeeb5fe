"""What a BabyAI "go to" policy does when its target is in view at the start and when it is not.

    python scripts/babyai_in_view.py RECORD_DIR [RECORD_DIR ...]

Reads recorded episodes (`horizonrl eval ... --record RECORD_DIR`, or a run's `episodes/`; docs/episodes.md)
of the compact observation with high-level actions, where the first observation lists the objects in view
(`red ball 1: 1 forward, 3 left`). Splits the episodes by whether an object of the goal's colour and type is
among them, and prints for each part: its share, the success rate, the mean turns played and what the first
reply did — go to the target, pick it up (which walks to it first), turn, move forward, go to another object,
anything else, or no valid action.
The ScalingInter-RL study with SmolLM2 (docs/learning.md) uses it to ask whether a policy trained with one
turn per episode learned to look for a target it cannot see.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path

GOAL = re.compile(r"Goal: go to (?:a|the) (\w+) (\w+)")
KINDS = ["go to the target", "pick up the target", "turn", "move forward", "go to another object", "other action",
         "no valid action"]


def first_move(action: str, target: str) -> str:
    if not action:
        return "no valid action"
    if action.startswith(f"go to {target} "):
        return "go to the target"
    if action.startswith(f"pickup {target} "):  # a high-level pickup walks to the object first: it reaches it too
        return "pick up the target"
    if action in ("turn left", "turn right"):
        return "turn"
    if action == "move forward":
        return "move forward"
    return "go to another object" if action.startswith("go to ") else "other action"


def read_episodes(record_dir: Path) -> list[dict]:
    episodes = []
    for path in sorted(record_dir.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record.get("kind") == "episode" and not record.get("failure"):
                episodes.append(record)
    return episodes


def summary(episodes: list[dict]) -> dict[str, dict]:
    parts: dict[str, list[tuple[dict, str]]] = {"in view": [], "not in view": []}
    for ep in episodes:
        goal = GOAL.search(ep["first_observation"])
        if goal is None or not ep["turns"]:
            continue
        target = f"{goal.group(1)} {goal.group(2)}"
        seen = any(line.startswith(f"{target} ") for line in ep["first_observation"].splitlines())
        parts["in view" if seen else "not in view"].append((ep, first_move(ep["turns"][0]["action"], target)))
    total = sum(len(p) for p in parts.values())
    out = {}
    for name, part in parts.items():
        if not part:
            continue
        moves = Counter(move for _, move in part)
        out[name] = {"episodes": len(part), "share": len(part) / total,
                     "success": sum(ep["success"] for ep, _ in part) / len(part),
                     "mean_turns": sum(ep["num_turns"] for ep, _ in part) / len(part),
                     "first_move": {k: moves[k] / len(part) for k in KINDS if moves[k]}}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("record_dirs", nargs="+", type=Path)
    parser.add_argument("--json", type=Path, default=None, help="also write the summaries to this file")
    args = parser.parse_args()
    found = {}
    for record_dir in args.record_dirs:
        episodes = read_episodes(record_dir)
        if not episodes:
            parser.error(f"{record_dir}: no recorded episodes (*.jsonl with \"kind\": \"episode\" lines)")
        found[str(record_dir)] = parts = summary(episodes)
        print(f"{record_dir} ({len(episodes)} episodes)")
        for name, s in parts.items():
            moves = ", ".join(f"{k} {v:.2f}" for k, v in s["first_move"].items())
            print(f"  target {name}: {s['episodes']} ({s['share']:.2f}), success {s['success']:.3f}, "
                  f"turns {s['mean_turns']:.2f}; first reply: {moves}")
    if args.json:
        args.json.write_text(json.dumps(found, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
