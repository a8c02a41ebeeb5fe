"""``kill -9`` of the coordinator mid-run: the launcher restarts it, it reads back what nobody re-sends
(``coordinator_state.json``), and the run finishes all its learner steps with no trajectory lost and none
trained twice. The same run shows on the way that a real run's own messages pass the coordinator's checks:
a storm of invalid UTF-8 and wrong reports is counted exactly (not one message more — so no legitimate one
was refused), and the counts survive the restart.

One actor, few steps: the learner reports and registers while no coordinator listens, and the actor plays
on under the last Control it heard. Everything is read from structured files (events.jsonl, faults.jsonl,
the coordinator's state, TensorBoard), never from console wording.
"""

from __future__ import annotations

import glob
import json
from pathlib import Path

import psutil
import pytest
import zmq
from helpers import horizonrl_cmd, start_process, stop_process, wait_until

from horizonrl.buffer.accounting import account
from horizonrl.core.config import load_config
from horizonrl.core.coordinator_state import COORDINATOR_STATE_FILE
from horizonrl.core.run_events import RunEvent, read_events
from horizonrl.hostile import invalid_utf8_messages, wrong_reports

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "signpost_test.yaml"
TOTAL_STEPS = 40  # long enough that the storm is counted and the kill comes mid-run on a fast machine
SMALL_RUN = ["rollout.num_actors=1", "rollout.n=4", "learner.groups_per_step=2", "learner.save_every=2",
             "rollout.ack_timeout_s=5", "learner.batch_resend_s=10", "buffer.capacity_groups=8",
             "supervision.backoff_s=0.5", f"learner.total_steps={TOTAL_STEPS}",
             # bounds the stall of a known weight-sync bug (a staged receive "already in progress": its own issue)
             "learner.weight_sync_timeout_s=90"]


def steps_done(run_dir: Path) -> int:
    return max((e["step"] for e in read_events(run_dir, RunEvent.STEP_DONE)), default=0)


def faults(run_dir: Path) -> list[tuple[str, str]]:
    path = run_dir / "faults.jsonl"
    return [(f["name"], f["event"]) for f in map(json.loads, path.read_text().splitlines())] if path.exists() else []


def saved_counts(run_dir: Path) -> tuple[int, int]:
    """(bad, rejected) messages in the coordinator's saved state."""
    try:
        state = json.loads((run_dir / COORDINATOR_STATE_FILE).read_text())
    except (OSError, ValueError):
        return -1, -1
    return sum(state["bad_messages"].values()), sum(state["rejected"].values())


def coordinator_of(launcher_pid: int) -> psutil.Process:
    [found] = [p for p in psutil.Process(launcher_pid).children(recursive=True)
               if "horizonrl" in p.cmdline() and "coordinator" in p.cmdline()]
    return found


def last_scalars(run_dir: Path) -> dict[str, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    values: dict[str, tuple[int, float]] = {}
    for path in glob.glob(str(run_dir / "tensorboard" / "events.*")):  # one file per coordinator incarnation
        acc = EventAccumulator(path)
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            last = acc.Scalars(tag)[-1]
            if tag not in values or last.step >= values[tag][0]:
                values[tag] = (last.step, last.value)
    return {tag: value for tag, (_, value) in values.items()}


def test_a_killed_coordinator_is_restarted_and_the_run_finishes_with_nothing_lost(tiny_model, tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "train.log"
    proc = start_process(horizonrl_cmd("train", str(CONFIG), f"model.path={tiny_model}", f"run.output_dir={run_dir}",
                                       *SMALL_RUN), log)
    ctx = zmq.Context()
    try:
        wait_until(lambda: steps_done(run_dir) >= 1, 600, "the learner's first step")
        config = load_config(run_dir / "config.yaml")
        storm = list(invalid_utf8_messages(config.run.run_id))
        wrong = wrong_reports(config.run.run_id, (run_dir / "run_key").read_text().strip(),
                              total_steps=TOTAL_STEPS, num_actors=1)
        reports = ctx.socket(zmq.PUSH)
        reports.setsockopt(zmq.LINGER, 0)
        reports.connect(config.network.endpoint(config.network.report_port))
        for data in storm + [data for data, _ in wrong]:
            reports.send(data)
        # Counted and saved (every 2 s) before the kill: the restarted coordinator must count on from there.
        wait_until(lambda: saved_counts(run_dir) == (len(storm), len(wrong)), 120, "the storm counted and saved",
                   interval=0.2)
        reports.close()  # (not before: closing drops what is not sent yet)
        killed_after = steps_done(run_dir)
        coordinator_of(proc.pid).kill()
        wait_until(lambda: read_events(run_dir, RunEvent.COORDINATOR_RESTORED), 300, "the coordinator's restart")
        rc = proc.wait(timeout=900)
    finally:
        ctx.term()
        stop_process(proc)
    assert rc == 0, log.read_text(errors="replace")[-5000:]
    assert killed_after < TOTAL_STEPS, "the run ended before the kill: make it longer"
    [restored] = read_events(run_dir, RunEvent.COORDINATOR_RESTORED)
    assert restored["restarts"] == 1 and restored["step"] >= 1
    assert [e["step"] for e in read_events(run_dir, RunEvent.LEARNER_DONE)] == [TOTAL_STEPS]
    assert [f for f in faults(run_dir) if f[0] == "coordinator"] == [
        ("coordinator", "died"), ("coordinator", "restarted"), ("coordinator", "recovered")]
    ledger = account(run_dir)
    assert ledger["lost"] == [] and ledger["trained_twice"] == [] and ledger["in_two_fates"] == [], ledger
    assert ledger["steps"] == TOTAL_STEPS and ledger["trained_once"] > 0, ledger
    scalars = last_scalars(run_dir)
    # Exactly the storm, across both coordinators: no message of the run's own processes was refused.
    assert scalars["coordinator/bad_messages"] == len(storm)
    assert scalars["coordinator/rejected"] == len(wrong)
    assert scalars["coordinator/restarts"] == 1 and scalars["faults/coordinator_died"] == 1
    print(f"coordinator killed after step {killed_after}, restored at step {restored['step']}; the run finished "
          f"{TOTAL_STEPS} steps; {ledger['trained_once']} trajectories trained once, lost 0, trained twice 0; "
          f"{len(storm)} bad and {len(wrong)} rejected messages counted across the restart")
