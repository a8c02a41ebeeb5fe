"""BabyAI (minigrid) end to end through the real asynchronous loop: actors play the real
environment in vLLM, the buffer groups, the learner steps and broadcasts, a checkpoint is saved. The run is
conftest.py's ``recorded_babyai_run`` (the viewer's browser test browses the same run)."""

import glob
import json

import pytest
from helpers import RECORDED_RUN_STEPS, RECORDED_RUN_TURNS, steps_trained

pytestmark = pytest.mark.slow


def test_babyai_runs_through_the_whole_loop(recorded_babyai_run):
    run_dir = recorded_babyai_run  # conftest.py: 5 learner steps, 8 turns at most, every group recorded
    assert steps_trained(run_dir) == list(range(1, RECORDED_RUN_STEPS + 1))
    assert (run_dir / "checkpoints" / f"step_{RECORDED_RUN_STEPS:06d}" / "model.safetensors").exists()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(glob.glob(str(run_dir / "tensorboard" / "events.*"))[0])
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert "env/babyai/success_mean" in tags and "batch/turns_mean" in tags
    turns = [e.value for e in acc.Scalars("batch/turns_mean")]
    # multi-turn episodes under the turn budget
    assert all(1 <= t <= RECORDED_RUN_TURNS for t in turns) and max(turns) > 1
    # what the agent did, as text: in TensorBoard and in episodes.jsonl
    assert "episodes/babyai/text_summary" in acc.Tags()["tensors"]
    samples = [json.loads(line) for line in (run_dir / "episodes.jsonl").read_text().splitlines()]
    assert samples and all(s["env"] == "babyai" for s in samples)
    first = samples[0]["transcript"]
    assert first[0][0] == "observation" and first[0][1].startswith("Goal: go to the red ball") and first[1][0] == "reply"
    # every episode recorded as text by the buffer, and the steps that trained on them
    records = [json.loads(line) for f in sorted((run_dir / "episodes").glob("episodes-*.jsonl"))
               for line in f.read_text().splitlines()]
    episodes = [r for r in records if r["kind"] == "episode"]
    trained = {g: r["learner_step"] for r in records if r["kind"] == "trained" for g in r["group_ids"]}
    assert episodes and all(e["env"] == "babyai" and e["first_observation"].startswith("Goal:") for e in episodes)
    assert all(len(e["turns"]) == e["num_turns"] for e in episodes)
    assert any(t["reply"] and t["observation"] for e in episodes for t in e["turns"])
    assert sorted(set(trained.values())) == list(range(1, RECORDED_RUN_STEPS + 1))
    assert {e["group_id"] for e in episodes} >= set(trained)  # every trained group's episodes were recorded
