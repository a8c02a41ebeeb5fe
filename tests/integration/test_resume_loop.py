"""``horizonrl train ... resume=auto`` through the whole loop, real engines included.

Run A trains 2 steps under a ScalingInter schedule (1 turn for steps 1–2, then 2 turns) and
stops with its checkpoint. Run B resumes it to step 4. Signpost length 2 needs 2 turns to
finish, so every episode under a 1-turn budget has 1 turn and every episode under a 2-turn
budget has exactly 2: the resumed actors must play 2 turns from the first batch on. A run
whose schedule restarted at step 0 (or came back a step off, AgentGym-RL's bug) would show
1-turn episodes in step 3's batch.
"""

import glob
from pathlib import Path

import pytest
from helpers import horizonrl_cmd, start_process, stop_process

from horizonrl.run_dirs import latest_checkpoint, read_state

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "signpost_test.yaml"
SCHEDULE = ["algorithm.rounds_ctrl.type=scaling_inter_stepwise", "algorithm.rounds_ctrl.rounds=[1,2]",
            "algorithm.rounds_ctrl.steps_scaling_inter=2", "buffer.skip_equal_reward_groups=false",
            "learner.groups_per_step=4"]


def scalars(run_dir: Path, newest_only: bool) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(glob.glob(str(run_dir / "tensorboard" / "events.*")))
    out: dict[str, dict[int, float]] = {}
    for path in files[-1:] if newest_only else files:
        acc = EventAccumulator(path)
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return out


def train(tiny_model: Path, run_dir: Path, log: Path, *overrides: str) -> str:
    proc = start_process(horizonrl_cmd("train", str(CONFIG), f"model.path={tiny_model}", f"run.output_dir={run_dir}",
                                       *SCHEDULE, *overrides), log)
    try:
        rc = proc.wait(timeout=600)
    finally:
        stop_process(proc)
    text = log.read_text(errors="replace")
    assert rc == 0, text[-5000:]
    return text


def test_resumed_run_continues_the_step_and_the_turn_budget(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    train(tiny_model, run_dir, tmp_path / "a.log", "learner.total_steps=2")
    first = latest_checkpoint(run_dir)
    assert first is not None and read_state(first)["step"] == 2
    a = scalars(run_dir, newest_only=True)
    assert a["batch/turns_mean"] == {1: 1.0, 2: 1.0}  # the 1-turn stage

    log_b = train(tiny_model, run_dir, tmp_path / "b.log", "learner.total_steps=4", "resume=auto")
    assert "resumed from" in log_b and "step 3/4" in log_b and "step 4/4" in log_b
    assert "step 1/4" not in log_b and "step 2/4" not in log_b
    b = scalars(run_dir, newest_only=True)
    assert sorted(b["batch/turns_mean"]) == [3, 4], "the resumed run must report steps 3 and 4 only"
    assert b["schedule/max_turns"] == {3: 2.0, 4: 2.0}
    # Every trajectory trained at steps 3-4 was played under the 2-turn budget.
    assert b["batch/turns_mean"] == {3: 2.0, 4: 2.0}, b["batch/turns_mean"]
    final = latest_checkpoint(run_dir)
    assert final is not None and final.name == "step_000004" and read_state(final)["step"] == 4
