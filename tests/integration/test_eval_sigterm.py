"""`horizonrl eval` ended by SIGTERM shuts its vLLM engine down: no engine process is left running without a parent.

Before, SIGTERM killed the command outright and its EngineCore (and the worker and resource tracker below it) went on
running, adopted by init. A real engine, real episodes, a real signal."""

import json
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest


@pytest.mark.slow
def test_sigterm_during_an_evaluation_leaves_no_engine_process(tiny_model, tmp_path):
    command = [sys.executable, "-m", "horizonrl", "eval", "--model", str(tiny_model), "--env", "signpost",
               "--env-settings", json.dumps({"length": 2}), "--episodes", "100", "--samples", "100",
               "--max-turns", "2", "--max-tokens-per-turn", "24", "--max-context-tokens", "512"]
    log_path = tmp_path / "eval.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    started: list[psutil.Process] = []
    try:
        # The progress bar counts finished episodes: the engine is up and generating (10,000 episodes: minutes
        # of work left). A signal during vLLM's start-up would be lost: its handshake swallows KeyboardInterrupt.
        deadline = time.monotonic() + 300
        while not re.search(r"signpost episodes:[^\r\n]*?\b[1-9]\d*/10000", log_path.read_text()):
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "no episode finished within 300 s"
            time.sleep(0.5)
        started = psutil.Process(proc.pid).children(recursive=True)
        assert started, "the engine's processes should be running"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) != 0  # interrupted, not finished
        _, alive = psutil.wait_procs(started, timeout=30)
        assert not alive, f"left running after SIGTERM: {[(p.pid, p.name()) for p in alive]}"
    finally:
        for p in [*started, psutil.Process(proc.pid) if proc.poll() is None else None]:
            if p is not None and p.is_running():
                p.kill()
        proc.wait(timeout=30)
        log.close()
