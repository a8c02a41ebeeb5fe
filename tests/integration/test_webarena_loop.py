"""WebArena end to end through the real asynchronous loop: the actor plays the bundled shop and forum
tasks in a real browser with a vLLM engine, the buffer groups, the learner steps and broadcasts, and
the episodes are visible in TensorBoard and episodes.jsonl. A smoke test: it shows the system runs
on WebArena, not that the tiny model learns it."""

import glob
import json
from pathlib import Path

import pytest
import suite_models
from helpers import horizonrl_cmd, start_process, steps_trained, stop_process

pytestmark = [pytest.mark.slow, pytest.mark.system]  # Chromium

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def webarena_tiny_model() -> Path:
    return suite_models.webarena_model()  # a short warm-up: this test needs replies, not skill


def test_webarena_runs_through_the_whole_loop(webarena_tiny_model, tmp_path):
    run_dir = tmp_path / "webarena"
    # One process (launcher.type=inline, apps/inline_run.py): this test is about the loop's logic, not processes.
    proc = start_process(horizonrl_cmd(
        "train", str(REPO / "configs" / "webarena_tiny.yaml"), f"model.path={webarena_tiny_model}",
        f"run.output_dir={run_dir}", "launcher.type=inline"), tmp_path / "webarena.log")
    try:
        rc = proc.wait(timeout=900)
    finally:
        stop_process(proc)
    log = (tmp_path / "webarena.log").read_text()
    assert rc == 0, log[-4000:]
    assert steps_trained(run_dir) == [1, 2, 3]
    assert (run_dir / "checkpoints" / "step_000003" / "model.safetensors").exists()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(glob.glob(str(run_dir / "tensorboard" / "events.*"))[0])
    acc.Reload()
    assert "env/webarena/success_mean" in acc.Tags()["scalars"]
    turns = [e.value for e in acc.Scalars("batch/turns_mean")]
    assert turns and all(1 <= t <= 3 for t in turns)
    # what the agent did, as text: in TensorBoard and in episodes.jsonl
    assert "episodes/webarena/text_summary" in acc.Tags()["tensors"]
    samples = [json.loads(line) for line in (run_dir / "episodes.jsonl").read_text().splitlines()]
    assert samples and all(s["env"] == "webarena" for s in samples)
    first = samples[0]["transcript"]
    assert first[0][0] == "observation" and "OBSERVATION:\nTab 0 (current): " in first[0][1]
    assert first[1][0] == "reply"
    records = [json.loads(line) for f in sorted((run_dir / "episodes").glob("episodes-*.jsonl"))
               for line in f.read_text().splitlines()]
    episodes = [r for r in records if r["kind"] == "episode"]
    trained = {r["learner_step"] for r in records if r["kind"] == "trained"}
    assert episodes and all(e["env"] == "webarena" and "OBJECTIVE:" in e["first_observation"] for e in episodes)
    assert trained == {1, 2, 3}
