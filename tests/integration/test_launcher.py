"""The launcher stops every process it started — on a process's failure and on Ctrl-C."""

import os
import signal
import time
from pathlib import Path

import pytest
from helpers import horizonrl_cmd, start_process, stop_process, wait_until

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "signpost_test.yaml"


def processes_mentioning(text: str) -> list[int]:
    """Pids whose command line or environment names ``text`` (read-only scan of /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(int(entry.name))
    return found


def test_a_failing_process_stops_the_run_with_nonzero_exit(tmp_path):
    run_dir = tmp_path / "bad"
    proc = start_process(horizonrl_cmd("train", str(CONFIG), f"model.path={tmp_path / 'no-such-model'}",
                                       f"run.output_dir={run_dir}"), tmp_path / "bad.log")
    try:
        rc = proc.wait(timeout=240)
    finally:
        stop_process(proc)
    log = (tmp_path / "bad.log").read_text()
    assert rc != 0, log[-3000:]
    assert "exited with code" in log
    assert processes_mentioning(str(run_dir)) == []  # no orphans: actors, engines, learner all gone


def test_ctrl_c_stops_everything_cleanly(tiny_model, tmp_path):
    run_dir = tmp_path / "interrupted"
    log_path = tmp_path / "interrupted.log"
    proc = start_process(horizonrl_cmd("train", str(CONFIG), f"model.path={tiny_model}", f"run.output_dir={run_dir}"),
                         log_path)
    try:
        wait_until(lambda: "step 1/" in log_path.read_text(), 300, "the first learner step")
        assert len(processes_mentioning(str(run_dir))) >= 5  # coordinator, buffer, learner, 2 actors
        os.kill(proc.pid, signal.SIGINT)
        rc = proc.wait(timeout=120)
    finally:
        stop_process(proc)
    assert rc == 130, log_path.read_text()[-3000:]
    time.sleep(1)
    assert processes_mentioning(str(run_dir)) == []
