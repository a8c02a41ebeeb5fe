"""A horizonrl environment server in its own process on a port it binds itself (for tests)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

from helpers import AddressPrintingProcess

_LISTENING = re.compile(r"serving .* on (http://127\.0\.0\.1:\d+)")


def wait_healthy(url: str, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                return json.loads(r.read())
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"server {url} not healthy within {timeout_s} s")


class ServerProcess(AddressPrintingProcess):
    """``horizonrl env serve NAMES --port 0``: the server binds a free port and prints its address,
    so no other process can take the port between choosing and binding it."""

    def __init__(self, names: list[str], *extra: str, timeout_s: float = 60.0) -> None:
        env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONUNBUFFERED": "1"}
        args = [sys.executable, "-m", "horizonrl.apps.env_cli", "serve", *names, "--host", "127.0.0.1", "--port", "0",
                *extra]
        try:
            self.url = self._start(args, env, _LISTENING, "the environment server", timeout_s)
            self.port = int(self.url.rsplit(":", 1)[1])
            wait_healthy(self.url)
        except BaseException:
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
