"""Weights & Biases, when a run asks for it (``monitor.wandb: {project: ...}``): the coordinator's
scalars under the same names as in TensorBoard, and recorded episodes as a table.

``wandb`` is imported only when asked for (``pip install wandb``; a missing package is a clear
error at start). ``mode: offline`` works without network: the run is written under
``<output_dir>/wandb`` and ``wandb sync`` uploads it later.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger("horizonrl.wandb")

CLOSE_TIMEOUT_S = 120.0  # finishing an online run uploads what is left; a stalled network must not hang the exit
EPISODE_COLUMNS = ["learner_step", "env", "task_id", "success", "reward", "num_turns", "failure", "transcript"]


class WandbLog:
    def __init__(self, settings: dict[str, Any], output_dir: str | Path, run_id: str, config: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError as error:
            raise RuntimeError("monitor.wandb is set but the wandb package is not installed: pip install wandb") \
                from error
        os.environ.setdefault("WANDB_SILENT", "true")  # its banner would break the console's status block
        self._wandb = wandb
        self.run = wandb.init(project=settings.get("project", "horizonrl"), entity=settings.get("entity"),
                              mode=settings.get("mode", "online"), dir=str(output_dir), name=run_id, id=run_id,
                              resume="allow", config=config, tags=settings.get("tags"))
        log.info("logging to Weights & Biases: project %s, mode %s", settings.get("project"), settings.get("mode"))

    def scalars(self, values: dict[str, float], step: int) -> None:
        self.run.log(dict(values), step=step)

    def episodes(self, rows: list[list[Any]], step: int) -> None:
        """Rows of EPISODE_COLUMNS, as one table at ``step``."""
        if rows:
            self.run.log({"episodes/samples": self._wandb.Table(columns=EPISODE_COLUMNS, data=rows)}, step=step)

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Finish the run, waiting at most ``timeout_s``; past that, log where its files are and go on."""
        errors: list[BaseException] = []

        def finish() -> None:
            try:
                self.run.finish()
                # finish() can return before wandb's service process has written the run's last records (an
                # offline run's file was still 7 bytes long in 1 of 12 fresh processes); teardown waits for
                # it, so nothing logged is lost when the coordinator exits right after. Only the coordinator
                # logs here.
                self._wandb.teardown()
            except BaseException as error:  # noqa: BLE001 - re-raised in the caller's thread
                errors.append(error)

        thread = threading.Thread(target=finish, name="wandb-close", daemon=True)
        thread.start()
        thread.join(timeout_s)
        if thread.is_alive():
            log.warning("Weights & Biases did not finish within %g s (an upload still going?); not waiting "
                        "longer: `wandb sync` uploads what it has under %s", timeout_s,
                        getattr(self.run, "dir", "the run's wandb directory"))
        elif errors:
            raise errors[0]


def episode_row(sample: Any, learner_step: int) -> list[Any]:
    """An EpisodeSample as a row of EPISODE_COLUMNS (the transcript as readable text)."""
    transcript = "\n\n".join(f"[{role}] {text}" for role, text in sample.transcript)
    return [learner_step, sample.env, sample.task_id, sample.success, sample.reward, sample.num_turns,
            sample.failure, transcript]
