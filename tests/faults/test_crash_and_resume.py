"""``kill -9`` of the buffer, of the learner, of the whole run, at a random moment of a CPU training run;
then ``resume=auto`` to the end. Nothing is lost and nothing trained twice (``horizonrl accounting``),
and the learner's steps continue from its newest checkpoint. Also: Ctrl-C while the learner is
stuck in a weight broadcast still leaves a checkpoint a run resumes from.

Each run is real: the launcher, coordinator, buffer, learner and an actor with its vLLM engine.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import psutil
import pytest
from helpers import horizonrl_cmd, run_events, start_process, steps_trained, stop_process, wait_for_step, wait_until

from horizonrl.buffer.accounting import account
from horizonrl.core.run_dirs import latest_checkpoint, read_state
from horizonrl.core.run_events import RunEvent

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "signpost_test.yaml"
TOTAL_STEPS = 8
# Supervision off: a death ends the run here, so what is tested is `resume=auto` after it (the launcher
# replacing processes within a run is tests/faults/test_supervision.py).
SMALL_RUN = ["rollout.num_actors=1", "rollout.n=4", "learner.groups_per_step=2", "learner.save_every=2",
             "rollout.ack_timeout_s=5", "learner.batch_resend_s=10", "buffer.capacity_groups=8",
             f"learner.total_steps={TOTAL_STEPS}", "supervision.restart=false", "supervision.recover=off"]


def start(tiny_model: Path, run_dir: Path, log: Path, *overrides: str):
    return start_process(horizonrl_cmd("train", str(CONFIG), f"model.path={tiny_model}", f"run.output_dir={run_dir}",
                                       *SMALL_RUN, *overrides), log)


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


def kill_at_a_random_moment(proc, run_dir: Path, victims, seed: int) -> float:
    """After step 3 (a checkpoint of step 2 exists), wait a random 0-1.5 s, then SIGKILL ``victims()``."""
    wait_for_step(run_dir, 3, 400)
    delay = random.Random(seed).uniform(0, 1.5)
    time.sleep(delay)
    for victim in victims(proc.pid):
        victim.kill()
    return delay


def resume_to_the_end(tiny_model: Path, run_dir: Path, tmp_path: Path, total: int = TOTAL_STEPS) -> tuple[float, int]:
    """``resume=auto`` to ``total`` steps; returns when the resumed run started (Unix time) and the step it resumed
    from."""
    resumed_from = latest_checkpoint(run_dir)
    assert resumed_from is not None, "no checkpoint before the crash"
    checkpoint_step = read_state(resumed_from)["step"]
    log = tmp_path / "resumed.log"
    started = time.time()
    proc = start(tiny_model, run_dir, log, "resume=auto", f"learner.total_steps={total}")
    try:
        rc = proc.wait(timeout=900)
    finally:
        stop_process(proc)
    text = log.read_text(errors="replace")
    assert rc == 0, text[-5000:]
    # the learner continues from the checkpoint: its first step is the checkpoint's next one
    resumed = steps_trained(run_dir, since=started)
    assert resumed == list(range(checkpoint_step + 1, total + 1)), resumed
    return started, checkpoint_step


def assert_nothing_lost_nothing_twice(run_dir: Path, total: int = TOTAL_STEPS) -> dict:
    ledger = account(run_dir)
    assert ledger["lost"] == [] and ledger["trained_twice"] == [] and ledger["in_two_fates"] == [], ledger
    assert ledger["steps"] == total and ledger["trained_once"] > 0, ledger
    accounted = (ledger["trained_once"] + sum(ledger["learner_skipped"].values()) + sum(ledger["dropped"].values())
                 + ledger["held"])
    assert accounted == ledger["accepted"], ledger
    return ledger


@pytest.mark.parametrize("kind", ["buffer", "learner", "whole-run"])
def test_kill_9_then_resume_loses_nothing(tiny_model, tmp_path, kind):
    seed = int(time.time()) % 10_000
    run_dir = tmp_path / "run"
    log = tmp_path / "first.log"
    proc = start(tiny_model, run_dir, log)

    def victims(launcher_pid):
        if kind == "whole-run":  # every process at once, as a power cut would
            return [psutil.Process(launcher_pid), *psutil.Process(launcher_pid).children(recursive=True)]
        found = role_processes(launcher_pid, kind)
        assert found, f"no {kind} process to kill"
        return found

    try:
        delay = kill_at_a_random_moment(proc, run_dir, victims, seed)
        rc = proc.wait(timeout=300)
    finally:
        stop_process(proc)
    assert rc != 0, "the run went on as if nothing happened"
    print(f"{kind}: killed {delay:.2f} s after step 3 was trained (seed {seed}); steps before: "
          f"{steps_trained(run_dir)}")
    started, checkpoint_step = resume_to_the_end(tiny_model, run_dir, tmp_path)
    if kind != "learner":  # the new buffer replayed its write-ahead log
        assert any(e["records"] > 0 for e in run_events(run_dir, RunEvent.BUFFER_RECOVERED, since=started))
    ledger = assert_nothing_lost_nothing_twice(run_dir)
    print(f"{kind}: resumed from step {checkpoint_step}; accounting {ledger}")


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


def buffer_is_full(run_dir: Path) -> bool:
    """The buffer writes both backpressure transitions as events: the last one says whether it is full now."""
    transitions = run_events(run_dir, RunEvent.BUFFER_FULL, RunEvent.BUFFER_HAS_ROOM)
    return bool(transitions) and transitions[-1]["event"] == RunEvent.BUFFER_FULL.value


def freeze_a_broadcast(run_dir: Path, learners: list[psutil.Process], engines: list[psutil.Process]) -> int:
    """Make the learner's broadcast of a version wait on engines frozen (SIGSTOP) for good; returns the step
    the learner cannot finish.

    The learner is stopped first until the actors have filled the buffer, then the engines are frozen and the
    learner resumes. Each step is trained (``step_trained``) before its weights are published, and the publish
    first waits for the previous version's send (each version is sent in the background while the next step
    trains); ``step_done`` comes once that wait has ended. So the learner trains the buffered batches until a
    step's publish waits on a send the frozen engines never take: that step is trained and its ``step_done``
    never comes. It may be the step trained before the freeze (the learner was stopped inside that wait) or a
    later one.

    Freezing the engines whenever a step came instead depended on timing: with a second test beside it, the
    learner always caught up with the actors between freezes. Waiting for a *new* buffer-full event depended on
    timing too: a buffer that filled just before the learner stopped writes none."""
    _suspend(learners)
    try:
        wait_until(lambda: buffer_is_full(run_dir), 300, "the buffer full while the learner was stopped")
        _suspend(engines)
    finally:
        _resume(learners)
    # A publish that can go on takes well under a second (a tiny model's gather, no wait on the engines); 30 s
    # without the newest step's loss line, and without a newer step, is a wait that will not end.
    newest, since = 0, time.monotonic()

    def blocked_step() -> int | None:
        nonlocal newest, since
        trained = max(steps_trained(run_dir), default=0)
        if trained != newest:
            newest, since = trained, time.monotonic()
            return None
        stuck = newest not in [e["step"] for e in run_events(run_dir, RunEvent.STEP_DONE)]
        return newest if stuck and time.monotonic() - since >= 30 else None

    return wait_until(blocked_step, 300, "a step whose weights wait on the frozen engines")


def test_ctrl_c_during_a_weight_broadcast_leaves_a_resumable_checkpoint(tiny_model, tmp_path):
    """The actor's engine processes are frozen (SIGSTOP), so the learner's weight broadcast of its next
    step cannot complete; Ctrl-C then must still end with a checkpoint, and the run resumes from it."""
    run_dir = tmp_path / "run"
    log = tmp_path / "first.log"
    # Far more steps than it will reach: the learner runs ahead of the actors (up to the staleness bound), and
    # a short run could end during a moment the engines are thawed before any broadcast blocked.
    # A generation caught by the freeze holds its group back until it times out, and the buffer may hold no complete
    # group until then (one run waited the default 300 s for it, as long as the test waits for a step): 60 s.
    # No staleness bound: the groups buffered while the learner was stopped must all stay trainable after it
    # resumes (with the bound of 2, one run trained one step from them, dropped the rest as stale, and waited
    # on the frozen engines for more).
    proc = start(tiny_model, run_dir, log, "learner.save_every=0", "learner.weight_sync_timeout_s=600",
                 "learner.total_steps=10000", "rollout.turn_timeout_s=60", "buffer.max_staleness=10000")
    engines: list[psutil.Process] = []
    try:
        wait_for_step(run_dir, 2, 400)
        engines = [p for actor in role_processes(proc.pid, "actor") for p in actor.children(recursive=True)]
        assert engines, "no engine processes under the actor"
        blocked = freeze_a_broadcast(run_dir, role_processes(proc.pid, "learner"), engines)
        os.kill(proc.pid, signal.SIGINT)
        rc = proc.wait(timeout=300)
    finally:
        _resume(engines)
        stop_process(proc)
    text = log.read_text(errors="replace")
    assert rc == 130, text[-5000:]
    # The stop ends the blocked broadcast one of two ways, whichever comes first: the learner gives up on it after
    # its grace (STOP_SEND_GRACE_S, 5 s; the hub's own test is tests/learner/test_learner_weight_sync.py), or the
    # actor, stopping too, kills its engine processes — frozen or not — within ~3 s, and the hub drops the member
    # whose connection closed. Either way the step is checkpointed and the run resumes.
    [done] = run_events(run_dir, RunEvent.LEARNER_DONE)
    assert run_events(run_dir, RunEvent.BROADCAST_ABANDONED) or done["weights_dropped"] > 0, \
        (run_dir / "logs" / "learner-0.log").read_text(errors="replace")[-3000:]
    checkpoint = latest_checkpoint(run_dir)
    # the step whose broadcast was abandoned is in the checkpoint
    assert checkpoint is not None and read_state(checkpoint)["step"] == blocked, (checkpoint, blocked)
    resume_to_the_end(tiny_model, run_dir, tmp_path, total=blocked + 2)
    assert_nothing_lost_nothing_twice(run_dir, total=blocked + 2)
