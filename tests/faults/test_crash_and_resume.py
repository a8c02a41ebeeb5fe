"""One run directory through every way a run can end, each time resumed with ``resume=auto``: a clean end,
``kill -9`` of the buffer, of the learner and of the whole run at a random moment, and Ctrl-C while the learner is
stuck in a weight broadcast. After the last resume, nothing is lost and nothing trained twice (``horizonrl
accounting``), over all six incarnations.

Each stage is a test of its own, in file order, on the module's one run directory (a stage fails at once when
an earlier one did). Each incarnation is real: the launcher, coordinator, buffer, learner and an actor with its
vLLM engine. Supervision is off: a death ends the run, so what is tested is ``resume=auto`` after it (the
launcher replacing processes within a run is tests/faults/test_supervision.py).

The turn budget follows ScalingInter-RL's stepwise schedule, 1 turn for steps 1-2 and 2 after: every resumed
incarnation must play under the budget of the step it resumed at (a schedule restarted at step 0, or one step off
as AgentGym-RL's is after a resume, would play 1-turn episodes).
"""

from __future__ import annotations

import glob
import json
import os
import random
import signal
import time
from pathlib import Path

import psutil
import pytest
from helpers import (horizonrl_cmd, newest_step, run_events, start_process, steps_trained, stop_process,
                     wait_until)

from horizonrl.buffer.accounting import account, outbox_trajectories
from horizonrl.buffer.records import Accepted, decode_record
from horizonrl.buffer.wal import WriteAheadLog
from horizonrl.core.run_dirs import latest_checkpoint, read_state
from horizonrl.core.run_events import RunEvent

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "signpost_test.yaml"
RUN = ["rollout.num_actors=1", "rollout.n=4", "learner.groups_per_step=2", "learner.save_every=2",
       "rollout.ack_timeout_s=5", "learner.batch_resend_s=10", "buffer.capacity_groups=8", "rollout.max_unacked=8",
       "supervision.restart=false", "supervision.recover=off", "buffer.skip_equal_reward_groups=false",
       "algorithm.rounds_ctrl.type=scaling_inter_stepwise", "algorithm.rounds_ctrl.rounds=[1,2]",
       "algorithm.rounds_ctrl.steps_scaling_inter=2"]
UNTIL_KILLED = "learner.total_steps=10000"


class Chain:
    """The module's run directory and what each stage leaves for the next."""

    def __init__(self, tiny_model: Path, root: Path) -> None:
        self.tiny_model, self.root, self.run_dir = tiny_model, root, root / "run"
        self.stages_done: list[str] = []
        self.next_group_after_clean_stop = 0

    def start(self, name: str, *overrides: str):
        """An incarnation (resumed unless it is the first); returns (process, when it started, step resumed at)."""
        resumed = latest_checkpoint(self.run_dir)
        step = read_state(resumed).step if resumed is not None else 0
        started = time.time()
        proc = start_process(horizonrl_cmd("train", str(CONFIG), f"model.path={self.tiny_model}",
                                           f"run.output_dir={self.run_dir}", *RUN, UNTIL_KILLED, *overrides,
                                           *(["resume=auto"] if resumed is not None else [])),
                             self.root / f"{name}.log")
        return proc, started, step

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text(errors="replace")[-5000:]

    def require(self, *stages: str) -> None:
        missing = [s for s in stages if s not in self.stages_done]
        if missing:
            pytest.fail(f"an earlier stage failed ({', '.join(missing)}): this one has no run to resume")

    def assert_resumed(self, started: float, step: int) -> None:
        """The incarnation's learner went on from the checkpoint it resumed (its first step is the next one)."""
        [learner] = run_events(self.run_dir, RunEvent.LEARNER_STARTED, since=started)
        assert learner["resumed_step"] == step, learner
        trained = steps_trained(self.run_dir, since=started)
        assert trained and trained[0] == step + 1 and trained == sorted(trained), trained


@pytest.fixture(scope="module")
def chain(tiny_model, tmp_path_factory) -> Chain:
    return Chain(tiny_model, tmp_path_factory.mktemp("crash-and-resume"))


