"""A bound on the time of one learner step, and on how long a stop signal waits for one.

The learner checks for a stop at its phase boundaries; a step runs inside torch's kernels for its whole
length, and Python runs a signal's handler only when the main thread comes back to the interpreter. So a
step that cannot finish — a batch far beyond what the run was sized for, a collective whose peer hangs —
would hold the learner, and the run's shutdown with it, for as long as it lasts. The watchdog, a thread,
ends the process instead:

- a step running past ``learner.step_timeout_s`` is an error: the learner exits non-zero, and the launcher
  restarts it from its newest checkpoint (the buffer takes the step's batch back);
- a step still running ``monitor.stop_timeout_s / 2`` after a stop signal is abandoned: the learner exits
  without saving (the newest checkpoint stays the newest), within its share of the launcher's grace.

It hears SIGTERM/SIGINT through ``signal.set_wakeup_fd``, which the interpreter's C-level handler writes to
at once, while the main thread is still inside a kernel.
"""

from __future__ import annotations

import logging
import select
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

log = logging.getLogger("horizonrl.learner")

POLL_S = 0.5
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
EXIT_CODE = 1


def _exit_now(reason: str) -> None:
    from horizonrl.core.runtime import exit_skipping_finalization

    log.error("%s: exiting now", reason)
    exit_skipping_finalization(EXIT_CODE)


class StepWatchdog:
    def __init__(self, step_timeout_s: float, stop_grace_s: float, *,
                 on_expire: Callable[[str], None] = _exit_now, clock: Callable[[], float] = time.monotonic) -> None:
        self.step_timeout_s = step_timeout_s
        self.stop_grace_s = stop_grace_s
        self.on_expire = on_expire
        self.clock = clock
        self._step: tuple[int, float] | None = None  # (the step's number, when it started)
        self._stop_at: float | None = None
        self._expired = False
        self._closed = threading.Event()
        self._wakeup: tuple[socket.socket, socket.socket] | None = None
        self._previous_fd = -1
        self._thread = threading.Thread(target=self._run, name="learner-step-watchdog", daemon=True)

    @classmethod
    def for_run(cls, config) -> "StepWatchdog":
        return cls(config.learner.step_timeout_s, config.monitor.stop_timeout_s / 2)

    def start(self) -> "StepWatchdog":
        """Listen for stop signals (from the main thread only: elsewhere they are the main loop's alone) and watch."""
        if threading.current_thread() is threading.main_thread():
            reader, writer = socket.socketpair()
            reader.setblocking(False)
            writer.setblocking(False)
            self._previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
            self._wakeup = (reader, writer)
        self._thread.start()
        return self

    @contextmanager
    def step(self, number: int) -> Iterator[None]:
        """The main loop's step ``number`` is running inside this block."""
        self._step = (number, self.clock())
        try:
            yield
        finally:
            self._step = None

    def stop_requested(self) -> None:
        if self._stop_at is None:
            self._stop_at = self.clock()

    def check(self) -> None:
        """Expire the running step when it is past a bound (at most once)."""
        current = self._step
        if current is None or self._expired:
            return
        number, started = current
        now = self.clock()
        if now - started > self.step_timeout_s:
            self._expire(f"learner step {number} has run {now - started:.0f} s, past learner.step_timeout_s="
                         f"{self.step_timeout_s:.0f} s (the launcher restarts the learner from its newest checkpoint)")
        elif self._stop_at is not None and now - max(self._stop_at, started) > self.stop_grace_s:
            self._expire(f"stop requested, and learner step {number} has not ended {self.stop_grace_s:.0f} s later "
                         "(monitor.stop_timeout_s / 2): abandoning it without a checkpoint (the newest one stays)")

    def _expire(self, reason: str) -> None:
        self._expired = True
        self.on_expire(reason)

    def _run(self) -> None:
        while not self._closed.is_set():
            if self._wakeup is None:
                self._closed.wait(POLL_S)
            elif select.select([self._wakeup[0]], [], [], POLL_S)[0]:
                self._read_signals()
            self.check()

    def _read_signals(self) -> None:
        try:
            data = self._wakeup[0].recv(64)
        except (BlockingIOError, OSError):
            return
        if any(number in STOP_SIGNALS for number in data):
            self.stop_requested()

    def close(self) -> None:
        self._closed.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if self._wakeup is not None and threading.current_thread() is threading.main_thread():
            signal.set_wakeup_fd(self._previous_fd)
            for sock in self._wakeup:
                sock.close()
            self._wakeup = None
