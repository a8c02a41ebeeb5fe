"""Where the coordinator writes: TensorBoard (it is the run's one writer of scalars), Weights & Biases when
configured (the same names), JSON lines in the run directory (faults, episode samples), and one status
record per learner step on its stdout for the launcher's console (protocol/status.py)."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from horizonrl.core.config import TrainConfig
from horizonrl.core.runtime import RateLimitedLog
from horizonrl.coordinator.wandb_log import WandbLog, episode_row
from horizonrl.protocol import EpisodeSample
from horizonrl.protocol.status import status_record_line

log = logging.getLogger("horizonrl.coordinator")


class TensorBoardWriter:
    """TensorBoard's event file, written for people: a disk that is full or read-only costs the scalars it
    refuses, never the coordinator. TensorBoard's writer thread dies at the first failed write and every later
    call raises its error; here that error is counted (``failures``), said once per outage with the directory,
    and the writer is made anew ``RETRY_S`` later (a new event file: TensorBoard reads every file of the
    directory)."""

    RETRY_S = 30.0

    def __init__(self, log_dir: Path, make: Callable[[str], Any] | None = None) -> None:
        self.log_dir = log_dir
        self._make = make or _summary_writer
        self.failures = 0
        self._writer = None
        self._failed_at: float | None = None
        self._open()

    def scalars(self, scalars: dict[str, float], step: int) -> bool:
        """The scalars at ``step``, flushed; False: they were not written."""
        return self._write(lambda w: ([w.add_scalar(key, value, step) for key, value in scalars.items()], w.flush()))

    def text(self, tag: str, text: str, step: int) -> bool:
        return self._write(lambda w: w.add_text(tag, text, step))

    def _write(self, action: Callable[[Any], Any]) -> bool:
        if self._writer is None and not self._open():
            self.failures += 1
            return False
        try:
            action(self._writer)
            return True
        except OSError as exc:  # the disk: full, read-only, gone
            self._failed(exc)
            return False

    def _open(self) -> bool:
        if self._failed_at is not None and time.monotonic() - self._failed_at < self.RETRY_S:
            return False
        try:
            self._writer = self._make(str(self.log_dir))
        except OSError as exc:
            self._failed(exc)
            return False
        if self._failed_at is not None:
            log.warning("TensorBoard scalars are written to %s again (%d writes were refused)", self.log_dir,
                        self.failures)
            self._failed_at = None
        return True

    def _failed(self, exc: OSError) -> None:
        self.failures += 1
        if self._failed_at is None:
            log.warning("cannot write TensorBoard events to %s (%s: %s); scalars are dropped and counted, and the "
                        "writer is made again every %.0f s", self.log_dir, type(exc).__name__, exc, self.RETRY_S)
        self._failed_at = time.monotonic()
        writer, self._writer = self._writer, None
        if writer is not None:
            try:
                writer.close()
            except Exception:  # noqa: BLE001 - its thread died of the same error; nothing of it is left to save
                pass

    def close(self) -> None:
        if self._writer is not None:
            try:
                self._writer.close()
            except OSError as exc:
                log.warning("cannot close TensorBoard's event file in %s (%s)", self.log_dir, exc)
            self._writer = None


class RunWriters:
    def __init__(self, config: TrainConfig) -> None:
        self.config = config
        self.tensorboard = TensorBoardWriter(config.run_dir.tensorboard)
        self.wandb = _make_wandb(config)
        self._wandb_rows: list[list] = []  # episode samples since the last step, logged with its scalars
        self._write_log = RateLimitedLog(log, 60.0)
        self.status_out: Callable[[str], None] = _print_status  # the launcher reads our stdout (inline: a call)

    def step(self, scalars: dict[str, float], step: int) -> bool:
        """One learner step's scalars, and (to W&B) the episode samples that came since the step before.
        False: TensorBoard's file refused them (counted there)."""
        written = self.tensorboard.scalars(scalars, step)
        if self.wandb is not None:
            self.wandb.scalars(scalars, step)  # the same names as TensorBoard's
            self.wandb.episodes(self._wandb_rows, step)
            self._wandb_rows = []
        return written

    def held_out(self, scalars: dict[str, float], step: int, current_step: int) -> bool:
        """A held-out evaluation at the ``step`` it evaluated. False: TensorBoard's file refused it."""
        written = self.tensorboard.scalars(scalars, step)
        if self.wandb is not None:
            # W&B's steps only go forward: log at the current step, with the evaluated step beside it
            self.wandb.scalars({**scalars, "eval/learner_step": float(step)}, current_step)
        return written

    def episode_sample(self, sample: EpisodeSample, step: int) -> bool:
        """What the agent did, for a person: TensorBoard text (episodes/<env>), one JSON line in the run's
        episode samples, and a row of the next step's W&B episode table. False: the line could not be written."""
        written = self.tensorboard.text(f"episodes/{sample.env}", episode_markdown(sample), step)
        if self.wandb is not None:
            self._wandb_rows.append(episode_row(sample, step))
        return self.append_line(self.config.run_dir.episode_samples,
                                {"learner_step": step, **msgspec.structs.asdict(sample)}) and written

    def append_line(self, path: Path, record: dict) -> bool:
        """One JSON line to a file of the run directory; a full or read-only disk costs the line, not the run
        (False)."""
        try:
            with open(path, "ab") as out:
                out.write(msgspec.json.encode(record) + b"\n")
            return True
        except OSError as exc:
            self._write_log.warning("cannot write %s: %s", path, exc)
            return False

    def status(self, step: int, scalars: dict[str, float], *, startup: bool = False) -> None:
        """The step's status record on stdout, for the console of the launcher."""
        self.status_out(status_record_line(step, self.config.learner.total_steps, scalars, startup=startup))

    def close(self) -> None:
        self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.close()


def episode_markdown(sample: EpisodeSample) -> str:
    """One episode as TensorBoard markdown: a header line, then each observation and reply as a code block."""
    outcome = f"failed ({sample.failure})" if sample.failure else ("success" if sample.success else "no success")
    lines = [f"**{sample.env} task {sample.task_id}** · actor {sample.actor_id} · weights v{sample.weight_version} · "
             f"{outcome} · reward {sample.reward:.3g} · score {sample.score:.3g} · "
             f"{sample.num_turns}/{sample.max_turns} turns · ended: {sample.stop_reason}", ""]
    turn = 0
    for role, text in sample.transcript:
        turn += role == "reply"
        label = f"reply {turn}" if role == "reply" else ("task" if turn == 0 else f"observation after reply {turn}")
        # TensorBoard renders markdown: a fenced block shows the text verbatim (backticks inside cannot close it)
        lines += [f"*{label}*", "", "~~~~text", text.replace("~~~~", "~ ~ ~ ~"), "~~~~", ""]
    return "\n".join(lines)


def _summary_writer(log_dir: str):
    from torch.utils.tensorboard import SummaryWriter  # torch only here, and lazily

    return SummaryWriter(log_dir=log_dir)


def _make_wandb(config: TrainConfig) -> WandbLog | None:
    settings = config.monitor.wandb
    if settings is None:
        return None
    return WandbLog(settings.model_dump(), config.output_dir, config.run.run_id, config.model_dump(mode="json"))


def _print_status(line: str) -> None:
    try:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
    except OSError:
        pass  # a broken pipe: the launcher that read it is gone (this process stops: stop_when_launcher_dies)
