"""What happened in a run, for programs: one JSON object per line in ``<output_dir>/events.jsonl``.

The console and the logs are for people and change wording freely; this file is the contract for
whatever reads a run while it goes (tests, ``horizonrl chaos``, scripts). Every line has ``time``
(Unix seconds), ``event`` (a ``RunEvent`` value), ``role`` (the process that wrote it: ``learner-0``,
``buffer``, ``launcher``, ...), ``pid``, and the fields that event names below.

Several processes append to the same file. Each line goes out in one ``write`` on a descriptor opened
with ``O_APPEND``, so lines never interleave on a local file system; a process killed mid-write can
leave a torn last line, which ``read_events`` skips. A run does not stop because its event file cannot be
written (a full or read-only disk): the failure is logged once per outage, and the events that could not
be written are kept (up to ``BACKLOG_LINES``) and written, in order, as soon as the file takes a line
again, so the events of an outage reach the file after it.

Bottom layer: no torch, no vllm.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from enum import Enum
from pathlib import Path
from typing import Any, Iterator

from horizonrl.core.run_dirs import RunDir


log = logging.getLogger("horizonrl.events")

BACKLOG_LINES = 10_000  # events kept while the file refuses them (an outage of minutes holds far fewer)


class RunEvent(str, Enum):
    """Every kind of event and the fields it carries (besides time, event, role, pid)."""

    # learner rank 0
    LEARNER_STARTED = "learner_started"  # ranks, backend, resumed_step, epoch: set up, about to train
    STEP_TRAINED = "step_trained"  # step: the optimizer step is done; its report and weights follow
    STEP_DONE = "step_done"  # step, weights_sent (bool): the step's weights were handed to the hub (or not due)
    CHECKPOINT_WRITTEN = "checkpoint_written"  # step, path
    BROADCAST_ABANDONED = "broadcast_abandoned"  # version: a stop gave up on engines that did not take it
    LEARNER_DONE = "learner_done"  # step, stopped_early (bool), checkpoint, weights_dropped (engines the hub dropped)
    # buffer
    BUFFER_FULL = "buffer_full"  # ready_groups: intake paused
    BUFFER_HAS_ROOM = "buffer_has_room"  # ready_groups: intake resumed
    BUFFER_RECOVERED = "buffer_recovered"  # records: the write-ahead log was read back at start
    # actor
    ENGINE_READY = "engine_ready"  # actor (index), weights: the engine started, took its first weights, plays
    EPISODE_FAILED = "episode_failed"  # actor, env, task, failure (kind), message: not the agent's fault, not trained
    # any process the local launcher started
    LAUNCHER_GONE = "launcher_gone"  # launcher_pid: its launcher died; this process stops itself
    # launcher (the last four as it tells the coordinator, which also counts them in faults.jsonl)
    PROCESS_STARTED = "process_started"  # name, pid
    PROCESS_PLACED = "process_placed"  # name, node, resources: where Ray placed it (launcher.type=ray)
    RUN_STOPPING = "run_stopping"  # reason
    PROCESS_DIED = "process_died"  # name, exit_code: exited before the run was over
    PROCESS_RESTARTED = "process_restarted"  # name, restarts, delay_s: a replacement was started
    PROCESS_RECOVERED = "process_recovered"  # name: a restarted server answers again
    PROCESS_GAVE_UP = "process_gave_up"  # name: past the restart limit; the run stops
    # any process: a write the disk refused (full, read-only) and, for the writes the run cannot do without (the
    # buffer's log, a checkpoint), retried: path, error, critical (bool; False: what was refused is dropped,
    # counted). WRITE_RECOVERED: path, retries, outage_s: the disk takes that file's writes again.
    WRITE_FAILED = "write_failed"
    WRITE_RECOVERED = "write_recovered"
    # coordinator
    ENDPOINTS_REGISTERED = "endpoints_registered"  # name, endpoints: what a process serves, where
    TRAINING_ENDED_EARLY = "training_ended_early"  # step, reason
    HELD_OUT_EVALUATED = "held_out_evaluated"  # step, success_rate
    # restarts, step, weight_epoch: a restarted coordinator read its state
    COORDINATOR_RESTORED = "coordinator_restored"
    LEARNER_DONE_FROM_DISK = "learner_done_from_disk"  # step: a restarted coordinator found the learner's end here
    PORT_TAKEN = "port_taken"  # endpoint: another process holds one of its ports; it tries again with back-off


class EventLog:
    """The writer one process keeps for its run's event file."""

    def __init__(self, output_dir: str | Path, role: str) -> None:
        self.path = RunDir(output_dir).events
        self.role = role
        self._lock = threading.Lock()
        self._failed = False
        self._backlog: deque[bytes] = deque(maxlen=BACKLOG_LINES)  # lines the file refused, oldest first

    def emit(self, event: RunEvent, **fields: Any) -> None:
        record = {"time": round(time.time(), 3), "event": RunEvent(event).value, "role": self.role,
                  "pid": os.getpid(), **fields}
        with self._lock:
            self._backlog.append((json.dumps(record, default=str) + "\n").encode())
            self._write_backlog()

    def retry(self) -> None:
        """Write what the file refused before, if anything (a loop calls it now and then)."""
        if self._backlog:
            with self._lock:
                self._write_backlog()

    def _write_backlog(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                while self._backlog:  # one write per line: lines of several processes never interleave
                    line = self._backlog[0]
                    written = os.write(fd, line)
                    if written < len(line):  # the disk filled mid-line: the rest goes first next time
                        self._backlog[0] = line[written:]
                        raise OSError(28, "No space left on device (a line written in part)")
                    self._backlog.popleft()
            finally:
                os.close(fd)
        except OSError as exc:
            if not self._failed:
                self._failed = True
                log.warning("cannot write %s (%s: %s); run events are kept and written when it takes them again",
                            self.path, type(exc).__name__, exc)
            return
        if self._failed:
            self._failed = False
            log.warning("run events are written to %s again", self.path)


class NullEventLog(EventLog):
    """For code run outside a run directory (benchmarks, unit tests): emits nothing."""

    def __init__(self) -> None:
        super().__init__(".", "none")

    def emit(self, event: RunEvent, **fields: Any) -> None:
        return None


def read_events(output_dir: str | Path, *kinds: RunEvent | str) -> list[dict[str, Any]]:
    """The events written so far, oldest first; only those of ``kinds`` when any are given."""
    return list(iter_events(output_dir, *kinds))


def iter_events(output_dir: str | Path, *kinds: RunEvent | str,
                tail_bytes: int | None = None) -> Iterator[dict[str, Any]]:
    """As :func:`read_events`; ``tail_bytes``: only the events in the file's last that many bytes (a reader
    that polls a long run's file for something recent)."""
    path = RunDir(output_dir).events
    try:
        with open(path, "rb") as events:
            size = events.seek(0, os.SEEK_END)
            if tail_bytes is not None and size > tail_bytes:
                events.seek(size - tail_bytes)
                events.readline()  # the rest of a line that started before the tail
            else:
                events.seek(0)
            data = events.read()
    except (FileNotFoundError, NotADirectoryError):
        return
    wanted = {RunEvent(kind).value for kind in kinds}
    for line in data.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line torn by a process killed while writing it
        if isinstance(record, dict) and (not wanted or record.get("event") in wanted):
            yield record
