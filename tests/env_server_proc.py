"""A horizonrl environment server in its own process on a port it binds itself (for tests)."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

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


class ServerProcess:
    """``horizonrl env serve NAMES --port 0``: the server binds a free port and prints its address,
    so no other process can take the port between choosing and binding it."""

    def __init__(self, names: list[str], *extra: str, timeout_s: float = 60.0) -> None:
        env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "horizonrl.apps.env_cli", "serve", *names, "--host", "127.0.0.1", "--port", "0", *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
        self.stderr: list[str] = []
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._drain, args=(lines,), daemon=True).start()
        try:
            self.url = self._wait_for_address(lines, timeout_s)
            self.port = int(self.url.rsplit(":", 1)[1])
            wait_healthy(self.url)
        except BaseException:
            self.stop()
            raise

    def _drain(self, lines: queue.Queue) -> None:
        for raw in iter(self.proc.stderr.readline, b""):
            line = raw.decode(errors="replace")
            self.stderr.append(line)
            lines.put(line)

    def _wait_for_address(self, lines: queue.Queue, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                match = _LISTENING.search(lines.get(timeout=0.2))
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            if match:
                return match.group(1)
        raise TimeoutError(f"the environment server printed no address within {timeout_s:.0f} s "
                           f"(exit code {self.proc.poll()}): {''.join(self.stderr)[-2000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # only the process this fixture started
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
