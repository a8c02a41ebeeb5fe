"""What the launcher does when the disk says no: a run directory it cannot write fails the launch with a
clear error (not a traceback), and a log file it cannot write (a full disk) does not stop it reading its
children's output — their lines still reach the console, and the log says how many it lost."""

from __future__ import annotations

import errno
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from horizonrl.core.config import ConfigError
from horizonrl.launcher import check_writable
from horizonrl.launcher.local import _pump

REPO = Path(__file__).resolve().parents[1]


class FillingDisk(io.RawIOBase):
    """A log file on a disk that is full for the writes numbered in ``full``."""

    def __init__(self, full: set[int]) -> None:
        self.full, self.writes, self.data = full, 0, b""

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.writes += 1
        if self.writes in self.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.data += bytes(data)
        return len(data)


def test_a_full_disk_costs_log_lines_not_the_childs_output():
    shown = []
    log = FillingDisk(full={2, 3})
    _pump(io.BytesIO(b"one\ntwo\nthree\nfour\nfive\n"), log, "actor-0", lambda name, line: shown.append(line))
    assert shown == ["one", "two", "three", "four", "five"]  # every line reached the console
    assert log.data.decode().splitlines() == ["one", "[launcher: 2 lines of this log were lost: it could not be "
                                              "written]", "four", "five"]


def test_a_run_directory_that_cannot_be_written_is_refused_with_what_to_do(tmp_path):
    not_a_dir = tmp_path / "a-file"
    not_a_dir.write_text("")
    with pytest.raises(ConfigError, match="cannot write the run directory .*run.output_dir"):
        check_writable(not_a_dir / "run")
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    read_only.chmod(0o555)
    try:
        if os.geteuid() != 0:  # root writes anywhere: the permission bits say nothing to it
            with pytest.raises(ConfigError, match="Permission denied"):
                check_writable(read_only / "run")
    finally:
        read_only.chmod(0o755)
    check_writable(tmp_path / "fine" / "run")
    assert (tmp_path / "fine" / "run").is_dir() and not list((tmp_path / "fine" / "run").iterdir())


def test_horizonrl_train_into_an_unwritable_directory_exits_2_with_one_line(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = subprocess.run([sys.executable, "-m", "horizonrl", "train", str(REPO / "configs" / "signpost_test.yaml"),
                             "model.path=unused", f"run.output_dir={blocker / 'run'}"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "error: cannot write the run directory" in result.stderr


def test_a_model_directory_that_is_not_there_is_refused_before_anything_is_written(tmp_path):
    """Once a missing model.path failed in every process, each restarted to its limit (~25 s of tracebacks)."""
    from horizonrl.core.config import load_config
    from horizonrl.launcher import launch

    missing = tmp_path / "no-such-model"
    for given in (str(missing), "./no-such-model", "~/no/such/model"):
        config = load_config(REPO / "configs" / "signpost_test.yaml",
                             [f"model.path={given}", f"run.output_dir={tmp_path / 'run'}"])
        with pytest.raises(ConfigError, match=r"no such directory.*horizonrl make-tiny-model"):
            launch(config)
    assert not (tmp_path / "run").exists()
    # a name that may be a Hugging Face Hub id is left to the processes; a directory that is there passes
    from horizonrl.launcher.resolve import check_model_path

    for given in ("HuggingFaceTB/SmolLM2-135M-Instruct", "gpt2", str(tmp_path)):
        check_model_path(load_config(REPO / "configs" / "signpost_test.yaml", [f"model.path={given}"]))
