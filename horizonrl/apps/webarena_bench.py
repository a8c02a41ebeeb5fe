"""Steps/s and memory per concurrent WebArena episode, in-process and through the environment server.

``python -m horizonrl.apps.webarena_bench [--concurrency 1,4,8] [--seconds 20] [--server]``

Each of ``c`` concurrent workers plays the scripted expert on the bundled tasks for ``--seconds``
(resets included in the wall time; steps counted). Memory is the proportional set size (PSS:
shared pages split fairly) of everything the episodes need — the Python process (or the server
process) and its Playwright driver and Chromium processes — sampled while all ``c`` episodes are
open; "per extra episode" is the slope between the smallest and largest ``c``. The expert reads
element ids from the observation text, so the server needs no local twin.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import time
from typing import Any

from horizonrl.envs.webarena.tasks import LOCAL_EXPERT

LINE = re.compile(r"^\t*\[(\d+)\] (\S+) '(.*?)'", re.MULTILINE)


def expert_reply(step: dict[str, Any], observation: str) -> str:
    """A plan step (``data/generate.py``) as a reply, the element's id read from the observation text."""
    kind, target = next(iter(step.items()))
    if kind in ("click", "type"):
        role, name = target
        for nid, line_role, line_name in LINE.findall(observation):
            if line_role == role and line_name == name:
                if kind == "type":
                    return f"```type [{nid}] [{step['text']}] [{step.get('enter', 1)}]```"
                return f"```click [{nid}]```"
        raise RuntimeError(f"no {role} {name!r} in the observation")
    return f"```{kind} [{target}]```"


def tree_pss(pid: int) -> int:
    """PSS of a process and all its descendants."""
    import psutil

    total = 0
    root = psutil.Process(pid)
    for proc in [root, *root.children(recursive=True)]:
        try:
            total += proc.memory_full_info().pss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total


async def measure(make_env: Any, concurrency: int, seconds: float, pid: int) -> dict[str, Any]:
    plans = json.loads(LOCAL_EXPERT.read_text())
    envs = [make_env() for _ in range(concurrency)]
    steps = episodes = wins = 0
    opened = asyncio.Event()
    ready = 0
    deadline = time.monotonic() + seconds
    samples: list[int] = []

    async def worker(k: int, env: Any) -> None:
        nonlocal steps, episodes, wins, ready
        task_id, first = k, True
        while time.monotonic() < deadline:
            observation = await env.reset(task_id % len(plans))
            if first:
                ready += 1
                if ready == concurrency:
                    opened.set()
                first = False
            for step in plans[str(task_id % len(plans))]:
                result = await env.step(expert_reply(step, observation))
                steps += 1
                observation = result.observation
                if result.done:
                    wins += result.success
                    break
            episodes += 1
            task_id += concurrency

    async def sampler() -> None:
        await opened.wait()
        while time.monotonic() < deadline - 0.5:
            samples.append(await asyncio.to_thread(tree_pss, pid))
            await asyncio.sleep(1.0)

    started = time.monotonic()
    try:
        await asyncio.gather(sampler(), *(worker(k, env) for k, env in enumerate(envs)))
    finally:
        for env in envs:
            await env.close()
    wall = time.monotonic() - started
    return {"concurrency": concurrency, "steps": steps, "episodes": episodes, "success_rate": wins / max(1, episodes),
            "steps_per_s": steps / wall, "pss_mib": max(samples, default=0) / 2**20}


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    import os

    levels = [int(c) for c in args.concurrency.split(",")]
    results = []
    if args.server:
        import subprocess

        from horizonrl.core.programs import horizonrl_command
        from horizonrl.envs.client import HTTPEnv

        proc = subprocess.Popen(horizonrl_command("env", "serve", "webarena", "--port", "0", "--settings",
                                                  json.dumps({"webarena": {"max_concurrent_episodes": max(levels)}})),
                                stderr=subprocess.PIPE, stdout=subprocess.DEVNULL)
        try:
            url = None
            while url is None:
                line = proc.stderr.readline().decode()
                if not line:
                    raise RuntimeError("the server exited")
                match = re.search(r"on (http://\S+)", line)
                url = match.group(1) if match else None
            warm = HTTPEnv(url, env="webarena")  # launch the server's browser outside the timing
            await warm.reset(0)
            await warm.close()
            for c in levels:
                results.append({"where": "server", **await measure(lambda: HTTPEnv(url, env="webarena"), c,
                                                                    args.seconds, proc.pid)})
        finally:
            proc.terminate()  # the server this benchmark started
            proc.wait(timeout=30)
    else:
        from horizonrl.envs.webarena import WebArenaEnv
        from horizonrl.envs.webarena.browser import close_browser

        try:
            warm = WebArenaEnv(max_concurrent_episodes=max(levels))  # launch the browser outside the timing
            await warm.reset(0)
            await warm.close()
            for c in levels:
                results.append({"where": "in-process", **await measure(
                    lambda: WebArenaEnv(max_concurrent_episodes=max(levels)), c, args.seconds, os.getpid())})
        finally:
            await close_browser()
    if len(levels) > 1:
        lo, hi = results[0], results[-1]
        per = (hi["pss_mib"] - lo["pss_mib"]) / (hi["concurrency"] - lo["concurrency"])
        for r in results:
            r["pss_mib_per_extra_episode"] = round(per, 1)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,4,8")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--server", action="store_true", help="through `horizonrl env serve webarena`")
    for row in asyncio.run(main_async(parser.parse_args(argv))):
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