def role_processes(launcher_pid: int, role: str) -> list[psutil.Process]:
    """The launcher's children running ``horizonrl <role>``."""
    found = []
    for child in psutil.Process(launcher_pid).children(recursive=True):
        try:
            cmdline = child.cmdline()
        except psutil.Error:
            continue
        if "horizonrl" in cmdline and role in cmdline:
            found.append(child)
    return found


def kill_at_a_random_moment(chain: Chain, name: str, victims, also=None) -> None:
    """An incarnation killed a random 0-1.5 s after its third step (a checkpoint newer than the one it resumed
    exists by then: save_every=2), and once ``also()`` holds when given, with ``victims(launcher_pid)``; the run
    must end, not go on."""
    proc, started, step = chain.start(name)
    seed = int(time.time()) % 10_000
    try:
        wait_until(lambda: newest_step(chain.run_dir, since=started) >= step + 3, 400, f"learner step {step + 3}")
        if also is not None:
            wait_until(also, 400, f"{name}: {also.__doc__}")
        time.sleep(random.Random(seed).uniform(0, 1.5))
        for victim in victims(proc.pid):
            victim.kill()
        rc = proc.wait(timeout=300)
    finally:
        stop_process(proc)
    assert rc != 0, "the run went on as if nothing happened: " + chain.log(name)
    chain.assert_resumed(started, step)
    print(f"{name}: killed after step {newest_step(chain.run_dir, since=started)} (seed {seed})")


def produced(run_dir: Path) -> list:
    """Every trajectory the actors produced: accepted by the buffer, or still in an outbox."""
    accepted = [r.trajectory for r in map(decode_record, WriteAheadLog(run_dir / "buffer_wal").replay())
                if isinstance(r, Accepted)]
    return accepted + outbox_trajectories(run_dir)


def group_number(group_id: str) -> int:
    return int(group_id.rsplit("-g", 1)[1])


def scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, dict[int, float]] = {}
    for path in sorted(glob.glob(str(run_dir / "tensorboard" / "events.*"))):
        acc = EventAccumulator(path)
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return out


def test_a_clean_end_after_two_steps_in_the_one_turn_stage(chain):
    proc, _, _ = chain.start("clean", "learner.total_steps=2")
    try:
        rc = proc.wait(timeout=600)
    finally:
        stop_process(proc)
    assert rc == 0, chain.log("clean")
    checkpoint = latest_checkpoint(chain.run_dir)
    assert checkpoint is not None and read_state(checkpoint).step == 2
    assert scalars(chain.run_dir)["batch/turns_mean"] == {1: 1.0, 2: 1.0}  # the 1-turn stage
    state = json.loads((chain.run_dir / "actors" / "actor_0.json").read_text())
    chain.next_group_after_clean_stop = state["next_group"]
    assert chain.next_group_after_clean_stop > 0
    chain.stages_done.append("clean")


def test_kill_9_of_the_buffer_then_resume(chain):
    chain.require("clean")

    def resumed_actor_played() -> bool:
        """a group of the resumed actor, in the buffer's log or its outbox"""
        # The learner's first steps may all train on groups the buffer recovered from its log (a clean stop can
        # leave it full), long before the resumed actor's engine is up: the kill must come after it has played.
        try:
            return any(group_number(t.group_id) >= chain.next_group_after_clean_stop for t in produced(chain.run_dir))
        except Exception:  # noqa: BLE001 - a record being written as it is read: look again
            return False

    kill_at_a_random_moment(chain, "buffer", lambda pid: role_processes(pid, "buffer"), also=resumed_actor_played)
    # The resumed actor went on from its next group (no task replayed), under the 2-turn budget from its first
    # group on; the clean incarnation played 1-turn episodes until its step 2 was done.
    trajectories = produced(chain.run_dir)
    later = [t for t in trajectories if group_number(t.group_id) >= chain.next_group_after_clean_stop]
    earlier = [t for t in trajectories if group_number(t.group_id) < chain.next_group_after_clean_stop]
    assert earlier and later
    assert 1 in {t.max_turns for t in earlier} and {t.max_turns for t in later} == {2}
    assert all(t.num_turns == 2 for t in later if not t.failure)
    budget = scalars(chain.run_dir)["schedule/max_turns"]
    assert {step: turns for step, turns in budget.items() if step > 2} and all(
        turns == 2.0 for step, turns in budget.items() if step > 2), budget
    chain.stages_done.append("buffer")


