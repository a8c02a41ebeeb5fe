"""What a restarted coordinator needs that no other process re-sends: ``<output_dir>/coordinator_state.json``.

The coordinator restarts like every other process (docs/faults.md). Most of its state comes back by
itself: every process heartbeats once a second (liveness, counters, the actors' weights), the buffer
registers its endpoints with every heartbeat, the learner's next report says its step. What does not
— the learner's weight hub and rendezvous registrations (sent once), the weight epoch, the held-out
evaluations asked for and logged, the plateau rule, the faults counted, the counters of processes
that are gone, the bad messages seen — the coordinator writes here after every change of it and
every couple of seconds, and a restarted coordinator reads back.

The file belongs to one launch: the launcher removes it before a run starts (a resumed run starts
from its checkpoint, not from where the last launch's coordinator was).

Bottom layer: no torch, no vllm.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import msgspec

from horizonrl.core.run_dirs import RunDir

log = logging.getLogger("horizonrl.coordinator")


class IncarnationCounters(msgspec.Struct):
    """The newest counters one process incarnation sent in its heartbeats."""

    role: str
    index: int
    pid: int
    counters: dict[str, float]
    current: bool  # the newest incarnation of (role, index)


class PlateauState(msgspec.Struct):
    best: float | None  # None: no evaluation yet
    best_step: int
    without_progress: int
    reached: bool


class Recovering(msgspec.Struct):
    """A process that died and has not recovered yet (faults.jsonl's recovered line comes when it does)."""

    name: str
    role: str
    died_at: float  # time.time()
    then: int  # its pid then (the learner: its weight epoch then)


class CoordinatorSnapshot(msgspec.Struct, kw_only=True):
    run_id: str
    saved_at: float  # time.time()
    started_at: float  # time.time() when the launch's first coordinator started (time/elapsed_s goes on from it)
    last_report_at: float  # time.time() of the newest learner report taken (0: none)
    restarts: int  # how many coordinators came before this one in the launch
    learner_step: int
    weight_version: int
    weight_epoch: int
    finished: bool
    eval_step: int
    evaluated_steps: list[int]
    final_eval_deadline: float | None  # time.time() until which the run waits for the last evaluation
    plateau: PlateauState
    endpoints: dict[str, str]
    faults: dict[str, float]
    recovery_s: dict[str, float]
    recovering: list[Recovering]
    incarnations: list[IncarnationCounters]
    messages_read: int
    bad_messages: dict[str, int]
    rejected: dict[str, int]
    accepted: dict[str, int]


def state_path(output_dir: str | Path) -> Path:
    return RunDir(output_dir).coordinator_state


def save_snapshot(output_dir: str | Path, snapshot: CoordinatorSnapshot) -> bool:
    """Write the snapshot whole or not at all (a temporary file renamed over the old one). A disk that is
    full or read-only costs the next restart what changed since the last write, never the run: False."""
    path = state_path(output_dir)
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_bytes(msgspec.json.encode(snapshot))
        os.replace(tmp, path)
        return True
    except OSError as exc:
        log.warning("cannot write %s (%s); a restarted coordinator would miss what changed since", path, exc)
        return False


def load_snapshot(output_dir: str | Path, run_id: str) -> CoordinatorSnapshot | None:
    """The snapshot a coordinator of this run left, or None (there is none, it is of another run, or it
    cannot be read: then the coordinator starts from the run directory's checkpoint and what others send)."""
    path = state_path(output_dir)
    try:
        snapshot = msgspec.json.decode(path.read_bytes(), type=CoordinatorSnapshot)
    except FileNotFoundError:
        return None
    except (OSError, msgspec.MsgspecError, ValueError) as exc:
        log.warning("cannot read %s (%s); starting without it", path, exc)
        return None
    return snapshot if snapshot.run_id == run_id else None


def remove_snapshot(output_dir: str | Path) -> None:
    """A new launch starts from its checkpoint, not from the last launch's coordinator."""
    state_path(output_dir).unlink(missing_ok=True)
