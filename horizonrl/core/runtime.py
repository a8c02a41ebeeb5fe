"""What every process does the same way: logging, stop signals, timed phases.

Bottom layer (no torch, no vllm), shared by all processes.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator


def setup_logging(role: str, level: str = "INFO") -> logging.Logger:
    """One line per record, prefixed with the role and pid so interleaved logs stay readable."""
    logging.basicConfig(
        level=getattr(logging, level),
        format=f"%(asctime)s {role}[{os.getpid()}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
        force=True,
    )
    return logging.getLogger(f"horizonrl.{role.split('-')[0]}")


def exit_skipping_finalization(code: int) -> None:
    """Flush what the process wrote, then leave at once (``os._exit``), without interpreter finalization.

    For processes that ran torch.distributed collectives over gloo: at finalization gloo's worker
    threads may still hold work objects whose destruction needs the interpreter, and the process then
    aborts (``terminate called without an active exception``, SIGABRT) after it finished its work —
    which its parent would take for a failure. Call it only when everything (files, process groups,
    sockets) is closed."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


class StopFlag:
    """Set by SIGINT/SIGTERM; loops check it at phase boundaries and exit cleanly. ``count`` says how
    many stop signals came (a second Ctrl-C asks to force)."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.signal_name = ""
        self.count = 0

    def install(self) -> "StopFlag":
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, _frame) -> None:
        self.request(signal.Signals(signum).name)

    def request(self, signal_name: str) -> None:
        """What a stop signal does, without one: a process that runs its roles as threads (the inline launcher)
        stops a role with this."""
        self.signal_name = signal_name
        self.count += 1
        self._event.set()

    def set(self) -> None:
        self._event.set()

    def is_set(self) -> bool:  # a threading.Event's name for it: the learner takes either
        return self._event.is_set()

    def __bool__(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float) -> bool:
        return self._event.wait(timeout)


# Set by the local launcher in each process it starts: its own pid, which that process watches.
LAUNCHER_PID_ENV = "HORIZONRL_LAUNCHER_PID"


def stop_when_launcher_dies(on_gone: Callable[[int], None] | None = None, *, log_path: str | os.PathLike | None = None,
                            grace_s: float = 60.0, poll_s: float = 0.2) -> threading.Thread | None:
    """A process the launcher started ends with its launcher, however the launcher died.

    Each process runs in a process group of its own (so that stopping it stops its vLLM engine), so a
    SIGKILLed launcher cannot take them with it, and nothing else would stop them: orphans that go on
    holding cores, ports and memory. Once ``getppid()`` is no longer the launcher's pid (in
    ``HORIZONRL_LAUNCHER_PID``; the process was re-parented), this sends SIGTERM to its own process: the
    clean stop every role already has. Past ``grace_s`` it kills its process group (itself and what it
    spawned). ``on_gone(launcher_pid)`` runs first (a structured event). The launcher read this process's
    output into its log: from then on the process appends it to ``log_path`` itself (else its stop would
    write into a broken pipe).

    Does nothing, and returns None, for a process started some other way (by hand, Slurm, Ray): the
    variable is not set. Removes the variable, so the processes this one starts do not watch a pid that
    is not their parent."""
    raw = os.environ.pop(LAUNCHER_PID_ENV, None)
    if not raw:
        return None
    launcher_pid = int(raw)

    def watch() -> None:
        while os.getppid() == launcher_pid:
            time.sleep(poll_s)
        if log_path is not None:
            try:
                fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                os.dup2(fd, 1)  # Python's sys.stdout and sys.stderr write to these descriptors
                os.dup2(fd, 2)
                os.close(fd)
            except OSError:
                pass  # no log then; the stop goes on
        logging.getLogger("horizonrl").error(
            "the launcher (pid %d) is gone: stopping (SIGTERM to this process; killed in %.0f s if still running)",
            launcher_pid, grace_s)
        if on_gone is not None:
            try:
                on_gone(launcher_pid)
            except Exception:  # noqa: BLE001 - what it records must not keep the process from stopping
                logging.getLogger("horizonrl").exception("recording the launcher's death failed")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        logging.getLogger("horizonrl").error("still running %.0f s after the launcher died: killing this process "
                                             "and what it spawned", grace_s)
        logging.shutdown()
        if os.getpgrp() == os.getpid():
            os.killpg(0, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    thread = threading.Thread(target=watch, name="launcher-watch", daemon=True)
    thread.start()
    return thread


class PhaseTimer:
    """Named, timed phases of a main loop: ``with timer("rollout"): ...``; ``timer.seconds``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


class RateLimitedLog:
    """Log a recurring condition at most once per ``interval_s`` (with the count since)."""

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0) -> None:
        self._logger = logger
        self._interval = interval_s
        self._last = 0.0
        self._suppressed = 0

    def warning(self, msg: str, *args) -> None:
        self.log(logging.WARNING, msg, *args)

    def log(self, level: int, msg: str, *args) -> None:
        now = time.monotonic()
        if now - self._last >= self._interval:
            extra = f" (+{self._suppressed} similar)" if self._suppressed else ""
            self._logger.log(level, msg + extra, *args)
            self._last, self._suppressed = now, 0
        else:
            self._suppressed += 1


class BusyClock:
    """Wall time with at least one unit of work in flight vs none (e.g. an engine's idle time), and how many
    were in flight on average (an engine's occupancy: a decode step costs about the same for 1 request or 64,
    so generated tokens/s follow the number in flight).

    ``enter()`` / ``exit()`` bracket each unit (a generate request); ``idle_s`` is the time
    since creation (or ``reset``) with nothing in flight, ``busy_s`` the rest; ``unit_s`` the time
    integral of the number in flight (``unit_s / wall_s``: the mean). Single-threaded use (one event loop).
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._start = self._since = self._last = time.perf_counter()
        self._in_flight = 0
        self._idle = 0.0
        self._units = 0.0

    def _advance(self) -> float:
        now = time.perf_counter()
        self._units += self._in_flight * (now - self._last)
        self._last = now
        return now

    def enter(self) -> None:
        now = self._advance()
        if self._in_flight == 0:
            self._idle += now - self._since
        self._in_flight += 1

    def exit(self) -> None:
        now = self._advance()
        self._in_flight -= 1
        if self._in_flight == 0:
            self._since = now

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def idle_s(self) -> float:
        open_idle = time.perf_counter() - self._since if self._in_flight == 0 else 0.0
        return self._idle + open_idle

    @property
    def unit_s(self) -> float:
        return self._units + self._in_flight * (time.perf_counter() - self._last)

    @property
    def wall_s(self) -> float:
        return time.perf_counter() - self._start
