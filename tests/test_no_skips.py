"""The suite's skip policy (tests/no_skips.py): a skip is a failure unless --allow-skips."""

import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

SKIPPING = """
import pytest

def test_skips_at_run_time():
    pytest.skip("no thing")

@pytest.mark.skipif(True, reason="a marker")
def test_skipped_by_a_marker():
    pass

def test_passes():
    pass
"""


def _pytest(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_sample.py").write_text(SKIPPING)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no_skips", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), str(tmp_path / "test_sample.py"), *args],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={"PYTHONPATH": str(TESTS), "PATH": "/usr/bin:/bin"})


def test_a_skip_fails_the_run(tmp_path):
    result = _pytest(tmp_path)
    assert result.returncode == 1, result.stdout
    assert "1 failed, 1 passed, 1 error" in result.stdout
    assert "a skip counts as a failure" in result.stdout


def test_allow_skips_reports_them_as_skips(tmp_path):
    result = _pytest(tmp_path, "--allow-skips")
    assert result.returncode == 0 and "1 passed, 2 skipped" in result.stdout, result.stdout
