"""``horizonrl chaos CONFIG [key=value ...] FAULT --every SECONDS``: a training run under fire.

Starts ``horizonrl train CONFIG`` and, at random times (uniform between 0.5 and 1.5 x ``--every``), fires one
fault (``chaos_faults.py``) for ``--duration`` seconds (or until the run ends), counted from the run's first
learner step (its start-up — engines loading, the first batch — is not what is under fire; ``--from-start``
fires from the launch on). The fault is one of: ``--kill ROLE`` (``kill -9`` of an actor, the buffer, a
learner rank, a managed environment server or the coordinator), ``--freeze-engine SECONDS`` (``SIGSTOP`` of
an actor's engine, continued after that long), ``--storm N`` (N malformed or hostile messages to each socket
of the run) or ``--fill-disk SECONDS`` (the run directory's file system full for that long). Then it stops
the run with Ctrl-C (it writes its checkpoint) and prints what happened: what was fired, the deaths, restarts
and the time each replacement took to recover (``faults.jsonl``), learner steps (``events.jsonl``), what the
processes counted of a storm, and the accounting of every trajectory (trained once, dropped by reason, still
held, refused at the door, lost, trained twice). ``--baseline`` first runs the same config for the same time
without faults and prints the throughput ratio.
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

from horizonrl.apps.chaos_faults import (FakeJoin, FillDisk, Fault, FreezeEngine, KillProcess, MessageStorm,
                                        SquatCoordinator)
from horizonrl.core.programs import horizonrl_command
from horizonrl.core.run_dirs import RunDir
from horizonrl.core.run_events import RunEvent, read_events

STOP_GRACE_S = 900.0  # the run's own clean stop is bounded by monitor.stop_timeout_s (600 s)
FIRST_STEP_TIMEOUT_S = 900.0  # a run that reports no learner step in this long is stopped: something is wrong
ABORT_GRACE_S = 120.0  # chaos itself interrupted or failed: how long the launcher may take to stop the run


def run_once(config_path: Path, overrides: list[str], output_dir: Path, *, fault: Fault | None, every_s: float,
             duration_s: float, seed: int, from_start: bool = False) -> dict[str, Any]:
    """One run for at most ``duration_s`` after its first learner step (after its launch with ``from_start``),
    firing ``fault`` if given; its summary."""
    output_dir.mkdir(parents=True, exist_ok=False)
    log_path = RunDir(output_dir).chaos_log
    args = horizonrl_command("train", str(config_path), *overrides, f"run.output_dir={output_dir}")
    rng = random.Random(seed)
    fired: list[dict[str, Any]] = []
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            if not from_start:
                _wait_for_first_step(proc, output_dir, log_path)
            start = time.monotonic()
            next_fire = start + rng.uniform(0.5, 1.5) * every_s
            while proc.poll() is None and time.monotonic() - start < duration_s:
                if fault is not None:
                    fault.tick()
                    if time.monotonic() >= next_fire:
                        fired.append(_fire(fault, proc.pid, rng, start))
                        next_fire = time.monotonic() + rng.uniform(0.5, 1.5) * every_s
                time.sleep(0.25)
            elapsed = time.monotonic() - start
            finished = proc.poll() is not None
            if fault is not None:
                fault.end()  # an engine frozen or a disk full would hold the clean stop
            if not finished:
                print(f"[chaos] {duration_s:.0f} s are up: stopping the run (Ctrl-C: it saves a checkpoint)",
                      flush=True)
                os.kill(proc.pid, signal.SIGINT)
            rc = proc.wait(timeout=STOP_GRACE_S)
        finally:
            if fault is not None:
                fault.end()
            if proc.poll() is None:
                # The launcher stops its children (each in a session of its own: a SIGKILL of the launcher's group
                # alone would leave them running); only a launcher that does not stop in time is killed.
                os.kill(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=ABORT_GRACE_S)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
    summary = summarize(output_dir, fired, elapsed, rc, finished)
    if isinstance(fault, SquatCoordinator):
        summary["squat"] = {"reports_swallowed": fault.swallowed, "controls_forged": fault.forged,
                            "ports_squatted": sum(f.get("ports_squatted", 0) for f in fired)}
    if isinstance(fault, MessageStorm):
        summary["storm"] = {"sent": fault.sent, "counted": fault.counted()}
    return summary


def longest_learner_gap_s(output_dir: Path) -> float:
    """The longest time between two learner steps (``events.jsonl``'s step_done), from the first step on."""
    from horizonrl.core.run_events import RunEvent, read_events

    times = sorted(float(e["time"]) for e in read_events(output_dir, RunEvent.STEP_DONE))
    return round(max((b - a for a, b in zip(times, times[1:])), default=0.0), 1)


def learner_steps(output_dir: Path) -> int:
    """The newest learner step done in the run (``events.jsonl``)."""
    from horizonrl.core.run_events import RunEvent, read_events

    return max((int(e["step"]) for e in read_events(output_dir, RunEvent.STEP_DONE)), default=0)


def _wait_for_first_step(proc: subprocess.Popen, output_dir: Path, log_path: Path,
                         timeout_s: float = FIRST_STEP_TIMEOUT_S) -> None:
    """Until the run's first learner step (or its end); a run that makes none in ``timeout_s`` is an error (the
    caller stops it)."""
    print("[chaos] waiting for the run's first learner step before the faults begin", flush=True)
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and not learner_steps(output_dir):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the run made no learner step within {timeout_s:.0f} s; see {log_path} and the "
                               f"logs beside it")
        time.sleep(0.5)


