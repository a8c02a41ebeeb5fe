"""A process the launcher started ends when its launcher dies (``core/runtime.py stop_when_launcher_dies``).

Real processes: a stand-in launcher starts a child as ``LocalProcesses`` does (its own session, the launcher's
pid in ``HORIZONRL_LAUNCHER_PID``), then is killed with SIGKILL. The child watches with the real function; what
it does when told to stop is the test's. The same behaviour with a whole run: tests/faults/test_fuzz.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from helpers import still_running, wait_until

from horizonrl.core.runtime import LAUNCHER_PID_ENV, stop_when_launcher_dies

# The child: watches its launcher, records what happened in a JSON file per line, and either stops at SIGTERM
# or ignores it (then the watcher's grace kills it and the process it spawned).
CHILD = textwrap.dedent("""
    import json, os, signal, subprocess, sys, time
    from horizonrl.core.runtime import LAUNCHER_PID_ENV, stop_when_launcher_dies

    out, ignore_term = sys.argv[1], sys.argv[2] == "ignore"

    def note(**fields):
        with open(out, "a") as f:
            f.write(json.dumps(fields) + "\\n")

    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    def on_term(*_):
        note(event="sigterm")
        print("child-output-after-the-launcher", flush=True)  # the pipe to the launcher is broken by now
        if not ignore_term:
            os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    watcher = stop_when_launcher_dies(lambda pid: note(event="gone", launcher_pid=pid), log_path=out + ".log",
                                      grace_s=1.0, poll_s=0.1)
    note(event="ready", pid=os.getpid(), grandchild=grandchild.pid, watching=watcher is not None,
         inherited=os.environ.get(LAUNCHER_PID_ENV))
    while True:
        time.sleep(0.1)
""")

# The stand-in launcher: starts the child in a session of its own with its pid to watch and its output on a
# pipe the launcher reads (as LocalProcesses does), then waits to be killed.
LAUNCHER = textwrap.dedent("""
    import os, subprocess, sys, time
    from horizonrl.core.runtime import LAUNCHER_PID_ENV
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2], sys.argv[3]], start_new_session=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             env={**os.environ, LAUNCHER_PID_ENV: str(os.getpid())})
    for line in child.stdout:
        pass
    time.sleep(600)
""")


def notes(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize("on_sigterm", ["stop", "ignore"])
def test_a_child_stops_itself_once_its_launcher_is_killed(tmp_path, on_sigterm):
    out = tmp_path / "child.jsonl"
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, CHILD, str(out), on_sigterm])
    child = grandchild = None
    try:
        ready = wait_until(lambda: [n for n in notes(out) if n["event"] == "ready"], 60, "the child to start")[0]
        # it watches, and the variable is gone from its environment: what it starts does not watch a stranger
        assert ready["watching"] and ready["inherited"] is None
        child, grandchild = psutil.Process(ready["pid"]), psutil.Process(ready["grandchild"])
        time.sleep(0.5)
        assert child.is_running() and child.ppid() == launcher.pid  # the launcher alive: nothing happens
        launcher.kill()
        launcher.wait(timeout=10)
        wait_until(lambda: not still_running(child), 30, "the child to stop after its launcher was killed")
        events = [n["event"] for n in notes(out)]
        assert events[1:3] == ["gone", "sigterm"], events
        assert notes(out)[1]["launcher_pid"] == launcher.pid
        # what it wrote once its launcher was gone went to its own log, not into the broken pipe
        assert "child-output-after-the-launcher" in (tmp_path / "child.jsonl.log").read_text()
        if on_sigterm == "ignore":  # killed after the grace, with its process group
            wait_until(lambda: not still_running(grandchild), 10, "the grace to kill what the child spawned too")
    finally:
        for p in (launcher, child, grandchild):
            try:
                if p is not None:
                    p.kill()
            except (psutil.Error, ProcessLookupError):
                pass
        if grandchild is not None:
            wait_until(lambda: not still_running(grandchild), 10, "the grandchild to be killed")


def test_a_process_not_started_by_the_launcher_watches_nothing(monkeypatch):
    monkeypatch.delenv(LAUNCHER_PID_ENV, raising=False)
    assert stop_when_launcher_dies(lambda pid: os.kill(os.getpid(), signal.SIGKILL)) is None
