"""A horizonrl environment server in its own process on a free 127.0.0.1 port (for tests)."""


from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request



def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                return json.loads(r.read())
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"server {url} not healthy within {timeout_s} s")


class ServerProcess:
    def __init__(self, names: list[str], *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONWARNINGS": "ignore"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "horizonrl.envs.cli", "serve", *names, "--host", "127.0.0.1",
             "--port", str(self.port), *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
        try:
            wait_healthy(self.url)
        except TimeoutError:
            self.stop()
            raise

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # only the process this fixture started
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)


