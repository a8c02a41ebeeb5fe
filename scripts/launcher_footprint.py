"""Start-up time and peak memory of one launch: ``python scripts/launcher_footprint.py -- horizonrl train ...``.

Runs the command (in its own process group, ended by pid afterwards), samples the proportional set size
(PSS: shared pages split between their users, so the sum is the memory the run really holds) of the
command and every process under it every ``--every`` seconds, and reports: seconds until the launcher
says every process is started (``--placed`` pattern), until the first learner step (``step 1/``), the
wall time, and the peak of the summed PSS with what held it at that moment, by process name. With
``launcher.type=ray`` and a Ray instance the launcher starts, Ray's own processes (GCS, raylet, the
actors' workers) are under the command too, so they are counted.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter

import psutil


def tree_pss(pid: int, match: str | None = None) -> tuple[int, Counter]:
    """Summed PSS of ``pid``'s tree, and (``match``) of every process whose command line holds ``match`` and its
    tree: a Slurm job's processes are slurmd's children, not the submitting command's."""
    roots = [pid]
    if match:
        for p in psutil.process_iter(["cmdline"]):
            try:
                if match in " ".join(p.info["cmdline"] or []):
                    roots.append(p.pid)
            except psutil.Error:
                continue
    procs: dict[int, psutil.Process] = {}
    for root_pid in roots:
        try:
            root = psutil.Process(root_pid)
            procs.update((q.pid, q) for q in (root, *root.children(recursive=True)))
        except psutil.Error:
            continue
    if not procs:
        return 0, Counter()
    total, by_name = 0, Counter()
    for p in procs.values():
        try:
            pss = p.memory_full_info().pss
            cmd = p.cmdline()
        except psutil.Error:
            continue
        total += pss
        by_name[_label(p.name(), cmd)] += pss
    return total, by_name


def _label(name: str, cmd: list[str]) -> str:
    if "horizonrl" in cmd:
        i = cmd.index("horizonrl")
        return "horizonrl " + (cmd[i + 1] if i + 1 < len(cmd) else "")
    return name


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=float, default=3.0)
    parser.add_argument("--placed", default=r"every process placed|started actor-\d+ \(pid|started learner-0",
                        help="regex of the log line that says the processes are started")
    parser.add_argument("--log", default="footprint.log")
    parser.add_argument("--json", default=None)
    parser.add_argument("--match", default=None, help="also count every process whose command line holds this "
                                                      "(and its tree): e.g. the run directory of a Slurm job")
    parser.add_argument("--first-step-file", default=None, help="look for the first step here too (a Slurm job's "
                                                                "coordinator log)")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = [c for c in args.command if c != "--"]
    if command[:1] == ["horizonrl"]:
        command = [sys.executable, "-m", "horizonrl", *command[1:]]
    start = time.monotonic()
    with open(args.log, "wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    peak, peak_by, placed_s, first_step_s = 0, Counter(), None, None
    try:
        while proc.poll() is None:
            total, by_name = tree_pss(proc.pid, args.match)
            if total > peak:
                peak, peak_by = total, by_name
            text = open(args.log, errors="replace").read()
            now = time.monotonic() - start
            if placed_s is None and re.search(args.placed, text):
                placed_s = now
            if args.first_step_file and os.path.exists(args.first_step_file):
                text += open(args.first_step_file, errors="replace").read()
            if first_step_s is None and re.search(r'^step 1/|"step":1,"total"', text, re.M):
                first_step_s = now
            time.sleep(args.every)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    result = {"command": " ".join(args.command), "exit_code": proc.returncode,
              "placed_s": placed_s, "first_step_s": first_step_s, "wall_s": round(time.monotonic() - start, 1),
              "peak_pss_mib": round(peak / 2**20), "load_avg_1m_at_end": os.getloadavg()[0],
              "peak_by_process_mib": {k: round(v / 2**20) for k, v in peak_by.most_common()}}
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
