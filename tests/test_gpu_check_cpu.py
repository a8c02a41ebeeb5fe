"""scripts/gpu_check.py's CPU parts, and the sizing formula it shares with docs/gpu.md.

The CUDA-only checks must say SKIPPED (never PASS) here; a failing check must make the exit status 1.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import load_script

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.py"


@pytest.mark.slow
def test_cpu_checks_pass_and_cuda_checks_say_skipped(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cpu", "--out", str(out), "--workdir", str(tmp_path / "w")],
                          capture_output=True, text=True, timeout=400, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    status = {check["name"]: check for check in report["checks"]}
    for name in ("dtype_policy", "mixed_precision_step", "activation_formula", "bucket_broadcast"):
        assert status[name]["status"] == "PASS", status[name]
    for name in ("loss_parity", "peak_memory", "cuda_ipc", "colocated_handoff", "colocated_training", "staging_stream"):
        assert status[name]["status"] == "SKIPPED" and "CUDA" in status[name]["note"], status[name]
    step = status["mixed_precision_step"]["figures"]["tiny"]
    assert step["param_dtypes"] == ["torch.float32"] and step["compute_input_dtype"] == "torch.bfloat16"
    broadcast = status["bucket_broadcast"]["figures"]
    assert broadcast["backend"] == "gloo" and broadcast["mismatched_tensors"] == 0 and broadcast["buckets"] > 1
    assert "SKIPPED" in proc.stdout and report["failed"] == []


def test_a_failing_check_makes_the_exit_status_1(tmp_path):
    gpu_check = load_script("gpu_check")

    def check_planted_failure(ctx):
        raise AssertionError("planted")

    gpu_check.CHECKS = [gpu_check.check_dtype_policy, check_planted_failure]
    out = tmp_path / "report.json"
    assert gpu_check.main(["--cpu", "--out", str(out), "--workdir", str(tmp_path / "w")]) == 1
    report = json.loads(out.read_text())
    assert report["failed"] == ["planted_failure"]
    assert [c["status"] for c in report["checks"]] == ["PASS", "FAIL"]


@pytest.mark.parametrize("key", ["0.5B", "1.5B", "7B", "32B"])
def test_the_sizing_counts_the_parameters_transformers_builds(key):
    import torch
    from transformers import Qwen2ForCausalLM

    from horizonrl.learner.sizing import QWEN25

    gpu_check = load_script("gpu_check")
    with torch.device("meta"):
        model = Qwen2ForCausalLM(gpu_check.qwen_config(key))
    shape = QWEN25[key]
    assert sum(p.numel() for p in model.parameters()) == shape.params  # parameters() counts a tied weight once
    assert sum(p.numel() for p in model.model.layers[0].parameters()) == shape.layer_params


def test_the_sizing_table_adds_up():
    from horizonrl.learner.sizing import GB, QWEN25, learner_memory, max_tokens, sizing_table

    shape = QWEN25["7B"]
    one = learner_memory(shape, world_size=1, tokens=4096, checkpointing=False)
    eight = learner_memory(shape, world_size=8, tokens=4096, checkpointing=False)
    assert one.states == pytest.approx(16 * shape.params) and eight.states == pytest.approx(2 * shape.params)
    assert learner_memory(shape, world_size=8, tokens=4096, checkpointing=True).peak < eight.peak
    fits = max_tokens(shape, world_size=8, checkpointing=False, budget_bytes=80 * GB)
    assert learner_memory(shape, world_size=8, tokens=fits, checkpointing=False).peak <= 80 * GB
    assert learner_memory(shape, world_size=8, tokens=fits + 1, checkpointing=False).peak > 80 * GB
    table = sizing_table()
    assert table.count("\n") >= 4 and "Qwen2.5-32B" in table


def test_the_weight_gather_gathers_a_copy_only_with_several_ranks():
    """On one rank ``full_tensor()`` returns the cast shard itself: an H200 measured the gather's extra as
    one bucket plus one bf16 tensor (0.5B: 0.545 GB, 1.5B: 0.933 GB); with W ranks the gathered copy is
    added beside the shard."""
    from horizonrl.learner.sizing import QWEN25, broadcast_bytes

    bucket = 256 << 20
    for key, measured_one_rank in (("0.5B", 0.545e9), ("1.5B", 0.933e9)):
        largest = 2 * QWEN25[key].largest_tensor  # the embedding in bf16, larger than the bucket
        assert broadcast_bytes(QWEN25[key], 1, bucket) == pytest.approx(2 * largest)
        assert broadcast_bytes(QWEN25[key], 1, bucket) == pytest.approx(measured_one_rank, rel=0.01)
        assert broadcast_bytes(QWEN25[key], 4, bucket) == pytest.approx(largest + largest / 4 + largest)
