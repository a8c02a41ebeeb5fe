"""``horizonrl chaos CONFIG [key=value ...] --kill ROLE --every SECONDS``: a training run under fire.

Starts ``horizonrl train CONFIG`` and, at random times (uniform between 0.5 and 1.5 x ``--every``),
``kill -9``s one process of the chosen kind — an actor, the buffer, a learner rank, or a managed
environment server — for ``--duration`` seconds (or until the run ends), counted from the run's
first learner step (its start-up — engines loading, the first batch — is not what is under fire;
``--from-start`` kills from the launch on), then stops the run with
Ctrl-C (it writes its checkpoint) and prints what happened: the kills, the restarts and the time
each replacement took to recover (``faults.jsonl``), learner steps, and the accounting of every
trajectory (trained once, dropped by reason, still held, lost, trained twice). ``--baseline`` first
runs the same config for the same time without kills and prints the throughput ratio.
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROLES = {"actor": ("actor",), "buffer": ("buffer",), "learner": ("learner",), "env-server": ("env", "serve")}
STEP_PREFIX = "step "
STOP_GRACE_S = 900.0  # the run's own clean stop is bounded by monitor.stop_timeout_s (600 s)
FIRST_STEP_TIMEOUT_S = 900.0  # a run that reports no learner step in this long is stopped: something is wrong


def victims(launcher_pid: int, role: str) -> list:
    """The run's processes of ``role`` (``horizonrl <role> ...``), by their command lines."""
    import psutil

    words = ROLES[role]
    found = []
    for child in psutil.Process(launcher_pid).children(recursive=True):
        try:
            cmdline = child.cmdline()
        except psutil.Error:
            continue
        if "horizonrl" in cmdline:
            tail = cmdline[cmdline.index("horizonrl") + 1:]
            if tuple(tail[:len(words)]) == words:
                found.append(child)
    return found


def run_once(config_path: Path, overrides: list[str], output_dir: Path, *, kill: str | None, every_s: float,
             duration_s: float, seed: int, from_start: bool = False) -> dict[str, Any]:
    """One run for at most ``duration_s`` after its first learner step (after its launch with ``from_start``),
    killing ``kill`` processes if given; its summary."""
    output_dir.mkdir(parents=True, exist_ok=False)
    log_path = output_dir / "chaos-train.log"
    args = [sys.executable, "-m", "horizonrl", "train", str(config_path), *overrides, f"run.output_dir={output_dir}"]
    rng = random.Random(seed)
    kills: list[dict[str, Any]] = []
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            if not from_start:
                _wait_for_first_step(proc, log_path)
            start = time.monotonic()
            next_kill = start + rng.uniform(0.5, 1.5) * every_s
            while proc.poll() is None and time.monotonic() - start < duration_s:
                if kill is not None and time.monotonic() >= next_kill:
                    kills.append(_kill_one(proc.pid, kill, rng, start))
                    next_kill = time.monotonic() + rng.uniform(0.5, 1.5) * every_s
                time.sleep(0.25)
            elapsed = time.monotonic() - start
            finished = proc.poll() is not None
            if not finished:
                print(f"[chaos] {duration_s:.0f} s are up: stopping the run (Ctrl-C: it saves a checkpoint)", flush=True)
                os.kill(proc.pid, signal.SIGINT)
            rc = proc.wait(timeout=STOP_GRACE_S)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return summarize(output_dir, log_path, kills, elapsed, rc, finished)


def reported_steps(log_path: Path) -> list[int]:
    """The learner steps the run's console reported (``step N/TOTAL | ...`` lines)."""
    return [int(line.split()[1].split("/")[0]) for line in log_path.read_text(errors="replace").splitlines()
            if line.startswith(STEP_PREFIX) and "/" in line.split()[1]]


def _wait_for_first_step(proc: subprocess.Popen, log_path: Path, timeout_s: float = FIRST_STEP_TIMEOUT_S) -> None:
    """Until the run reports a learner step (or ends by itself); a run that reports none in ``timeout_s`` is an
    error (the caller stops it)."""
    print("[chaos] waiting for the run's first learner step before the kills begin", flush=True)
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and not reported_steps(log_path):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the run reported no learner step within {timeout_s:.0f} s; see {log_path} and the "
                               f"logs beside it")
        time.sleep(0.5)


def _kill_one(launcher_pid: int, role: str, rng: random.Random, start: float) -> dict[str, Any]:
    import psutil

    found = victims(launcher_pid, role)
    if not found:
        print(f"[chaos] t={time.monotonic() - start:6.1f} s: no {role} process alive to kill (still restarting?)",
              flush=True)
        return {"t_s": round(time.monotonic() - start, 1), "pid": None}
    victim = rng.choice(found)
    try:
        victim.kill()
    except psutil.Error:
        pass
    at = time.monotonic() - start
    print(f"[chaos] t={at:6.1f} s: kill -9 {role} pid {victim.pid}", flush=True)
    return {"t_s": round(at, 1), "pid": victim.pid, "at": time.time()}