def _fire(fault: Fault, launcher_pid: int, rng: random.Random, start: float) -> dict[str, Any]:
    outcome = fault.fire(launcher_pid, rng)
    at = time.monotonic() - start
    print(f"[chaos] t={at:6.1f} s: {outcome.get('did') or outcome.get('note')}", flush=True)
    return {"t_s": round(at, 1), "at": time.time(), **outcome}


def summarize(output_dir: Path, fired: list[dict], elapsed_s: float, rc: int, finished: bool) -> dict[str, Any]:
    from horizonrl.buffer.accounting import account

    steps = learner_steps(output_dir)
    faults_path = RunDir(output_dir).faults
    faults = [json.loads(line) for line in faults_path.read_text().splitlines()] if faults_path.exists() else []
    recovery = [f["recovery_s"] for f in faults if f["event"] == "recovered"]
    ledger = account(output_dir)
    minutes = elapsed_s / 60
    return {
        "output_dir": str(output_dir),
        "exit_code": rc,
        "finished_on_its_own": finished,
        "seconds": round(elapsed_s, 1),
        "fired": len([f for f in fired if f.get("did")]),
        "kills": len([f for f in fired if f.get("pid") and f["did"].startswith("kill")]),
        "deaths_seen": sum(f["event"] == "died" for f in faults),
        "restarts": sum(f["event"] == "restarted" for f in faults),
        # From the launcher's own events: a coordinator out of restarts cannot count its own end in faults.jsonl.
        "gave_up": len(read_events(output_dir, RunEvent.PROCESS_GAVE_UP)),
        "recovery_s": recovery,
        "recovery_s_median": round(statistics.median(recovery), 1) if recovery else None,
        "learner_steps_reported": steps,
        "longest_learner_gap_s": longest_learner_gap_s(output_dir),
        "learner_steps_checkpointed": ledger["steps"],
        "steps_per_minute": round(steps / minutes, 2) if minutes else 0.0,
        "trained_per_minute": round(ledger["trained_once"] / minutes, 1) if minutes else 0.0,
        "accounting": {k: (len(v) if isinstance(v, list) else v) for k, v in ledger.items()},
    }


