"""Steps/s per environment, in-process vs through the HTTP environment server.

    .venv/bin/python scripts/bench_envs.py [--episodes 30] [--envs babyai textcraft searchqa sciworld]

Plays each environment's scripted expert (as ``horizonrl env check``) once in-process and once
through a server started here on a free 127.0.0.1 port (sequential requests, one session), and
prints one JSON line per environment and mode plus a table. Timing lives here, not in tests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

from horizonrl.apps.env_cli import run_check


def start_server(names: list[str]) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "horizonrl.apps.env_cli", "serve", *names, "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONWARNINGS": "ignore"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url + "/health", timeout=2).read()
            return proc, url
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise TimeoutError("the environment server did not start within 60 s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=30)
    parser.add_argument("--envs", nargs="+", default=["babyai", "textcraft", "searchqa", "sciworld"])
    args = parser.parse_args()
    proc, url = start_server(args.envs)
    rows = []
    try:
        for name in args.envs:
            for server in (None, url):
                summary = asyncio.run(run_check(name, args.episodes, server=server))
                print(json.dumps(summary), flush=True)
                rows.append(summary)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    print(f"\n{'env':<10} {'in-process steps/s':>20} {'server steps/s':>16} {'success':>8}")
    for local, remote in zip(rows[::2], rows[1::2]):
        print(f"{local['env']:<10} {local['steps_per_s']:>20.1f} {remote['steps_per_s']:>16.1f} "
              f"{min(local['success_rate'], remote['success_rate']):>8.2f}")


if __name__ == "__main__":
    main()
