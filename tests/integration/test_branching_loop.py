"""A chat template that rewrites history (Qwen3-style: an empty think block in each generation prompt, none in the
history) trains through the whole loop: the tiny model with that template, one actor, three learner steps.

Every turn of such an episode starts a new sample. What the buffer logged (what the learner trains on) holds, per
turn, exactly the template's rendering of the conversation so far followed by the generated tokens, and the
learner's log-probabilities of those tokens agree with the engine's (the per-turn mismatch metric, TensorBoard).
"""

from __future__ import annotations

import glob
import shutil
from pathlib import Path

import pytest
from helpers import horizonrl_cmd, start_process, stop_process

from horizonrl.apps.tiny_model import THINKING_CHAT_TEMPLATE
from horizonrl.buffer.records import Accepted, decode_record
from horizonrl.buffer.wal import WriteAheadLog
from horizonrl.protocol.arrays import MASK_DTYPE, TOKEN_DTYPE, unpack

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "signpost_test.yaml"
STEPS = 3
# Float32 on both sides, the same weights (no staleness): the engine's and the learner's log-probabilities of a
# token agree to ~1e-6 (docs: DESIGN.md, "Weights into a live engine"); a prompt that differed by one token
# would move them by far more.
MISMATCH_BOUND = 1e-3


def scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, dict[int, float]] = {}
    for path in glob.glob(str(run_dir / "tensorboard" / "events.*")):
        acc = EventAccumulator(path, size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return out


def test_a_qwen3_style_template_trains_through_the_loop_token_exact(tiny_model, tmp_path):
    from transformers import AutoTokenizer

    from horizonrl.core.chat import ChatTokenizer

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    (model / "chat_template.jinja").write_text(THINKING_CHAT_TEMPLATE)
    chat = ChatTokenizer(AutoTokenizer.from_pretrained(model))
    assert chat.append_only is False

    run_dir, log_path = tmp_path / "run", tmp_path / "train.log"
    # One process (launcher.type=inline, apps/inline_run.py): this test is about the loop's logic, not processes.
    proc = start_process(horizonrl_cmd(
        "train", str(CONFIG), f"model.path={model}", f"run.output_dir={run_dir}", "launcher.type=inline",
        "rollout.num_actors=1",
        f"learner.total_steps={STEPS}", "learner.groups_per_step=2", "buffer.capacity_groups=4",
        "buffer.max_staleness=0", "monitor.record_fraction=1.0", "eval.episodes=0"), log_path)
    try:
        rc = proc.wait(timeout=600)
    finally:
        stop_process(proc)
    assert rc == 0, log_path.read_text()[-4000:]

    trajectories = [r.trajectory for r in map(decode_record, WriteAheadLog(run_dir / "buffer_wal").replay())
                    if isinstance(r, Accepted)]
    played = [t for t in trajectories if not t.failure and t.num_turns >= 2]
    assert played, f"no episode of two turns among {len(trajectories)}"
    for t in played:
        ids, mask = unpack(t.token_ids, TOKEN_DTYPE).tolist(), unpack(t.loss_mask, MASK_DTYPE).tolist()
        bounds = t.sample_bounds()
        assert len(bounds) == t.num_turns  # every turn's prompt drops the think block of the one before
        observations = [t.text.first_observation, *t.text.observations]
        for k, ((start, end), (turn_start, turn_end)) in enumerate(zip(bounds, t.turn_spans)):
            prompt = chat.conversation_ids(observations[:k + 1], t.text.replies[:k])
            assert ids[start:turn_start] == prompt, f"{t.trajectory_id} turn {k + 1}"
            assert turn_end == end and mask[start:end] == [0] * len(prompt) + [1] * (end - turn_start)

    tb = scalars(run_dir)
    trained = tb["batch/trajectories_trained"]
    assert sorted(trained) == list(range(1, STEPS + 1))
    assert all(tb["batch/samples_trained"][s] > trained[s] for s in trained if trained[s] > 0)
    measured = sorted(tb.get("mismatch/mean", {}))
    assert measured, f"no step measured the mismatch: {sorted(tb)}"
    for step in measured:
        assert tb["mismatch/max"][step] < MISMATCH_BOUND, (step, tb["mismatch/max"][step])
        assert tb["mismatch/turn_1_mean"][step] < MISMATCH_BOUND and tb["mismatch/turn_2_mean"][step] < MISMATCH_BOUND
    print("mismatch/mean by step:", {s: tb["mismatch/mean"][s] for s in measured},
          "max:", {s: tb["mismatch/max"][s] for s in measured})