def print_report(summary: dict[str, Any], baseline: dict[str, Any] | None) -> None:
    a = summary["accounting"]
    print(f"\n[chaos] {summary['output_dir']}: {summary['seconds']:.0f} s, exit code {summary['exit_code']}")
    print(f"  fired {summary['fired']} (kills {summary['kills']}), deaths seen {summary['deaths_seen']}, restarts "
          f"{summary['restarts']}, gave up {summary['gave_up']}")
    if summary["recovery_s"]:
        r = summary["recovery_s"]
        # A replacement killed again while still starting never recovers: its time counts from the last death.
        unrecovered = max(summary["deaths_seen"] - len(r), 0)
        print(f"  time to recover: median {statistics.median(r):.1f} s, min {min(r):.1f} s, max {max(r):.1f} s "
              f"({len(r)} recoveries; {unrecovered} deaths not followed by a recovery: killed again while "
              f"starting, or the run stopped first)")
    print(f"  learner steps: {summary['learner_steps_reported']} reported, {summary['learner_steps_checkpointed']} in "
          f"the newest checkpoint ({summary['steps_per_minute']} per minute); longest gap between two steps "
          f"{summary['longest_learner_gap_s']:.1f} s")
    if "squat" in summary:
        squat = summary["squat"]
        print(f"  squatter: bound {squat['ports_squatted']} ports, forged {squat['controls_forged']} Controls, "
              f"swallowed {squat['reports_swallowed']} reports")
    print(f"  trajectories: {a['accepted']} accepted, {a['trained_once']} trained once, dropped {a['dropped']}, "
          f"left out by the learner {a['learner_skipped']}, {a['held']} held, {a['not_yet_delivered']} still in "
          "outboxes")
    print(f"  refused at the buffer's door, by reason: {a['rejected_at_the_door']}")
    print(f"  lost {a['lost']}, trained twice {a['trained_twice']}, in two fates {a['in_two_fates']}")
    if "storm" in summary:
        print(f"  storm: sent {summary['storm']['sent']}; counted as bad or rejected {summary['storm']['counted']}")
    if baseline is not None:
        def ratio(key: str) -> str:
            return f"{summary[key] / baseline[key]:.2f}" if baseline[key] else "-"

        print(f"  vs. the same run without faults ({baseline['output_dir']}): steps/min {summary['steps_per_minute']} "
              f"vs {baseline['steps_per_minute']} (x{ratio('steps_per_minute')}), trained/min "
              f"{summary['trained_per_minute']} vs {baseline['trained_per_minute']} (x{ratio('trained_per_minute')})")


def make_fault(output_dir: Path, *, kill: str | None = None, freeze_engine_s: float | None = None,
               storm: int | None = None, fill_disk_s: float | None = None, fill_max_gb: float = 4.0,
               squat_coordinator_s: float | None = None, fake_join: int | None = None) -> Fault:
    """The one fault a chaos run fires (the command line makes them exclusive)."""
    if squat_coordinator_s is not None:
        return SquatCoordinator(squat_coordinator_s, output_dir)
    if fake_join is not None:
        return FakeJoin(fake_join, output_dir)
    if kill is not None:
        return KillProcess(kill)
    if freeze_engine_s is not None:
        return FreezeEngine(freeze_engine_s)
    if storm is not None:
        return MessageStorm(storm, output_dir)
    if fill_disk_s is not None:
        return FillDisk(fill_disk_s, output_dir, int(fill_max_gb * 2**30))
    raise ValueError("no fault given: --kill, --freeze-engine, --storm, --fill-disk, --squat-coordinator or "
                     "--fake-join")


def main(config_path: Path, overrides: list[str], *, every_s: float, duration_s: float, seed: int, baseline: bool,
         from_start: bool = False, **fault_settings) -> int:
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
    fault = make_fault(output_dir, **fault_settings)
    if isinstance(fault, FillDisk):
        try:
            output_dir.parent.mkdir(parents=True, exist_ok=True)
            FillDisk(0, output_dir.parent, fault.max_bytes).check()
        except (OSError, ValueError) as exc:
            print(f"error: --fill-disk: {exc}", file=sys.stderr)
            return 2
    base = None
    if baseline:
        print(f"[chaos] baseline: the same run for {duration_s:.0f} s without faults", flush=True)
        base = run_once(config_path, overrides, output_dir.with_name(output_dir.name + "-baseline"), fault=None,
                        every_s=every_s, duration_s=duration_s, seed=seed, from_start=from_start)
    print(f"[chaos] {fault.what} every ~{every_s:.0f} s for {duration_s:.0f} s", flush=True)
    summary = run_once(config_path, overrides, output_dir, fault=fault, every_s=every_s, duration_s=duration_s,
                       seed=seed, from_start=from_start)
    print_report(summary, base)
    RunDir(output_dir).chaos_summary.write_text(json.dumps({"chaos": summary, "baseline": base}, indent=1) + "\n")
    clean = summary["accounting"]["lost"] == 0 and summary["accounting"]["trained_twice"] == 0
    # A storm or a full disk must not cost a process; a kill or a freeze is answered by restarts, within the limits.
    survived = summary["deaths_seen"] == 0 or isinstance(fault, (KillProcess, FreezeEngine, SquatCoordinator))
    return 0 if clean and survived and summary["gave_up"] == 0 else 1
