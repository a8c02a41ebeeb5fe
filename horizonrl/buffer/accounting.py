"""Where every trajectory of a run went: trained once, dropped with a reason, still held — or lost,
or trained twice (both must be 0).

Read from what the run keeps on disk, with no process running:
- the buffer's write-ahead log (every trajectory it accepted, and what became of it there);
- the learner's checkpoints: each one names what every step since the checkpoint before it in the
  same lineage trained on (``consumed``); following ``consumed_since`` back from the newest
  checkpoint gives the steps of the run as it stands, with no step of an abandoned branch;
- the actors' outboxes (trajectories produced but not yet acknowledged by the buffer).

``horizonrl accounting RUN_DIR`` prints it as JSON.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from horizonrl.buffer.groups import FATE_DROPPED, GroupBuffer
from horizonrl.buffer.records import apply, decode_record
from horizonrl.buffer.wal import WriteAheadLog
from horizonrl.core.outbox import read_outbox
from horizonrl.core.run_dirs import RunDir, checkpoint_dir, latest_checkpoint, read_state
from horizonrl.protocol import Trajectory


def buffer_state(output_dir: str | Path) -> GroupBuffer:
    """The buffer's state as its log leaves it (the log's Settings records set how it decides)."""
    state = GroupBuffer(capacity_groups=1, max_staleness=0, skip_equal_reward_groups=True,
                        group_timeout_s=float("inf"))
    wal_dir = RunDir(output_dir).buffer_wal
    if wal_dir.is_dir():
        for payload in WriteAheadLog(wal_dir).replay():
            apply(state, decode_record(payload))
    return state


def trained_steps(output_dir: str | Path) -> list[dict[str, Any]]:
    """The ``consumed`` entries of every step of the newest checkpoint's lineage, oldest first."""
    steps: list[dict[str, Any]] = []
    checkpoint = latest_checkpoint(output_dir)
    while checkpoint is not None:
        state = read_state(checkpoint)
        steps = list(state.consumed) + steps
        since = state.consumed_since
        checkpoint = checkpoint_dir(output_dir, since) if since > 0 else None
        if checkpoint is not None and not checkpoint.is_dir():
            raise FileNotFoundError(f"checkpoint {checkpoint} (named by a newer one) is missing: the run's history "
                                    "cannot be followed back")
    return steps


def outbox_ids(output_dir: str | Path) -> set[str]:
    """Trajectories in the actors' outboxes not yet acknowledged by the buffer."""
    return {t.trajectory_id for t in outbox_trajectories(output_dir)}


def outbox_trajectories(output_dir: str | Path) -> list[Trajectory]:
    """The trajectories in the actors' outboxes that the buffer has not acknowledged (an entry that does not
    decode cannot be sent either: it is not among them)."""
    return [trajectory for outbox in RunDir(output_dir).outboxes() for segment in read_outbox(outbox)
            for _, trajectory in segment.unacked]


def account(output_dir: str | Path) -> dict[str, Any]:
    """Every trajectory the buffer accepted is exactly one of: trained once, left out by the learner
    (with its reason), dropped by the buffer (with its reason), or still held (buffered, or handed
    to a learner step that no checkpoint holds); ``lost`` and ``trained_twice`` list the exceptions."""
    state = buffer_state(output_dir)
    steps = trained_steps(output_dir)
    trained_count: Counter[str] = Counter()
    learner_skipped: dict[str, str] = {}
    for step in steps:
        for outcome, ids in step["trajectories"].items():
            for trajectory_id in ids:
                if outcome == "trained":
                    trained_count[trajectory_id] += 1
                else:
                    learner_skipped[trajectory_id] = outcome
    held = state.held_ids() | (state.in_flight_ids() - set(trained_count) - set(learner_skipped))
    dropped = {i: f[len(FATE_DROPPED):] for i, f in state.fates.items() if f.startswith(FATE_DROPPED)}
    fates = {"trained": set(trained_count), "learner_skipped": set(learner_skipped), "dropped": set(dropped),
             "held": held}
    lost = sorted(state.seen - set().union(*fates.values()))
    in_two = sorted(i for a in fates for b in fates if a < b for i in fates[a] & fates[b])
    return {
        "accepted": len(state.seen),
        "trained_once": sum(1 for n in trained_count.values() if n == 1),
        "trained_twice": sorted(i for i, n in trained_count.items() if n > 1),
        "learner_skipped": dict(Counter(learner_skipped.values())),
        "dropped": dict(Counter(dropped.values())),
        "held": len(held),
        "lost": lost,
        "in_two_fates": in_two,
        "not_yet_delivered": len(outbox_ids(output_dir) - state.seen),
        "steps": len(steps),
        "rejected_at_the_door": dict(state.rejected),
    }
