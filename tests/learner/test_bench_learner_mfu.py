"""scripts/bench_learner_mfu.py: the useful-FLOP count it divides by (against a hand computation), the matmul shapes
it times, and its smallest run on the tests' tiny model (the matmul peaks, then two learner variants in fresh
processes, each with tokens/s and MFU)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from horizonrl.core.model_shape import ModelShape

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_learner_mfu.py"
REPO = SCRIPT.parents[1]
TINY = ModelShape("tiny", vocab=100, hidden=8, intermediate=16, layers=2, heads=2, kv_heads=1, head_dim=4, tied=True)


def bench_module():
    spec = importlib.util.spec_from_file_location("bench_learner_mfu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_useful_flops_by_hand():
    # linear weights of a layer: q 8x8, k and v 8x4 each, o 8x8, gate/up/down 8x16 each = 64+64+64+384 = 576
    assert TINY.layer_linear_params == 576
    length, loss_tokens = 10, 3
    linear = 2 * 2 * 576 * length  # 2 FLOPs per multiply-add, 2 layers, forward
    attention = 2 * 2 * (length * length / 2) * 8 * 2  # QKᵀ and AV, causal half, q_dim 8, 2 layers
    output = 2 * 8 * 100 * loss_tokens
    assert TINY.training_flops(length, loss_tokens) == pytest.approx(3 * (linear + attention + output))
    assert TINY.training_flops(length, loss_tokens, frozen_weights=True) == pytest.approx(
        2 * linear + 2 * output + 3 * attention)  # no weight gradients; attention has no weights


def test_the_matmuls_timed_are_a_layers_forward_and_backward():
    matmuls = bench_module().model_matmuls(TINY, tokens=32, loss_tokens=4)
    assert len(matmuls) == 3 * 8  # 7 linear layers and the output layer, 3 matmuls each
    assert (32, 8, 16) in matmuls and (32, 16, 8) in matmuls and (8, 32, 16) in matmuls  # gate: X·W, dY·Wᵀ, Xᵀ·dY
    assert (4, 8, 100) in matmuls  # the output layer at the loss positions
    # one layer's matmul FLOPs (forward, input and weight gradients) and the output layer's
    assert sum(2 * m * k * n for m, k, n in matmuls) == 3 * 2 * 576 * 32 + 3 * 2 * 8 * 100 * 4


@pytest.mark.slow
def test_the_smallest_run_measures_the_peaks_and_two_variants(tiny_model, tmp_path):
    out = tmp_path / "mfu.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--model", str(tiny_model), "--config",
                           str(REPO / "configs" / "signpost_test.yaml"), "--variants", "padded,packed", "--repeats",
                           "1", "--tokens", "64", "--matmul-repeats", "1", "--max-tokens", "512", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    for dtype in ("bfloat16", "float32"):
        assert result["peaks"][dtype]["square_tflops"] > 0 and result["peaks"][dtype]["model_tflops"] > 0
    for variant in ("padded", "packed"):
        [run] = result["runs"][variant]
        assert run["seconds"] > 0 and run["tokens"] > run["sequences"] > 1 and run["flops"] > 0
        assert 0 < result["summary"][variant]["mfu"][0]
    assert result["runs"]["padded"][0]["tokens"] == result["runs"]["packed"][0]["tokens"]  # the same batch
    assert result["summary"]["packed"]["speed_over_first"][0] > 0
