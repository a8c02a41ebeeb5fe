"""Held-out evaluation during training through the real loop (coordinator, buffer, learner, one actor
with its vLLM engine): ``eval.every=2`` logs ``eval/success_rate`` at steps 0, 2, 4, ... (each at the step
of the oldest weights that played it); with
``eval.stop_after_plateau=2`` and a progress bar no evaluation can clear (``plateau_min_delta=1``) the
evaluations at 2 and 4 are a plateau, so the coordinator ends training: the learner stops at its next step
boundary, long before ``total_steps``, saves, and its last step is evaluated (if it was not already) although
the learner is done by then. ``horizonrl report`` draws the run."""

import glob
import json
import subprocess
from pathlib import Path

import pytest
from helpers import horizonrl_cmd, run_events, start_process, stop_process

from horizonrl.core.run_events import RunEvent

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "signpost_test.yaml"
EPISODES = 8
TOTAL_STEPS = 40


def scalars_by_step(run_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(glob.glob(str(run_dir / "tensorboard" / "events.*"))[0])
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_held_out_success_is_logged_every_n_steps_and_a_plateau_ends_training(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    # One actor: the learner cannot step before it is up, so it sees the request for step 0 too.
    # One process (launcher.type=inline, apps/inline_run.py): this test is about the loop's logic, not processes.
    proc = start_process(horizonrl_cmd("train", str(CONFIG), f"model.path={tiny_model}", f"run.output_dir={run_dir}",
                                       "launcher.type=inline",
                                       f"learner.total_steps={TOTAL_STEPS}", "rollout.num_actors=1", "eval.every=2",
                                       f"eval.episodes_during_training={EPISODES}", "eval.stop_after_plateau=2",
                                       "eval.plateau_min_delta=1.0"), tmp_path / "run.log")
    try:
        rc = proc.wait(timeout=600)
    finally:
        stop_process(proc)
    assert rc == 0, (tmp_path / "run.log").read_text()[-5000:]

    checkpoints = sorted((run_dir / "checkpoints").glob("step_*"))
    last = int(checkpoints[-1].name.split("_")[1])
    # ended at the plateau (the evaluation at step 4): at once when the learner was between steps, after the
    # step in progress otherwise; not at total_steps
    assert 4 <= last < TOTAL_STEPS, last
    [ended] = run_events(run_dir, RunEvent.TRAINING_ENDED_EARLY)
    assert ended["reason"] == "eval.stop_after_plateau", ended
    [done] = run_events(run_dir, RunEvent.LEARNER_DONE)
    assert done["stopped_early"] and done["step"] == last, done

    s = scalars_by_step(run_dir)
    # Logged at the step of the oldest weights that played it: 2 and 4 as asked, or a little later when the
    # engine had moved on; the plateau needs the evaluations at 0 and two more, then the last step's.
    evaluated = set(s["eval/success_rate"])
    assert 0 in evaluated and max(evaluated) == last and len(evaluated) >= 3, (evaluated, last)
    assert set(s["eval/signpost/success_rate"]) == evaluated
    assert all(v == EPISODES for v in s["eval/signpost/episodes_valid"].values())
    assert all(s["eval/weight_version_min"][step] == step for step in evaluated), s["eval/weight_version_min"]
    assert all(0.0 <= v <= 1.0 for v in s["eval/success_rate"].values())

    out = tmp_path / "report"
    done = subprocess.run(horizonrl_cmd("report", str(run_dir), "--out", str(out)), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    rows = json.loads((out / "learning.json").read_text())
    held_out = rows[0]["held-out success"]
    assert (held_out["first_step"], held_out["last_step"]) == (0, last)
    assert held_out["first"] == pytest.approx(s["eval/success_rate"][0])
    assert held_out["last"] == pytest.approx(s["eval/success_rate"][last])
    assert rows[0]["steps"] == last and rows[0]["rollout success"] is not None and rows[0]["KL"] is not None
    assert (out / "learning.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