def summarize(output_dir: Path, log_path: Path, kills: list[dict], elapsed_s: float, rc: int,
              finished: bool) -> dict[str, Any]:
    from horizonrl.buffer.accounting import account

    reported = reported_steps(log_path)
    faults_path = output_dir / "faults.jsonl"
    faults = [json.loads(line) for line in faults_path.read_text().splitlines()] if faults_path.exists() else []
    recovery = [f["recovery_s"] for f in faults if f["event"] == "recovered"]
    ledger = account(output_dir)
    minutes = elapsed_s / 60
    return {
        "output_dir": str(output_dir),
        "exit_code": rc,
        "finished_on_its_own": finished,
        "seconds": round(elapsed_s, 1),
        "kills": len([k for k in kills if k.get("pid")]),
        "deaths_seen": sum(f["event"] == "died" for f in faults),
        "restarts": sum(f["event"] == "restarted" for f in faults),
        "gave_up": sum(f["event"] == "gave_up" for f in faults),
        "recovery_s": recovery,
        "recovery_s_median": round(statistics.median(recovery), 1) if recovery else None,
        "learner_steps_reported": max(reported, default=0),
        "learner_steps_checkpointed": ledger["steps"],
        "steps_per_minute": round(max(reported, default=0) / minutes, 2) if minutes else 0.0,
        "trained_per_minute": round(ledger["trained_once"] / minutes, 1) if minutes else 0.0,
        "accounting": {k: (len(v) if isinstance(v, list) else v) for k, v in ledger.items()},
    }


def print_report(summary: dict[str, Any], baseline: dict[str, Any] | None) -> None:
    a = summary["accounting"]
    print(f"\n[chaos] {summary['output_dir']}: {summary['seconds']:.0f} s, exit code {summary['exit_code']}")
    print(f"  kills {summary['kills']}, deaths seen {summary['deaths_seen']}, restarts {summary['restarts']}, "
          f"gave up {summary['gave_up']}")
    if summary["recovery_s"]:
        r = summary["recovery_s"]
        # A replacement killed again while still starting never recovers: its time counts from the last death.
        unrecovered = max(summary["deaths_seen"] - len(r), 0)
        print(f"  time to recover: median {statistics.median(r):.1f} s, min {min(r):.1f} s, max {max(r):.1f} s "
              f"({len(r)} recoveries; {unrecovered} deaths not followed by a recovery: killed again while "
              f"starting, or the run stopped first)")
    print(f"  learner steps: {summary['learner_steps_reported']} reported, {summary['learner_steps_checkpointed']} in "
          f"the newest checkpoint ({summary['steps_per_minute']} per minute)")
    print(f"  trajectories: {a['accepted']} accepted, {a['trained_once']} trained once, dropped {a['dropped']}, "
          f"left out by the learner {a['learner_skipped']}, {a['held']} held, {a['not_yet_delivered']} still in outboxes")
    print(f"  lost {a['lost']}, trained twice {a['trained_twice']}, in two fates {a['in_two_fates']}")
    if baseline is not None:
        def ratio(key: str) -> str:
            return f"{summary[key] / baseline[key]:.2f}" if baseline[key] else "-"

        print(f"  vs. the same run without kills ({baseline['output_dir']}): steps/min {summary['steps_per_minute']} "
              f"vs {baseline['steps_per_minute']} (x{ratio('steps_per_minute')}), trained/min "
              f"{summary['trained_per_minute']} vs {baseline['trained_per_minute']} (x{ratio('trained_per_minute')})")


def main(config_path: Path, overrides: list[str], *, kill: str, every_s: float, duration_s: float, seed: int,
         baseline: bool, from_start: bool = False) -> int:
    from horizonrl.core.config import load_config

    config = load_config(config_path, overrides)  # a bad config fails here, before anything starts
    if not Path(config.model.path).exists():
        print(f"error: the model {config.model.path} does not exist (build it: `horizonrl make-tiny-model "
              f"{config.model.path}`, or run `horizonrl demo` once)", file=sys.stderr)
        return 2
    output_dir = config.output_dir
    for path in (output_dir, output_dir.with_name(output_dir.name + "-baseline") if baseline else None):
        if path is not None and path.exists():
            print(f"error: {path} exists; choose another run.output_dir", file=sys.stderr)
            return 2
    base = None
    if baseline:
        print(f"[chaos] baseline: the same run for {duration_s:.0f} s without kills", flush=True)
        base = run_once(config_path, overrides, output_dir.with_name(output_dir.name + "-baseline"), kill=None,
                        every_s=every_s, duration_s=duration_s, seed=seed, from_start=from_start)
    print(f"[chaos] kill -9 of a process of kind {kill!r} every ~{every_s:.0f} s for {duration_s:.0f} s", flush=True)
    summary = run_once(config_path, overrides, output_dir, kill=kill, every_s=every_s, duration_s=duration_s,
                       seed=seed, from_start=from_start)
    print_report(summary, base)
    (output_dir / "chaos_summary.json").write_text(json.dumps({"chaos": summary, "baseline": base}, indent=1) + "\n")
    clean = summary["accounting"]["lost"] == 0 and summary["accounting"]["trained_twice"] == 0
    return 0 if clean and summary["gave_up"] == 0 else 1
