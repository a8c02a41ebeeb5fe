"""Held-out evaluation during training through the real loop (coordinator, buffer, learner, one actor
with its vLLM engine): ``eval.every=2`` over 4 learner steps logs ``eval/success_rate`` at steps 0, 2
and 4 — the last one although the learner is done by then — and ``horizonrl report`` draws the run."""

import glob
import json
import subprocess
from pathlib import Path

import pytest
from helpers import horizonrl_cmd, start_process, stop_process

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "signpost_test.yaml"
EPISODES = 8


def scalars_by_step(run_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(glob.glob(str(run_dir / "tensorboard" / "events.*"))[0])
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_held_out_success_is_logged_every_n_steps_and_after_the_last(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    # One actor: the learner cannot step before it is up, so it sees the request for step 0 too.
    proc = start_process(horizonrl_cmd("train", str(CONFIG), f"model.path={tiny_model}", f"run.output_dir={run_dir}",
                                       "learner.total_steps=4", "rollout.num_actors=1", "eval.every=2",
                                       f"eval.episodes_during_training={EPISODES}"), tmp_path / "run.log")
    try:
        rc = proc.wait(timeout=600)
    finally:
        stop_process(proc)
    assert rc == 0, (tmp_path / "run.log").read_text()[-5000:]

    s = scalars_by_step(run_dir)
    assert set(s["eval/success_rate"]) == {0, 2, 4}, s.get("eval/success_rate")
    assert set(s["eval/signpost/success_rate"]) == {0, 2, 4}
    assert all(v == EPISODES for v in s["eval/signpost/episodes_valid"].values())
    for step in (2, 4):  # played with the step's weights or newer (never older)
        assert s["eval/weight_version_min"][step] >= step
    assert all(0.0 <= v <= 1.0 for v in s["eval/success_rate"].values())

    out = tmp_path / "report"
    done = subprocess.run(horizonrl_cmd("report", str(run_dir), "--out", str(out)), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    rows = json.loads((out / "learning.json").read_text())
    held_out = rows[0]["held-out success"]
    assert (held_out["first_step"], held_out["last_step"]) == (0, 4)
    assert held_out["first"] == pytest.approx(s["eval/success_rate"][0])
    assert held_out["last"] == pytest.approx(s["eval/success_rate"][4])
    assert rows[0]["steps"] == 4 and rows[0]["rollout success"] is not None and rows[0]["KL"] is not None
    assert (out / "learning.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
