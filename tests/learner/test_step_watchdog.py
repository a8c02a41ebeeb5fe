"""A learner step is bounded in time, and a stop signal ends the learner within its grace even when the
step is inside a kernel that never returns to the interpreter (learner/step_watchdog.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from helpers import ManualClock

from horizonrl.learner.step_watchdog import EXIT_CODE, StepWatchdog


def test_a_step_past_its_timeout_expires_once_and_nothing_expires_between_steps():
    clock, expired = ManualClock(100.0), []
    watchdog = StepWatchdog(step_timeout_s=60, stop_grace_s=10, on_expire=expired.append, clock=clock)
    with watchdog.step(1):
        clock.now += 59
        watchdog.check()
        assert expired == []
    clock.now += 1000  # between steps (waiting for a batch, saving): not the watchdog's business
    watchdog.check()
    assert expired == []
    with watchdog.step(2):
        clock.now += 61
        watchdog.check()
        watchdog.check()
    assert len(expired) == 1 and "learner step 2" in expired[0] and "step_timeout_s" in expired[0]


def test_a_stop_gives_the_running_step_its_grace_counted_from_the_stop_or_the_steps_start():
    clock, expired = ManualClock(100.0), []
    watchdog = StepWatchdog(step_timeout_s=3600, stop_grace_s=10, on_expire=expired.append, clock=clock)
    watchdog.stop_requested()
    clock.now += 100  # the stop came while no step ran; a step started now still gets its whole grace
    with watchdog.step(7):
        clock.now += 9
        watchdog.check()
        assert expired == []
        clock.now += 2
        watchdog.check()
    assert len(expired) == 1 and "stop requested" in expired[0] and "step 7" in expired[0]


STUCK_STEP = r"""
import hashlib, logging, signal, sys, threading
from horizonrl.learner.step_watchdog import StepWatchdog
logging.basicConfig(level=logging.INFO)
stop = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: stop.set())  # the learner's own handler: it only sets a flag
watchdog = StepWatchdog(step_timeout_s=3600, stop_grace_s=1.0).start()
with watchdog.step(1):
    print("in the step", flush=True)
    # one C call that does not come back to the interpreter for minutes, as a huge forward pass would not
    hashlib.pbkdf2_hmac("sha256", b"x", b"y", 2**31 - 1)
print("the step ended", flush=True)
"""


def test_sigterm_ends_a_learner_stuck_in_a_kernel_within_its_grace():
    proc = subprocess.Popen([sys.executable, "-c", STUCK_STEP], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "in the step"
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)  # the grace is 1 s; the kernel alone would run for many minutes
        took = time.monotonic() - sent
        errors = proc.stderr.read()
        assert rc == EXIT_CODE and "stop requested, and learner step 1 has not ended" in errors, errors
        assert 1.0 <= took < 30, took
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
