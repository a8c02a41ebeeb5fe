"""Where the coordinator writes: TensorBoard (it is the run's one writer of scalars), Weights & Biases when
configured (the same names), JSON lines in the run directory (faults, episode samples), and one status
record per learner step on its stdout for the launcher's console (protocol/status.py)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import msgspec

from horizonrl.core.config import TrainConfig
from horizonrl.core.runtime import RateLimitedLog
from horizonrl.coordinator.wandb_log import WandbLog, episode_row
from horizonrl.protocol import EpisodeSample
from horizonrl.protocol.status import status_record_line

log = logging.getLogger("horizonrl.coordinator")


class RunWriters:
    def __init__(self, config: TrainConfig) -> None:
        self.config = config
        self.tensorboard = _make_tensorboard(config)
        self.wandb = _make_wandb(config)
        self._wandb_rows: list[list] = []  # episode samples since the last step, logged with its scalars
        self._write_log = RateLimitedLog(log, 60.0)

    def step(self, scalars: dict[str, float], step: int) -> None:
        """One learner step's scalars, and (to W&B) the episode samples that came since the step before."""
        if self.tensorboard is not None:
            for key, value in scalars.items():
                self.tensorboard.add_scalar(key, value, step)
            self.tensorboard.flush()
        if self.wandb is not None:
            self.wandb.scalars(scalars, step)  # the same names as TensorBoard's
            self.wandb.episodes(self._wandb_rows, step)
            self._wandb_rows = []

    def held_out(self, scalars: dict[str, float], step: int, current_step: int) -> None:
        """A held-out evaluation at the ``step`` it evaluated."""
        if self.tensorboard is not None:
            for key, value in scalars.items():
                self.tensorboard.add_scalar(key, value, step)
            self.tensorboard.flush()
        if self.wandb is not None:
            # W&B's steps only go forward: log at the current step, with the evaluated step beside it
            self.wandb.scalars({**scalars, "eval/learner_step": float(step)}, current_step)

    def episode_sample(self, sample: EpisodeSample, step: int) -> bool:
        """What the agent did, for a person: TensorBoard text (episodes/<env>), one JSON line in the run's
        episode samples, and a row of the next step's W&B episode table. False: the line could not be written."""
        if self.tensorboard is not None:
            self.tensorboard.add_text(f"episodes/{sample.env}", episode_markdown(sample), step)
        if self.wandb is not None:
            self._wandb_rows.append(episode_row(sample, step))
        return self.append_line(self.config.run_dir.episode_samples,
                                {"learner_step": step, **msgspec.structs.asdict(sample)})

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
        try:
            sys.stdout.write(status_record_line(step, self.config.learner.total_steps, scalars, startup=startup)
                             + "\n")
            sys.stdout.flush()
        except OSError:
            pass  # a broken pipe: the launcher that read it is gone (this process stops: stop_when_launcher_dies)

    def close(self) -> None:
        if self.tensorboard is not None:
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


def _make_tensorboard(config: TrainConfig):
    from torch.utils.tensorboard import SummaryWriter  # torch only here, and lazily

    return SummaryWriter(log_dir=str(config.run_dir.tensorboard))


def _make_wandb(config: TrainConfig) -> WandbLog | None:
    settings = config.monitor.wandb
    if settings is None:
        return None
    return WandbLog(settings.model_dump(), config.output_dir, config.run.run_id, config.model_dump(mode="json"))
