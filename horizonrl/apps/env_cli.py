"""``horizonrl env list | splits NAME OUT_DIR | check NAME | serve NAME...`` (also ``python -m`` this module).

``check`` plays a scripted expert — the BabyAI bot, TextCraft's crafting plan, SciWorld's gold
actions, SearchQA's oracle queries — on test tasks and prints one JSON line: success rate, mean
turns, steps/s. With ``--server URL`` the actions go to a server session while a local twin of
the environment (same task, same actions) supplies the expert's moves; the line then also
counts observations where server and twin disagree (``mismatches``, 0 when deterministic).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from typing import Any

EXPERT_SETTINGS: dict[str, dict[str, Any]] = {"sciworld": {"gold_path": True}}


def add_env_commands(subparsers: Any) -> None:
    """Add ``list``, ``check`` and ``serve`` to an argparse subparsers object."""
    p = subparsers.add_parser("list", help="list the registered environments")
    p.set_defaults(func=_cmd_list)

    p = subparsers.add_parser("splits", help="write <name>_train.json and <name>_test.json: AgentGym-RL's id files "
                                             "([{\"item_id\": \"<name>_<i>\"}, ...]) of the environment's own splits")
    p.add_argument("name")
    p.add_argument("out_dir")
    p.add_argument("--settings", default="{}", help="the environment's settings as JSON")
    p.set_defaults(func=_cmd_splits)

    p = subparsers.add_parser("check", help="run the scripted expert and print one JSON line")
    p.add_argument("name")
    p.add_argument("--episodes", type=int, default=20)
    p.add_argument("--server", default=None, help="URL of an environment server to play through")
    p.add_argument("--split", default="test", choices=["train", "test"])
    p.add_argument("--settings", default="{}", help="the environment's settings as JSON")
    p.add_argument("--seed", type=int, default=0, help="which tasks are sampled")
    p.add_argument("--max-turns", type=int, default=500)
    p.set_defaults(func=_cmd_check)

    p = subparsers.add_parser("serve", help="serve environments over HTTP")
    p.add_argument("names", nargs="+")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: a free port (the address is printed once listening)")
    p.add_argument("--settings", default="{}", help='JSON {"env name": {settings}}')
    p.add_argument("--idle-timeout", type=float, default=600.0, help="seconds before an idle session is reaped")
    p.add_argument("--reap-interval", type=float, default=10.0)
    p.add_argument("--max-sessions", type=int, default=4096)
    p.add_argument("--max-body-bytes", type=int, default=1 << 20)
    p.add_argument("--agentgym-errors", action="store_true",
                   help="answer errors with HTTP 200 and {\"error\": ...} as AgentGym's servers do (for old "
                        "clients that expect it); off: real status codes")
    p.set_defaults(func=_cmd_serve)


def _cmd_list(args: argparse.Namespace) -> int:
    from horizonrl.envs.registry import env_names

    for name in env_names():
        print(name)
    return 0


def _cmd_splits(args: argparse.Namespace) -> int:
    from horizonrl.envs.ids import write_split_files
    from horizonrl.envs.registry import make_env

    env = make_env(args.name, json.loads(args.settings))
    for split, path in write_split_files(env, args.out_dir, args.name).items():
        print(f"{split}: {path}")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from horizonrl.core.runtime import stop_when_launcher_dies
    from horizonrl.envs.registry import env_names
    from horizonrl.envs.server import serve

    stop_when_launcher_dies()  # a server a run's launcher started (envs[i].settings.managed) ends with it

    unknown = [n for n in args.names if n not in env_names()]
    if unknown:
        print(f"unknown environments: {unknown}; known: {env_names()}", file=sys.stderr)
        return 2
    serve(args.names, host=args.host, port=args.port, settings=json.loads(args.settings),
          max_sessions=args.max_sessions, idle_timeout_s=args.idle_timeout, reap_interval_s=args.reap_interval,
          max_body_bytes=args.max_body_bytes, agentgym_errors=args.agentgym_errors)
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    result = asyncio.run(run_check(args.name, args.episodes, args.server, args.split, json.loads(args.settings),
                                   args.seed, args.max_turns))
    print(json.dumps(result))
    return 0


def expert_task_ids(env: Any, name: str, split: str) -> list[int]:
    ids = env.task_ids(split)
    if name == "babyai":
        from horizonrl.envs.babyai import BOT_UNSUPPORTED_LEVELS

        ids = [i for i in ids if env.task_category(i) not in BOT_UNSUPPORTED_LEVELS]
    return ids


async def run_check(name: str, episodes: int, server: str | None = None, split: str = "test",
                    settings: dict[str, Any] | None = None, seed: int = 0, max_turns: int = 500) -> dict[str, Any]:
    """Play the expert on ``episodes`` sampled tasks; return the summary the CLI prints."""
    from horizonrl.envs.client import HTTPEnv
    from horizonrl.envs.registry import make_env

    twin = make_env(name, {**(settings or {}), **EXPERT_SETTINGS.get(name, {})})
    remote = HTTPEnv(server, env=name) if server else None
    ids = random.Random(seed).sample(expert_task_ids(twin, name, split), episodes)
    wins, turns, steps, step_time, mismatches = 0, 0, 0, 0.0, 0
    try:
        for task_id in ids:
            observation = await twin.reset(task_id)
            if remote is not None:
                mismatches += (await remote.reset(task_id)) != observation
            plan = None if hasattr(twin, "expert_action") else list(twin.expert_plan())  # step-wise: BabyAI, WebArena
            bot, result = None, None
            for turn in range(max_turns):
                if plan is None:
                    reply, bot = twin.expert_action(bot)
                elif turn < len(plan):
                    reply = plan[turn]
                else:
                    break
                start = time.perf_counter()
                if remote is not None:
                    result = await remote.step(reply)
                    step_time += time.perf_counter() - start
                    mismatches += (await twin.step(reply)).observation != result.observation
                else:
                    result = await twin.step(reply)
                    step_time += time.perf_counter() - start
                steps += 1
                if result.done:
                    break
            wins += bool(result and result.success)
            turns += (turn + 1)
    finally:
        await twin.close()
        if remote is not None:
            await remote.close()
    summary = {"env": name, "episodes": len(ids), "success_rate": wins / max(1, len(ids)),
               "mean_turns": turns / max(1, len(ids)), "steps_per_s": steps / step_time if step_time else 0.0,
               "server": server}
    if remote is not None:
        summary["mismatches"] = mismatches
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="horizonrl env", description=__doc__.splitlines()[0])
    add_env_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