def test_kill_9_of_the_learner_then_resume(chain):
    chain.require("buffer")
    started = time.time()
    kill_at_a_random_moment(chain, "learner", lambda pid: role_processes(pid, "learner"))
    # the buffer killed in the stage before replayed its write-ahead log when this incarnation started it
    assert any(e["records"] > 0 for e in run_events(chain.run_dir, RunEvent.BUFFER_RECOVERED, since=started))
    chain.stages_done.append("learner")


def test_kill_9_of_the_whole_run_then_resume(chain):
    chain.require("learner")

    def everything(launcher_pid):  # every process at once, as a power cut would
        return [psutil.Process(launcher_pid), *psutil.Process(launcher_pid).children(recursive=True)]

    kill_at_a_random_moment(chain, "whole-run", everything)
    chain.stages_done.append("whole-run")


def _suspend(processes: list[psutil.Process]) -> None:
    for p in processes:
        try:
            p.suspend()
        except (psutil.Error, ProcessLookupError):
            pass  # a short-lived helper process that has exited


def _resume(processes: list[psutil.Process]) -> None:
    for p in processes:
        try:
            p.resume()
        except (psutil.Error, ProcessLookupError):
            pass


def buffer_is_full(run_dir: Path, since: float) -> bool:
    """The buffer writes both backpressure transitions as events: the last one says whether it is full now."""
    transitions = run_events(run_dir, RunEvent.BUFFER_FULL, RunEvent.BUFFER_HAS_ROOM, since=since)
    return bool(transitions) and transitions[-1]["event"] == RunEvent.BUFFER_FULL.value


def freeze_a_broadcast(run_dir: Path, since: float, learners: list[psutil.Process],
                       engines: list[psutil.Process]) -> int:
    """Make the learner's broadcast of a version wait on engines frozen (SIGSTOP) for good; returns the step
    the learner cannot finish.

    The learner is stopped first until the actors have filled the buffer, then the engines are frozen and the
    learner resumes. Each step is trained (``step_trained``) before its weights are published, and the publish
    first waits for the previous version's send (each version is sent in the background while the next step
    trains); ``step_done`` comes once that wait has ended. So the learner trains the buffered batches until a
    step's publish waits on a send the frozen engines never take: that step is trained and its ``step_done``
    never comes until the hub drops the frozen member (after ``member_bound_s``: 20 s for the tiny model). It may
    be the step trained before the freeze (the learner was stopped inside that wait) or a later one.

    Freezing the engines whenever a step came instead depended on timing: with a second test beside it, the
    learner always caught up with the actors between freezes. Waiting for a *new* buffer-full event depended on
    timing too: a buffer that filled just before the learner stopped writes none."""
    _suspend(learners)
    try:
        wait_until(lambda: buffer_is_full(run_dir, since), 300, "the buffer full while the learner was stopped")
        _suspend(engines)
    finally:
        _resume(learners)
    # A publish that can go on takes well under a second (a tiny model's gather, no wait on the engines), a few
    # on a loaded machine; 6 s without the newest step's step_done, and without a newer step, is a wait on the
    # frozen engines, which lasts until the hub drops them (protocol/weights.py's member_bound_s, 20 s here): the
    # Ctrl-C comes inside it.
    newest, seen_at = 0, time.monotonic()

    def blocked_step() -> int | None:
        nonlocal newest, seen_at
        trained = newest_step(run_dir, since)
        if trained != newest:
            newest, seen_at = trained, time.monotonic()
            return None
        stuck = newest not in [e["step"] for e in run_events(run_dir, RunEvent.STEP_DONE, since=since)]
        return newest if stuck and time.monotonic() - seen_at >= 6 else None

    return wait_until(blocked_step, 300, "a step whose weights wait on the frozen engines")


