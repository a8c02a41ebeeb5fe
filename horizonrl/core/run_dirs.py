"""Where a run keeps its checkpoints, and which one ``resume=`` means (bottom layer: no torch).

``<output_dir>/checkpoints/step_N/`` is a Hugging Face model directory plus the full training
state; its ``train_state.json`` is written last, so a directory with it is complete. The
launcher resolves ``resume=auto`` to a concrete directory once, before any process starts, so
every process (learner ranks, coordinator) resumes from the same step.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

STATE_FILE = "train_state.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / "checkpoints" / f"step_{step:06d}"


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint under ``output_dir``, or None."""
    root = Path(output_dir) / "checkpoints"
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


def read_state(path: str | Path) -> dict[str, Any]:
    return json.loads((Path(path) / STATE_FILE).read_text())


def resumed_step(resume: str | None, output_dir: str | Path) -> int:
    """The learner step a run with this ``resume`` setting starts from (0: a fresh run)."""
    path = resolve_resume(resume, output_dir)
    return 0 if path is None else int(read_state(path)["step"])


RUN_KEY_FILE = "run_key"


def ensure_run_key(output_dir: str | Path) -> str:
    """The run's key (``<output_dir>/run_key``, made once, readable by its owner only): the processes of
    the run read it and put it in the messages that change the run's state (protocol/messages.py), so
    a process that only knows the run id cannot forge them."""
    import os
    import secrets

    path = Path(output_dir) / RUN_KEY_FILE
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
        return (Path(output_dir) / RUN_KEY_FILE).read_text().strip()
    except (FileNotFoundError, NotADirectoryError):
        return ""
