"""The environments' data files, as commands: the domain code stays in ``envs/``, the programs live here.

    horizonrl make-expert-data OUT.jsonl [--kind sft|dpo] [--episodes N] [--length L] [--max-turns T] [--seed S]
    horizonrl make-corpus OUT_DIR [--seed S] [--people N] [--countries N] [--name-parts N]
    horizonrl make-webarena-tasks

- ``make-expert-data``: Signpost expert trajectories (sft) or pairs (dpo) in AgentGym's format
  (``envs/signpost_expert.py``), for the offline paradigms;
- ``make-corpus``: SearchQA's synthetic corpus about invented entities, ``corpus.jsonl`` (Search-R1's format),
  ``train.jsonl`` and ``test.jsonl`` (``envs/synthetic_corpus.py``);
- ``make-webarena-tasks``: the bundled shop's and forum's ``local_tasks.json`` (WebArena's task format) and
  ``local_expert.json`` (a scripted plan per task), written next to ``envs/webarena/data/generate.py``.
"""

from __future__ import annotations

import argparse
import json
import sys


def add_expert_data_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", help="output file: .jsonl (one record per line) or .json (one list, as AgentGym)")
    parser.add_argument("--env", default="signpost", choices=["signpost"],
                        help="environment (only signpost has an expert)")
    parser.add_argument("--kind", default="sft", choices=["sft", "dpo"], help="sft: expert trajectories; dpo: pairs")
    parser.add_argument("--episodes", type=int, default=1000)
    parser.add_argument("--length", type=int, default=4, help="Signpost's number of crossroads")
    parser.add_argument("--max-turns", type=int, default=None, help="turn budget of an episode (default 2 x length)")
    parser.add_argument("--seed", type=int, default=0)


def run_expert_data(args: argparse.Namespace) -> int:
    from horizonrl.core.agentgym_records import write_records
    from horizonrl.envs.signpost_expert import signpost_records

    records = signpost_records(args.kind, args.episodes, args.length, args.max_turns, args.seed)
    path = write_records(args.out, records)
    print(f"{len(records)} {args.kind} records of {args.env} (length {args.length}) -> {path}", file=sys.stderr)
    return 0


def add_corpus_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--people", type=int, default=120)
    parser.add_argument("--countries", type=int, default=10,
                        help="the answers of 'In which country was <person> born?' (10: a guess is right 1 time in 10)")
    parser.add_argument("--name-parts", type=int, default=None,
                        help="draw first names and surnames from pools of this many words (default: two new words "
                             "per person)")


def run_corpus(args: argparse.Namespace) -> int:
    from horizonrl.envs.synthetic_corpus import write

    if args.people < 1 or args.countries < 1 or (args.name_parts is not None and args.name_parts < 1):
        print("error: need --people, --countries and --name-parts of at least 1", file=sys.stderr)
        return 2
    print(write(args.out_dir, seed=args.seed, num_people=args.people, name_parts=args.name_parts,
                num_countries=args.countries))
    return 0


def run_webarena_tasks(args: argparse.Namespace) -> int:
    from horizonrl.envs.webarena.data.generate import HERE, build

    task_list, plans = build()
    (HERE / "local_tasks.json").write_text(json.dumps(task_list, indent=1) + "\n")
    (HERE / "local_expert.json").write_text(json.dumps(plans, indent=1) + "\n")
    print(f"{len(task_list)} tasks -> {HERE / 'local_tasks.json'}, {HERE / 'local_expert.json'}")
    return 0
