"""Learning through the whole asynchronous loop, with every part real.

Real processes (coordinator, buffer, learner rank(s), two actors with vLLM engines), real
ZMQ sockets, a real gloo weight hub. Success is measured two ways:
- ``rollout/success_rate``: the actors' own episodes, unfiltered. It rises only if the
  learner's weights reach the actors' engines.
- held-out success of the final checkpoint (test-split tasks the learner never saw),
  evaluated in a fresh vLLM engine, against the starting policy on the same tasks.
"""

import glob
import json
import subprocess
from pathlib import Path

import pytest
from helpers import horizonrl_cmd, start_process, stop_process

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "signpost_test.yaml"
EVAL_EPISODES = 100
MAX_TURNS = 2


def held_out(model: Path, tmp_path: Path, label: str) -> dict:
    out = subprocess.run(horizonrl_cmd("eval", "--model", str(model), "--env", "signpost",
                                       "--env-settings", '{"length": 2}', "--episodes", str(EVAL_EPISODES),
                                       "--max-turns", str(MAX_TURNS), "--max-tokens-per-turn", "24",
                                       "--max-context-tokens", "512"),
                         capture_output=True, text=True, timeout=300)
    (tmp_path / f"eval-{label}.log").write_text(out.stdout + out.stderr)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def scalars(run_dir: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(glob.glob(str(run_dir / "tensorboard" / "events.*"))[0])
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def train(tiny_model: Path, run_dir: Path, *overrides: str, timeout: float) -> int:
    proc = start_process(horizonrl_cmd("train", str(CONFIG), f"model.path={tiny_model}", f"run.output_dir={run_dir}",
                                       *overrides), run_dir.parent / f"{run_dir.name}.log")
    try:
        return proc.wait(timeout=timeout)
    finally:
        stop_process(proc)


def test_success_rises_through_the_asynchronous_loop(tiny_model, tmp_path):
    before = held_out(tiny_model, tmp_path, "before")
    run_dir = tmp_path / "run"
    # When success takes off is chance: at lr 3e-4 (constant) it came between steps 35 and 45 in most
    # runs, past 60 in some (a loaded CI machine failed 60 steps at 0.09 -> 0.20). At lr 6e-4 it came at
    # steps 20-30 in 3 of 3 runs of 90 steps (two decaying linearly to 6e-5, as here; one constant), and
    # success stayed at 0.98-1.0 to the end. 75 steps were not enough: two later runs took off near step 60
    # (one on a fresh clone with nothing else running: 0.15 at step 60, 0.26 at 70); 100 steps leave room
    # for that. The decay guards the plateau: at a constant 3e-4 the
    # near-deterministic policy (entropy ~0.01) once collapsed 0.98 -> 0.48 at steps 77-80
    # (approx_kl 0.2), GRPO's std-normalised advantages being large when a group has a single failure.
    rc = train(tiny_model, run_dir, "learner.total_steps=100", "learner.lr=6e-4", "learner.lr_schedule=linear",
               "learner.min_lr_ratio=0.1", timeout=1500)
    assert rc == 0, (tmp_path / "run.log").read_text()[-5000:]

    s = scalars(run_dir)
    for tag in ("batch/reward_mean", "env/signpost/success_mean", "batch/turns_mean", "schedule/max_turns",
                "loss/policy", "loss/entropy", "loss/approx_kl", "ratio/mean", "ratio/clip_fraction",
                "batch/staleness_mean", "buffer/dropped_total", "time/weight_sync_s", "rollout/tokens_per_s",
                "throughput/learner_tokens_per_s", "rollout/success_rate"):
        assert tag in s, f"TensorBoard scalar {tag} missing"
    rollout = s["rollout/success_rate"]
    early, late = sum(rollout[:8]) / 8, sum(rollout[-8:]) / 8
    checkpoint = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    after = held_out(checkpoint, tmp_path, "after")
    report = {"before": before["success_rate"], "after": after["success_rate"], "rollout_early": early,
              "rollout_late": late}
    print("learning:", json.dumps(report))
    assert late >= early + 0.2, report  # the actors' own episodes improved: weights reached them
    assert after["success_rate"] >= before["success_rate"] + 0.3, report


def test_two_learner_ranks_run_the_loop_and_checkpoint(tiny_model, tmp_path):
    run_dir = tmp_path / "run2"
    rc = train(tiny_model, run_dir, "learner.num_ranks=2", "learner.total_steps=3", timeout=600)
    assert rc == 0, (tmp_path / "run2.log").read_text()[-5000:]
    assert (run_dir / "checkpoints" / "step_000003" / "config.json").exists()
    assert "step 3/3" in (tmp_path / "run2.log").read_text()
