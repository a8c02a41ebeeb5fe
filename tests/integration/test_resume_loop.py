"""``horizonrl train ... resume=auto`` through the whole loop, real engines included.

Run A trains 2 steps under a ScalingInter schedule (1 turn for steps 1–2, then 2 turns) and
stops with its checkpoint. Run B resumes it to step 6. The resumed actors must play under the
2-turn budget from their first group on — a run whose schedule restarted at step 0 (or came back
a step off, AgentGym-RL's bug) would play 1-turn episodes — and continue their task sequences
rather than replay them. What run A generated and did not train on is still there for run B (the
buffer's log): every trajectory is trained once, dropped with a reason, or still held.

What run A leaves behind is bounded — at most ``capacity_groups`` (4) groups in the buffer and
``max_unacked`` (8, one group) trajectories in its one actor's outbox — so run B's 4 steps of 4 groups
cannot all come from it: run B's own actor must produce groups.
"""

import glob
import json
from pathlib import Path

import pytest
from helpers import horizonrl_cmd, start_process, stop_process

from horizonrl.buffer.accounting import account, outbox_trajectories
from horizonrl.buffer.records import Accepted, decode_record
from horizonrl.buffer.wal import WriteAheadLog
from horizonrl.core.run_dirs import latest_checkpoint, read_state

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "signpost_test.yaml"
SCHEDULE = ["algorithm.rounds_ctrl.type=scaling_inter_stepwise", "algorithm.rounds_ctrl.rounds=[1,2]",
            "algorithm.rounds_ctrl.steps_scaling_inter=2", "buffer.skip_equal_reward_groups=false",
            "learner.groups_per_step=4", "buffer.capacity_groups=4", "rollout.max_unacked=8",
            "rollout.num_actors=1"]  # one engine per run: what resumes is the same for one actor as for two
RESUMED_STEPS = 6


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


def produced_trajectories(run_dir: Path) -> list:
    """What the actors produced: accepted by the buffer, or still in their outboxes (the buffer may
    have been full of run A's groups when run B stopped)."""
    accepted = [r.trajectory for r in map(decode_record, WriteAheadLog(run_dir / "buffer_wal").replay())
                if isinstance(r, Accepted)]
    return accepted + outbox_trajectories(run_dir)


def next_group_of(run_dir: Path, actor: int) -> int:
    state = run_dir / "actors" / f"actor_{actor}.json"
    return json.loads(state.read_text())["next_group"] if state.is_file() else 0


def group_number(group_id: str) -> int:
    return int(group_id.rsplit("-g", 1)[1])


def test_resumed_run_continues_the_step_and_the_turn_budget(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    train(tiny_model, run_dir, tmp_path / "a.log", "learner.total_steps=2")
    first = latest_checkpoint(run_dir)
    assert first is not None and read_state(first)["step"] == 2
    a = scalars(run_dir, newest_only=True)
    assert a["batch/turns_mean"] == {1: 1.0, 2: 1.0}  # the 1-turn stage
    next_group = {0: next_group_of(run_dir, 0)}
    assert next_group[0] > 0

    log_b = train(tiny_model, run_dir, tmp_path / "b.log", f"learner.total_steps={RESUMED_STEPS}", "resume=auto")
    assert "resuming from" in log_b and "step 3/6" in log_b and "step 6/6" in log_b
    # the learner itself says it loaded the checkpoint (its log; the console shows only what goes wrong)
    assert "resumed from" in (run_dir / "logs" / "learner-0.log").read_text(errors="replace")
    assert "step 1/6" not in log_b and "step 2/6" not in log_b
    b = scalars(run_dir, newest_only=True)
    assert sorted(b["batch/turns_mean"]) == [3, 4, 5, 6], "the resumed run must report steps 3 to 6 only"
    assert b["schedule/max_turns"] == {3: 2.0, 4: 2.0, 5: 2.0, 6: 2.0}
    final = latest_checkpoint(run_dir)
    assert final is not None and final.name == "step_000006" and read_state(final)["step"] == 6

    # Run B's actors went on from their next group (no task replayed), all under the 2-turn budget;
    # run A's played under 1 turn until step 2 was done (then under 2, until it stopped).
    trajectories = produced_trajectories(run_dir)
    run_b = [t for t in trajectories if group_number(t.group_id) >= next_group[t.actor_id]]
    run_a = [t for t in trajectories if group_number(t.group_id) < next_group[t.actor_id]]
    assert run_a and run_b
    assert 1 in {t.max_turns for t in run_a} and {t.max_turns for t in run_b} == {2}
    assert all(t.num_turns == 2 for t in run_b if not t.failure)
    ledger = account(run_dir)
    assert ledger["lost"] == [] and ledger["trained_twice"] == [] and ledger["in_two_fates"] == [], ledger
    assert ledger["steps"] == RESUMED_STEPS and ledger["trained_once"] > 0
