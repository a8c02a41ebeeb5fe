"""Recorded episodes on disk: what the buffer (and evaluation) write, what ``horizonrl view`` reads.

The files are JSON Lines, append-only, readable with nothing but the standard library:
``<dir>/episodes-00000.jsonl``, ``episodes-00001.jsonl``, ... (a new file once one passes
``part_bytes``). Each line is one object with ``"kind"``:

- ``"episode"``: one finished episode. ``schema``, ``time`` (Unix seconds when recorded),
  ``run_id``, ``trajectory_id``, ``group_id`` (the GRPO group: the same task, the same turn
  budget), ``env``, ``task_id``, ``category``, ``actor_id``, ``success``, ``score`` (the
  environment's scale), ``reward`` (the episode's return), ``num_turns``, ``max_turns`` (the
  budget it ran under), ``stop_reason`` (done / max_turns / context_limit / failure),
  ``failure`` ("" or environment / engine / timeout / prompt_too_long / ...),
  ``failure_message``, ``evaluation`` (true for evaluation episodes), ``first_observation``
  (the task), and ``turns``: one object per turn with ``reply`` (the model's text), ``action``
  (what the reply names, "" when nothing), ``observation`` (the environment's answer; null when
  the episode failed before it came), ``reward`` (null likewise), ``version`` and ``epoch`` (the
  weights that generated the reply), ``sample`` (which of the episode's samples the turn is in:
  0 unless the chat template rewrites history or a context window started a new segment,
  ``Trajectory.sample_starts``); ``samples``: how many samples the episode was trained as;
  ``hidden_turns``: per sample, how many earlier turns its prompt does not show (0 but for a
  segment the context manager started, ``rollout.context.policy``); per turn ``summary``: true for
  the model's summaries of the episode (``rollout.context.policy: summarize``; no environment step,
  their ``observation`` is the message the next segment starts with).
- ``"trained"``: ``learner_step`` and the ``group_ids`` of the batch that step trained on
  (written when the batch is handed to the learner; a batch handed out again after a learner
  restart gets a newer line, and the last one holds).

Texts are cut to ``MAX_SAMPLE_TEXT`` characters. A line is written whole or not at all for
readers: a reader takes only lines that end with a newline.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Iterator

from horizonrl.protocol.messages import Trajectory

log = logging.getLogger("horizonrl.episode_records")

SCHEMA = 1
PART_BYTES = 64 * 1024 * 1024
PART_GLOB = "episodes-*.jsonl"


def episode_record(t: Trajectory, evaluation: bool = False) -> dict[str, Any]:
    """The ``"episode"`` line of a trajectory that carries its text."""
    if t.text is None:
        raise ValueError(f"trajectory {t.trajectory_id} carries no text to record")
    text = t.text
    turns = []
    sample_of_turn = [sum(start <= turn_start for start in t.sample_starts) for turn_start, _ in t.turn_spans]
    for i, reply in enumerate(text.replies):
        turns.append({
            "reply": reply,
            "action": text.actions[i],
            "observation": text.observations[i] if i < len(text.observations) else None,
            "reward": t.turn_rewards[i] if i < len(t.turn_rewards) else None,
            "version": t.turn_versions[i],
            "epoch": t.turn_epochs[i],
            "sample": sample_of_turn[i] if i < len(sample_of_turn) else 0,
            "summary": i in t.summary_turns,
        })
    return {
        "kind": "episode", "schema": SCHEMA, "time": round(time.time(), 3), "run_id": t.run_id,
        "trajectory_id": t.trajectory_id, "group_id": t.group_id, "env": t.env, "task_id": t.task_id,
        "category": t.category, "actor_id": t.actor_id, "success": t.success, "score": t.score, "reward": t.reward,
        "num_turns": t.num_turns, "max_turns": t.max_turns, "stop_reason": t.stop_reason, "failure": t.failure,
        "failure_message": t.failure_message, "evaluation": evaluation, "first_observation": text.first_observation,
        "turns": turns, "samples": len(t.sample_starts) + 1,
        "hidden_turns": [0, *(t.hidden_turns or [0] * len(t.sample_starts))],
    }


def trained_record(learner_step: int, group_ids: list[str]) -> dict[str, Any]:
    return {"kind": "trained", "schema": SCHEMA, "time": round(time.time(), 3), "learner_step": learner_step,
            "group_ids": list(group_ids)}


class EpisodeRecordWriter:
    """Appends record lines under ``directory``; stops (and says so once) past ``max_bytes``.

    The records are for people, so a disk that is full or read-only costs the lines it refuses, never the
    process that writes them: a failed write is counted (``write_failures``), said once per outage with the
    file's path, and its half-written line cut off again; the next line tries again (``RETRY_S`` later)."""

    RETRY_S = 5.0

    def __init__(self, directory: str | Path, max_bytes: float = float("inf"), part_bytes: int = PART_BYTES) -> None:
        self.directory = Path(directory)
        self.max_bytes, self.part_bytes = max_bytes, part_bytes
        self._file = None
        self.written = 0
        self.full = False
        self.write_failures = 0  # lines the disk refused (counted, not retried: they are for people)
        self._failing_since: float | None = None  # the outage's newest failure (monotonic), or None
        self._part, self.total_bytes = 0, 0
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            parts = sorted(self.directory.glob(PART_GLOB))
            self.total_bytes = sum(p.stat().st_size for p in parts)
            self._part = len(parts) - 1 if parts else 0  # a restarted writer appends to the newest part
        except OSError as exc:
            self._failing_since = -self.RETRY_S  # try at the first line, and say so then
            log.warning("cannot prepare %s for episode records (%s: %s)", self.directory, type(exc).__name__, exc)

    def write(self, record: dict[str, Any]) -> bool:
        """Append one line; False when it was not written (the size limit was reached, or the disk refused it)."""
        line = (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
        if self.total_bytes + len(line) > self.max_bytes:
            if not self.full:
                log.warning("episode recording stopped: %s holds %.0f MB (monitor.record_max_mb)",
                            self.directory, self.total_bytes / 1e6)
                self.full = True
            return False
        if self._failing_since is not None and time.monotonic() - self._failing_since < self.RETRY_S:
            self.write_failures += 1  # the disk failed a moment ago: do not hammer it with every line
            return False
        try:
            if self._file is None:
                self.directory.mkdir(parents=True, exist_ok=True)
            if self._file is None or self._file.tell() + len(line) > self.part_bytes and self._file.tell() > 0:
                self._open_next()
            start = self._file.tell()
            try:  # unbuffered: readers (the viewer) follow the file while the run goes on
                rest = memoryview(line)
                while rest:  # a raw write may take part of the line; the next call raises what stopped it
                    rest = rest[self._file.write(rest):]
            except OSError:
                self._cut_back(start)
                raise
        except OSError as exc:
            self._failed(exc)
            return False
        if self._failing_since is not None:
            log.warning("episode records are written again to %s (%d lines lost while the disk refused them)",
                        self._path(), self.write_failures)
            self._failing_since = None
        self.total_bytes += len(line)
        self.written += 1
        return True

    @property
    def failing(self) -> bool:
        """The disk refused the newest line it was offered."""
        return self._failing_since is not None

    def _path(self) -> Path:
        return self.directory / f"episodes-{self._part:05d}.jsonl"

    def _failed(self, exc: OSError) -> None:
        """Count the lost line; say so once per outage, naming the file."""
        self.write_failures += 1
        if self._failing_since is None:
            log.warning("cannot write episode records to %s (%s: %s); lines are dropped and counted until the disk "
                        "takes them again", self._path(), type(exc).__name__, exc)
        self._failing_since = time.monotonic()
        self._drop_file()

    def _cut_back(self, offset: int) -> None:
        """Cut a half-written line off, so the next line starts on a line of its own."""
        try:
            self._file.truncate(offset)
            self._file.seek(offset)
        except (OSError, ValueError):
            self._drop_file()

    def _drop_file(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass  # its buffer is empty (unbuffered writes): nothing more is lost by closing it so
            self._file = None

    def _open_next(self) -> None:
        if self._file is not None:
            self._file.close()
            self._part += 1
        self._file = open(self._path(), "ab", buffering=0)  # unbuffered: a refused write fails at once, whole

    def close(self) -> None:
        self._drop_file()


class EpisodeRecordReader:
    """Follows the record files of a directory: each call of :meth:`new_records` returns the
    complete lines appended since the last call (a half-written last line waits for its end)."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self._offsets: dict[Path, int] = {}

    def new_records(self) -> Iterator[dict[str, Any]]:
        for path in sorted(self.directory.glob(PART_GLOB)):
            offset = self._offsets.get(path, 0)
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read()
            end = data.rfind(b"\n") + 1
            self._offsets[path] = offset + end
            for raw in data[:end].splitlines():
                if not raw.strip():
                    continue
                try:
                    yield json.loads(raw)
                except ValueError:
                    log.warning("skipping a malformed line in %s", path)
