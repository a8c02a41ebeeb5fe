"""What a person sees at the terminal during `horizonrl train`: the run's status block and one line for what
goes wrong (here an actor killed mid-run), no vLLM log lines, no learner step printed twice — while every
process's output, vLLM's included, still lands in ``<output_dir>/logs/``.

The run's stdout and stderr are a pseudo-terminal, as in `make demo`; the screen is rebuilt from what was
written to it (the live block is redrawn in place, so the raw stream holds every redraw).
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import signal
import struct
import subprocess
import termios
import time
from pathlib import Path

import psutil
import pytest
from helpers import horizonrl_cmd, stop_process

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "signpost_test.yaml"
TOTAL = 6  # the buffer holds 2 steps when actor 1 dies after step 1: steps 4-6 report its death
ROWS, COLUMNS = 50, 160
RUN_TIMEOUT_S = 600
# vLLM's log format, with or without its process prefix: "(EngineCore pid=7) INFO 11-25 03:36:35 [core.py:133] ..."
VLLM_RECORD = re.compile(r"(DEBUG|INFO|WARNING|ERROR) \d\d-\d\d \d\d:\d\d:\d\d \[|\((EngineCore|Worker|VllmWorker|"
                         r"MainProcess)[^)]*pid=")
# What the console writes: text, newlines, carriage returns, cursor up, clear to the end of the screen.
TOKEN = re.compile(r"\x1b\[\d*[AJ]|\r|\n|[^\x1b\r\n]+")


def screen_after(raw: str) -> list[str]:
    """The terminal's lines after ``raw`` (scrolled-off lines kept), for the codes the console writes."""
    tokens = TOKEN.findall(raw)
    assert "".join(tokens) == raw, "the console wrote an escape code it should not"
    rows, row, col = [""], 0, 0
    for token in tokens:
        if token == "\n":
            row, col = row + 1, 0  # the terminal's line discipline adds a \r to each \n anyway
            rows += [""] * (row + 1 - len(rows))
        elif token == "\r":
            col = 0
        elif token.endswith("A"):
            row = max(0, row - int(token[2:-1] or 1))
        elif token.endswith("J"):
            rows[row] = rows[row][:col]
            del rows[row + 1:]
        else:
            rows[row] = rows[row][:col] + token + rows[row][col + len(token):]
            col += len(token)
    return rows[:-1] if rows[-1] == "" else rows


def actor_process(launcher_pid: int, index: int) -> psutil.Process | None:
    for child in psutil.Process(launcher_pid).children(recursive=True):
        try:
            cmdline = child.cmdline()
        except psutil.Error:
            continue
        if "horizonrl" in cmdline and "actor" in cmdline and cmdline[-2:] == ["--index", str(index)]:
            return child
    return None


def run_on_a_terminal(args: list[str], on_output, timeout_s: float) -> tuple[int, str]:
    """Run ``args`` with a pseudo-terminal as stdout and stderr; ``on_output(pid, text so far)`` after each read."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", ROWS, COLUMNS, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "VLLM_LOGGING_LEVEL")}
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, start_new_session=True,
                            env={**env, "PYTHONUNBUFFERED": "1", "TERM": "xterm"})
    os.close(slave)
    data = bytearray()
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: every writer closed the terminal
                    chunk = b""
                if not chunk:
                    break
                data += chunk
                on_output(proc.pid, data.decode(errors="replace"))
            elif proc.poll() is not None:
                break
        else:
            pytest.fail(f"the run did not end within {timeout_s:.0f} s:\n" + data.decode(errors="replace")[-5000:])
        rc = proc.wait(timeout=60)
    finally:
        stop_process(proc)
        os.close(master)
    return rc, data.decode(errors="replace")


def test_the_console_shows_the_status_block_and_what_went_wrong_and_the_logs_keep_everything(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    killed: list[int] = []

    def kill_an_actor_after_the_first_step(launcher_pid: int, text: str) -> None:
        if not killed and f"step 1/{TOTAL}" in text:
            victim = actor_process(launcher_pid, 1)
            if victim is not None:
                victim.send_signal(signal.SIGKILL)
                killed.append(victim.pid)

    rc, raw = run_on_a_terminal(horizonrl_cmd("train", str(CONFIG), f"model.path={tiny_model}",
                                              f"run.output_dir={run_dir}", f"learner.total_steps={TOTAL}"),
                                kill_an_actor_after_the_first_step, RUN_TIMEOUT_S)
    screen = screen_after(raw)
    (tmp_path / "screen.txt").write_text("\n".join(screen) + "\n")  # what the person saw, for a failure's report
    shown = "\n".join(screen)
    assert rc == 0 and killed, shown

    # The status block, left on the screen at the end: the last step, with every field.
    block = screen[-5:]
    assert block[0].startswith(f"run signpost-test | finished | step {TOTAL}/{TOTAL} [") and "ETA" in block[0], shown
    assert re.match(r"  reward \d\.\d\d \| success \d\.\d\d \| turns \d\.\d of budget 2 \| staleness \d\.\d\d$",
                    block[1]), shown
    assert re.match(r"  tokens/s rollout [\d,]+ learner [\d,]+ \| step [\d.]+ s \| buffer \d+/16 groups, dropped \d+$",
                    block[2]), shown
    assert re.match(r"  in flight \d+ groups \| KV cache \d+% \| preempted \d+$", block[3]), shown
    assert block[4].startswith("  faults: actor died 1"), shown
    # Each learner step shows once, in the block; the learner's own step lines stay in its log.
    assert [line for line in screen if re.search(rf"step \d+/{TOTAL}", line)] == [block[0]], shown
    assert not re.search(r"step \d+: loss", raw), shown
    # The actor's death: one line, from the launcher that restarted it.
    died = [line for line in screen if "actor-1 exited with code -9" in line]
    assert len(died) == 1 and "[launcher] WARNING" in died[0] and "restarting it" in died[0], shown
    # Nothing of vLLM, anywhere in what was written (scrolled-off lines and overwritten redraws included).
    assert not VLLM_RECORD.search(raw), [line for line in raw.splitlines() if VLLM_RECORD.search(line)][:5]
    # Above the block: the run's header, then only lines that say something is wrong, one each.
    assert screen[0].startswith("run signpost-test: 2 actors"), shown
    problem = re.compile(r"\d\d:\d\d:\d\d \[[\w-]+\] (WARNING |ERROR |CRITICAL |vLLM ERROR |vLLM CRITICAL |error: "
                         r"|[\w.]*(Error|Exception|Exit|Interrupt)\b)")
    assert all(problem.match(line) for line in screen[1:-5]), shown

    logs = run_dir / "logs"
    assert VLLM_RECORD.search((logs / "actor-0.log").read_text(errors="replace"))  # vLLM's lines went to the log
    assert re.search(r"learner-0\[\d+\] INFO", (logs / "learner-0.log").read_text(errors="replace"))
    assert f'status {{"step":{TOTAL},"total":{TOTAL}' in (logs / "coordinator.log").read_text(errors="replace")
    launcher_log = (logs / "launcher.log").read_text(errors="replace")
    assert "started coordinator" in launcher_log and "actor-1 exited with code -9" in launcher_log