def test_ctrl_c_during_a_weight_broadcast_leaves_a_resumable_checkpoint(chain):
    """The actor's engine processes are frozen (SIGSTOP), so the learner's weight broadcast of its next
    step cannot complete; Ctrl-C then must still end with a checkpoint of that step."""
    chain.require("whole-run")
    # No periodic checkpoints: the one Ctrl-C writes is the step the broadcast blocked. A generation caught by the
    # freeze holds its group back until it times out: 60 s, not the default 300. No staleness bound: the groups
    # buffered while the learner was stopped must all stay trainable after it resumes.
    proc, started, step = chain.start("ctrl-c", "learner.save_every=0", "learner.weight_sync_timeout_s=600",
                                      "rollout.turn_timeout_s=60", "buffer.max_staleness=10000")
    engines: list[psutil.Process] = []
    try:
        # The actor's engine up and playing (the learner may take its first steps from groups the buffer kept)
        wait_until(lambda: run_events(chain.run_dir, RunEvent.ENGINE_READY, since=started), 400, "the engine ready")
        wait_until(lambda: newest_step(chain.run_dir, since=started) >= step + 2, 400, f"learner step {step + 2}")
        engines = [p for actor in role_processes(proc.pid, "actor") for p in actor.children(recursive=True)]
        assert engines, "no engine processes under the actor"
        blocked = freeze_a_broadcast(chain.run_dir, started, role_processes(proc.pid, "learner"), engines)
        os.kill(proc.pid, signal.SIGINT)
        rc = proc.wait(timeout=300)
    finally:
        _resume(engines)
        stop_process(proc)
    assert rc == 130, chain.log("ctrl-c")
    # The stop ends the blocked broadcast one of two ways, whichever comes first: the learner gives up on it after
    # its grace (STOP_SEND_GRACE_S, 5 s; the hub's own test is tests/learner/test_learner_weight_sync.py), or the
    # actor, stopping too, kills its engine processes — frozen or not — within ~3 s, and the hub drops the member
    # whose connection closed. Either way the step is checkpointed and the run resumes.
    [done] = run_events(chain.run_dir, RunEvent.LEARNER_DONE, since=started)
    assert run_events(chain.run_dir, RunEvent.BROADCAST_ABANDONED, since=started) or done["weights_dropped"] > 0, \
        (chain.run_dir / "logs" / "learner-0.log").read_text(errors="replace")[-3000:]
    checkpoint = latest_checkpoint(chain.run_dir)
    assert checkpoint is not None and read_state(checkpoint).step == blocked, (checkpoint, blocked)
    chain.stages_done.append("ctrl-c")


def test_the_last_resume_runs_to_the_end_and_nothing_was_lost_or_trained_twice(chain):
    chain.require("ctrl-c")
    resumed_at = read_state(latest_checkpoint(chain.run_dir)).step
    total = resumed_at + 2
    proc, started, step = chain.start("last", f"learner.total_steps={total}")
    try:
        rc = proc.wait(timeout=900)
    finally:
        stop_process(proc)
    assert rc == 0, chain.log("last")
    chain.assert_resumed(started, step)
    assert steps_trained(chain.run_dir, since=started) == list(range(resumed_at + 1, total + 1))
    ledger = account(chain.run_dir)
    assert ledger["lost"] == [] and ledger["trained_twice"] == [] and ledger["in_two_fates"] == [], ledger
    assert ledger["steps"] == total and ledger["trained_once"] > 0, ledger
    accounted = (ledger["trained_once"] + sum(ledger["learner_skipped"].values()) + sum(ledger["dropped"].values())
                 + ledger["held"])
    assert accounted == ledger["accepted"], ledger
    print(f"six incarnations, {total} steps; accounting {ledger}")
