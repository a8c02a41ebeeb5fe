"""Every path of a run directory (``run.output_dir``), and which checkpoint ``resume=`` means (bottom layer:
no torch).

:class:`RunDir` names each file and folder a run keeps once, for every process and program that reads or
writes it: a path written as a literal in two modules is a format two modules must keep in step by hand.

``<output_dir>/checkpoints/step_N/`` is a Hugging Face model directory plus the full training
state; its ``train_state.json`` is written last, so a directory with it is complete. The
launcher resolves ``resume=auto`` to a concrete directory once, before any process starts, so
every process (learner ranks, coordinator) resumes from the same step.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec


@dataclass(frozen=True)
class RunDir:
    """The layout of one run directory. Who writes each path is in its comment; most are read by programs
    too (``horizonrl accounting``, ``view``, ``report``, ``chaos``)."""

    root: Path

    def __init__(self, root: str | Path) -> None:
        object.__setattr__(self, "root", Path(root))

    # written by the launcher before any process starts
    @property
    def config(self) -> Path:
        """The resolved config every process of the run reads."""
        return self.root / "config.yaml"

    @property
    def run_id(self) -> Path:
        return self.root / "run_id"

    @property
    def run_key(self) -> Path:
        """The run's key (readable by its owner only): see :func:`ensure_run_key`."""
        return self.root / "run_key"

    @property
    def logs(self) -> Path:
        """Everything each process writes, one ``<name>.log`` per process (:meth:`log`)."""
        return self.root / "logs"

    def log(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    # written by the parts
    @property
    def checkpoints(self) -> Path:
        """The learner's checkpoints, ``step_N/`` each (:func:`checkpoint_dir`)."""
        return self.root / "checkpoints"

    @property
    def learner_epoch(self) -> Path:
        """The learner's weight epoch, one number (protocol/messages.py says what an epoch is)."""
        return self.root / "learner_epoch"

    @property
    def buffer_wal(self) -> Path:
        """The buffer's write-ahead log (buffer/wal.py)."""
        return self.root / "buffer_wal"

    @property
    def actors(self) -> Path:
        """The actors' state: one outbox folder each (:meth:`outbox`)."""
        return self.root / "actors"

    def task_sequence(self, actor: int) -> Path:
        """Where actor ``actor`` is in its sequence of training tasks (actors/task_sequence.py)."""
        return self.actors / f"actor_{actor}.json"

    def outbox(self, actor: int) -> Path:
        """Actor ``actor``'s trajectories not yet acknowledged by the buffer (core/outbox.py)."""
        return self.actors / f"outbox_{actor}"

    def outboxes(self) -> list[Path]:
        """Every actor's outbox folder there is."""
        return sorted(p for p in self.actors.glob("outbox_*") if p.is_dir())

    @property
    def episode_records(self) -> Path:
        """Whole episodes as text, recorded by the buffer (and ``horizonrl eval --record``): core/episode_records.py."""
        return self.root / "episodes"

    @property
    def tensorboard(self) -> Path:
        """The coordinator's TensorBoard events."""
        return self.root / "tensorboard"

    @property
    def faults(self) -> Path:
        """One JSON line per supervision event and recovery, written by the coordinator."""
        return self.root / "faults.jsonl"

    @property
    def episode_samples(self) -> Path:
        """The actors' episode samples as JSON lines, written by the coordinator."""
        return self.root / "episodes.jsonl"

    @property
    def events(self) -> Path:
        """Every process's run events (core/run_events.py)."""
        return self.root / "events.jsonl"

    @property
    def coordinator_state(self) -> Path:
        """What a restarted coordinator reads back (core/coordinator_state.py)."""
        return self.root / "coordinator_state.json"

    # written by the Slurm job's script (launcher/slurm.py)
    @property
    def submitted_config(self) -> Path:
        """The settings the job was written with, before the coordinator's address is known."""
        return self.root / "submitted.yaml"

    @property
    def curve_keys(self) -> Path:
        """CurveZMQ keys the job makes for a run off loopback without network.curve_keys_dir."""
        return self.root / "keys"

    @property
    def job_finished(self) -> Path:
        """Touched when the learner's step ended: a step exiting after it is no failure."""
        return self.root / ".finished"

    @property
    def job_failed(self) -> Path:
        """Touched when a step ran out of restarts: the job stops."""
        return self.root / ".failed"

    # written by programs around a run
    @property
    def demo_summary(self) -> Path:
        return self.root / "demo_summary.json"

    @property
    def chaos_log(self) -> Path:
        """What ``horizonrl chaos``'s training run wrote."""
        return self.root / "chaos-train.log"

    @property
    def chaos_summary(self) -> Path:
        return self.root / "chaos_summary.json"

    @property
    def report(self) -> Path:
        """``horizonrl report``'s chart and table, by default."""
        return self.root / "report"

    def previous_run(self) -> list[str]:
        """What of another run's state is here (its id, checkpoints, buffer log, outboxes): a new run in this
        directory would mix with it."""
        return [path.name for path in (self.run_id, self.checkpoints, self.buffer_wal, self.actors) if path.exists()]


STATE_FILE = "train_state.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    return RunDir(output_dir).checkpoints / f"step_{step:06d}"


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint under ``output_dir``, or None."""
    root = RunDir(output_dir).checkpoints
    found = []
    for child in root.glob("step_*") if root.is_dir() else []:
        match = _STEP_DIR.match(child.name)
        if match and (child / STATE_FILE).is_file():
            found.append((int(match.group(1)), child))
    return max(found)[1] if found else None


def resolve_resume(resume: str | None, output_dir: str | Path) -> Path | None:
    """``None`` -> None; ``"auto"`` -> the newest complete checkpoint (None when there is none yet,
    so ``resume=auto`` also starts a fresh run); a path -> that checkpoint, which must be complete."""
    if resume is None:
        return None
    if resume == "auto":
        return latest_checkpoint(output_dir)
    path = Path(resume)
    if not (path / STATE_FILE).is_file():
        raise FileNotFoundError(f"resume={resume}: no {STATE_FILE} there, so it is not a complete training "
                                f"checkpoint (expected <output_dir>/checkpoints/step_N)")
    return path


class DataCursor(msgspec.Struct, frozen=True):
    """Where the learner is in the buffer's stream of batches."""

    next_request_id: int = 0  # the next batch request's id (a resumed learner continues the numbering)
    batches_consumed: int = 0


class TrainState(msgspec.Struct, frozen=True):
    """A checkpoint's ``train_state.json``: what the learner (and the run's accounting) needs besides the weights,
    the optimizer and the RNG (``learner/checkpoint.py``). Written last, so its presence marks a complete
    checkpoint. Fields a newer version adds are ignored by an older one, and a field an older checkpoint lacks
    takes its default."""

    step: int  # the learner step, which is also the weight version within the epoch
    weight_version: int = 0
    data_cursor: DataCursor = DataCursor()
    lineage: list[tuple[int, int]] = []  # (weight epoch, step) of every incarnation this run's weights branch from
    consumed: list[dict[str, Any]] = []  # per step since ``consumed_since``: trajectory ids by outcome
    consumed_since: int = 0  # the checkpoint whose steps ``consumed`` continues (0: the run's start)
    lr_scheduler: dict[str, Any] | None = None  # the LR schedule's state_dict
    critic_lr_scheduler: dict[str, Any] | None = None
    world_size: int | None = None  # the learner ranks that wrote it (each rank's RNG is restored only at the same)


def read_state(path: str | Path) -> TrainState:
    """The ``train_state.json`` of the checkpoint at ``path``; a ValueError that names the file if it is not one."""
    file = Path(path) / STATE_FILE
    try:
        return msgspec.json.decode(file.read_bytes(), type=TrainState)
    except msgspec.DecodeError as exc:
        raise ValueError(f"{file}: not a training state: {exc}") from None


def write_state(path: str | Path, state: TrainState) -> None:
    """``train_state.json`` into the checkpoint at ``path``, whole or not at all (written beside it, then renamed)."""
    tmp = Path(path) / (STATE_FILE + ".tmp")
    tmp.write_bytes(msgspec.json.format(msgspec.json.encode(state), indent=1))
    tmp.rename(Path(path) / STATE_FILE)


def resumed_step(resume: str | None, output_dir: str | Path) -> int:
    """The learner step a run with this ``resume`` setting starts from (0: a fresh run)."""
    path = resolve_resume(resume, output_dir)
    return 0 if path is None else read_state(path).step


def ensure_run_key(output_dir: str | Path) -> str:
    """The run's key (``<output_dir>/run_key``, made once, readable by its owner only): the processes of
    the run read it and put it in the messages that change the run's state (protocol/messages.py), so
    a process that only knows the run id cannot forge them."""
    import os
    import secrets

    path = RunDir(output_dir).run_key
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_hex(16) + "\n")
    return read_run_key(output_dir)


def read_run_key(output_dir: str | Path) -> str:
    """The run's key, or "" when the run has none (a run directory from before keys, or a config written
    by hand): then nothing is checked."""
    try:
        return RunDir(output_dir).run_key.read_text().strip()
    except (FileNotFoundError, NotADirectoryError):
        return ""
