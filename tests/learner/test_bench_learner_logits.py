"""scripts/bench_learner_logits.py in its smallest configuration, on the tests' tiny model: both ways of computing
the loss rows run in fresh processes, agree on the loss and gradients, and are measured; and float32 against bf16
compute, each with its tokens/s."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_learner_logits.py"


def test_both_ways_agree_and_are_measured_side_by_side(tiny_model, tmp_path):
    out = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--model", str(tiny_model), "--batch", "2", "--length", "96",
                           "--replies", "2", "--reply-tokens", "4", "--repeats", "1", "--compute-dtype", "float32",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    check = result["check"]
    assert check["loss_full"] == pytest.approx(check["loss_kept"], rel=1e-5)
    assert check["grad_max_abs"] > 0 and check["grad_max_abs_diff"] <= 1e-5 * check["grad_max_abs"]
    assert 0 < result["output_layer_positions"] < 95  # the output layer ran at fewer positions than there are
    for way in ("full", "kept"):
        [run] = result["runs"][way]
        assert run["seconds"] > 0 and run["peak_gb"] > 0
    assert all(r > 0 for r in result["ratios"]["time_full_over_kept"])


def test_float32_and_bfloat16_compute_are_measured_side_by_side(tiny_model, tmp_path):
    out = tmp_path / "dtypes.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--model", str(tiny_model), "--batch", "2", "--length", "96",
                           "--repeats", "1", "--compare", "dtypes", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    for dtype in ("float32", "bfloat16"):
        [run] = result["runs"][dtype]
        assert run["seconds"] > 0 and run["tokens_per_s"] == pytest.approx(2 * 96 / run["seconds"])
    assert result["ratios"]["time_float32_over_bfloat16"][0] > 0
