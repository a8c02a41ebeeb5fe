"""Learning through the whole asynchronous loop, with every part real, on BabyAI (the demo's config).

Real processes (coordinator, buffer, learner rank(s), actors with vLLM engines), real
ZMQ sockets, a real gloo weight hub, the real minigrid environment. Success is measured two ways:
- ``rollout/success_rate``: the actors' own episodes, unfiltered. It rises only if the
  learner's weights reach the actors' engines.
- held-out success of the final checkpoint (test-split seeds the learner never saw), evaluated in
  a fresh vLLM engine, against the starting policy on the same tasks.
"""

import glob
import json
import subprocess
from pathlib import Path

import pytest
from helpers import horizonrl_cmd, start_process, stop_process

from horizonrl.core.config import load_config

# solo: its bounds come from runs with nothing else on the machine, so `make test` runs it alone, after the others.
pytestmark = [pytest.mark.slow, pytest.mark.solo]

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "configs" / "demo.yaml"
EVAL_EPISODES = 150
STEPS = 30
# The bounds, from the take-off distribution: this test's procedure run 10 times at 30 steps
# (scripts/learning_take_off.py --steps 30, the 2-core machine with nothing else running; docs/learning.md).
# Since 2026-12-05 the launcher gives the demo's two engines a core each (core/placement.py spread_engines);
# measured so that day (183 s a run; docs/learning-take-off-30-steps-spread.jsonl):
#   held-out rise (after - before): mean 0.335, sd 0.034, min 0.280, max 0.387 (before 0.23-0.30, after 0.58-0.62)
#   actors' rise (late 8 - early 8): mean 0.155, sd 0.055, min 0.097, max 0.248
# and before it, both engines on core 0 (2026-11-29, 218 s a run; docs/learning-take-off-30-steps.jsonl): held-out
# 0.331 sd 0.036 (min 0.253), actors' 0.149 sd 0.044 (min 0.100).
# Under a normal fit a run falls below mean - 3.09 sd once in 1,000: held-out 0.231, actors' -0.016. The held-out
# bound sits lower still (5.4 sd below the mean), leaving room for a busier machine: it carries the claim that the
# policy learns. The actors' rise is too noisy at 30 steps to be asserted positive at 1 in 1,000 (0.232 at 60 steps,
# docs/learning-take-off.jsonl), so its bound says only that the actors' play did not fall as the new weights
# reached them: weights broken in transit bring it down by tens of points. That their weights advance at all is
# structural: the buffer drops groups more than buffer.max_staleness versions old, so a run whose actors never took
# new weights would stop training and not end.
ROLLOUT_RISE = -0.02
HELD_OUT_RISE = 0.15


def held_out(model: Path, tmp_path: Path, label: str) -> dict:
    config = load_config(DEMO)
    env = config.envs[0]
    out = subprocess.run(horizonrl_cmd("eval", "--model", str(model), "--env", env.name,
                                       "--env-settings", json.dumps(dict(env.settings)),
                                       "--episodes", str(EVAL_EPISODES),
                                       "--max-turns", str(config.algorithm.rounds_ctrl.rounds[-1]),
                                       "--max-tokens-per-turn", str(config.rollout.max_tokens_per_turn),
                                       "--max-context-tokens", str(config.rollout.max_context_tokens)),
                         capture_output=True, text=True, timeout=600)
    (tmp_path / f"eval-{label}.log").write_text(out.stdout + out.stderr)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def scalars(run_dir: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(glob.glob(str(run_dir / "tensorboard" / "events.*"))[0])
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def train(config: Path, tiny_model: Path, run_dir: Path, *overrides: str, timeout: float) -> int:
    proc = start_process(horizonrl_cmd("train", str(config), f"model.path={tiny_model}", f"run.output_dir={run_dir}",
                                       *overrides), run_dir.parent / f"{run_dir.name}.log")
    try:
        return proc.wait(timeout=timeout)
    finally:
        stop_process(proc)


def learning_run(demo_model: Path, work: Path, steps: int = STEPS) -> dict:
    """The test's whole procedure: held-out success of ``demo_model``, the demo's training for ``steps``, held-out
    success of its final checkpoint, and the actors' own success early and late. scripts/learning_take_off.py runs
    it many times to measure the distribution the bounds below come from."""
    before = held_out(demo_model, work, "before")
    run_dir = work / "run"
    # The demo's config for a fixed number of steps (no evaluations during training, so no early stop).
    rc = train(DEMO, demo_model, run_dir, f"learner.total_steps={steps}", "learner.save_every=0",
               "eval.every=0", "eval.stop_after_plateau=0", timeout=1800)
    assert rc == 0, (work / "run.log").read_text()[-5000:]
    s = scalars(run_dir)
    for tag in ("batch/reward_mean", "env/babyai/success_mean", "batch/turns_mean", "schedule/max_turns",
                "loss/policy", "loss/entropy", "loss/approx_kl", "ratio/mean", "ratio/clip_fraction",
                "batch/staleness_mean", "buffer/dropped_total", "time/weight_sync_s", "rollout/tokens_per_s",
                "throughput/learner_tokens_per_s", "rollout/success_rate"):
        assert tag in s, f"TensorBoard scalar {tag} missing"
    rollout = s["rollout/success_rate"]
    checkpoint = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    assert checkpoint.name == f"step_{steps:06d}"
    after = held_out(checkpoint, work, "after")
    return {"steps": steps, "before": before["success_rate"], "after": after["success_rate"],
            "rollout_early": sum(rollout[:8]) / 8, "rollout_late": sum(rollout[-8:]) / 8,
            "by_level_before": before["by_category"], "by_level_after": after["by_category"]}


def test_babyai_success_rises_through_the_asynchronous_loop(demo_tiny_model, tmp_path):
    report = learning_run(demo_tiny_model, tmp_path)
    print("learning:", json.dumps(report))
    assert report["rollout_late"] >= report["rollout_early"] + ROLLOUT_RISE, report  # the actors did not fall
    assert report["after"] >= report["before"] + HELD_OUT_RISE, report
