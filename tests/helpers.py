"""Shared test helpers: trajectories, processes started and ended by pid, free ports, scripts as modules."""

from __future__ import annotations

import importlib.util
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from horizonrl.protocol import Trajectory
from horizonrl.protocol.arrays import LOGPROB_DTYPE, MASK_DTYPE, TOKEN_DTYPE, pack

# BabyAI as the tiny model can play it: one easy level, the compact relative-position text.
BABYAI_SETTINGS = {"levels": ["BabyAI-GoToRedBallNoDists-v0"], "high_level_actions": False, "observation": "compact"}
# conftest.py's recorded_babyai_run: its learner steps and turn budget.
RECORDED_RUN_STEPS = 5
RECORDED_RUN_TURNS = 8


EOT = 1  # CharChat's end-of-turn token


class CharChat:
    """A chat template for unit tests of the episode loop: one token per character (+100), the system
    prompt (if any) before the user's text, end-of-turn token ``EOT``."""

    stop_token_ids = [EOT]

    def prompt_ids(self, observation, system_prompt=None):
        return [ord(c) + 100 for c in (system_prompt or "") + "U:" + observation] + [2]

    def continuation_ids(self, observation, generated_ids):
        prefix = [] if generated_ids and generated_ids[-1] == EOT else [EOT]
        return prefix + [ord(c) + 100 for c in "U:" + observation] + [2]

    def decode(self, ids):
        return "".join(chr(i - 100) for i in ids if i >= 100)


RUN_ID = "test-run"


def make_trajectory(group_id: str, index: int, *, reward: float = 0.0, group_size: int = 4, version: int = 0,
                    failure: str = "", tokens: int = 12, epoch: int = 0, run_id: str = RUN_ID,
                    task_id: int = 1) -> Trajectory:
    """A consistent one-turn trajectory (it passes protocol/validation.py)."""
    ids = list(range(tokens))
    mask = [0] * (tokens // 2) + [1] * (tokens - tokens // 2)
    return Trajectory(
        run_id=run_id, trajectory_id=f"{group_id}-{index}", group_id=group_id, group_size=group_size, env="signpost",
        task_id=task_id, actor_id=0, token_ids=pack(ids, TOKEN_DTYPE), loss_mask=pack(mask, MASK_DTYPE),
        logprobs=pack([-0.5 * m for m in mask], LOGPROB_DTYPE), prompt_length=tokens // 2,
        turn_spans=[(tokens // 2, tokens)], turn_versions=[version], turn_epochs=[epoch], turn_rewards=[reward],
        reward=reward, success=reward > 0, score=reward, num_turns=1, max_turns=6, stop_reason="done",
        failure=failure,
    )


class ManualClock:
    """A clock for code that takes one (``clock=``): it reads ``now``, which the test moves."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def start_process(args: list[str], log_path) -> subprocess.Popen:
    """Start a process in its own group so ``stop_process`` ends everything it spawned."""
    return subprocess.Popen(args, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def stop_process(proc: subprocess.Popen, timeout: float = 30.0, orphans_timeout: float = 120.0) -> int:
    """SIGTERM to ``proc``'s group, SIGKILL past ``timeout``; returns its exit code. Leaves nothing behind: the
    processes a launcher started sit in groups of their own, and if it was killed they stop themselves
    (``stop_when_launcher_dies``). Any still running after ``orphans_timeout`` is killed by pid, and named."""
    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        descendants = []
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # whatever the leader left behind in its group
    except ProcessLookupError:
        pass
    rc = proc.wait()
    deadline = time.monotonic() + orphans_timeout
    while (alive := [p for p in descendants if still_running(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    for leftover in alive:
        try:
            print(f"stop_process: killing pid {leftover.pid} ({' '.join(leftover.cmdline()[:4])}), "
                  f"still running {orphans_timeout:.0f} s after its launcher {proc.pid} ended", file=sys.stderr)
            leftover.kill()
        except psutil.Error:
            pass
    return rc


def still_running(process: psutil.Process) -> bool:
    """Alive, and not a zombie (an orphan's zombie waits for whoever reaps it: it holds nothing)."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def horizonrl_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "horizonrl", *args]


def wait_until(predicate, timeout: float, what: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str):
    """``scripts/<name>.py`` imported as a module, to test its functions (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------- a run's structured events
# Whole-run tests read <output_dir>/events.jsonl (core/run_events.py), never console or log wording.


def run_events(run_dir: Path, *kinds, since: float = 0.0) -> list[dict]:
    """The run's events of ``kinds`` (all when none), written at or after ``since`` (Unix time)."""
    from horizonrl.core.run_events import read_events

    return [e for e in read_events(run_dir, *kinds) if e["time"] >= since]


def steps_trained(run_dir: Path, since: float = 0.0) -> list[int]:
    """Learner steps in the order they were trained (what the console shows as ``step N/TOTAL``)."""
    from horizonrl.core.run_events import RunEvent

    return [e["step"] for e in run_events(run_dir, RunEvent.STEP_TRAINED, since=since)]


def newest_step(run_dir: Path, since: float = 0.0) -> int:
    return max(steps_trained(run_dir, since), default=0)


def wait_for_step(run_dir: Path, step: int, timeout: float, since: float = 0.0) -> int:
    """Wait until the learner has trained ``step`` (or a later one); returns the newest step."""
    return wait_until(lambda: newest_step(run_dir, since) >= step and newest_step(run_dir, since), timeout,
                      f"learner step {step}")


def faults(run_dir: Path) -> list[dict]:
    """The coordinator's fault ledger (``<output_dir>/faults.jsonl``): died, restarted, recovered, gave_up, each
    with the process name and the learner step it happened at."""
    import json

    path = Path(run_dir) / "faults.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


class AddressPrintingProcess:
    """A server started on a port it binds itself, which prints its address on stderr (so no other process can
    take the port between choosing and binding it): its stderr drained into ``log`` by a thread, its ``url`` the
    first match of a pattern. The subclass ends it by its pid (``stop``)."""

    proc: subprocess.Popen
    log: list[str]

    def _start(self, args: list[str], env: dict, listening: re.Pattern, what: str, timeout_s: float) -> str:
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
        self.log = []
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._drain, args=(lines,), daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                match = listening.search(lines.get(timeout=0.2))
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            if match:
                return match.group(1)
        raise TimeoutError(f"{what} printed no address within {timeout_s:.0f} s (exit code {self.proc.poll()}): "
                           f"{''.join(self.log)[-3000:]}")

    def _drain(self, lines: queue.Queue) -> None:
        for raw in iter(self.proc.stderr.readline, b""):
            line = raw.decode(errors="replace")
            self.log.append(line)
            lines.put(line)
