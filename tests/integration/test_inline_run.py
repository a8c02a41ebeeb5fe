"""``launcher.type=inline`` (apps/inline_run.py): a whole run in one process, every role a thread of it, over the
same protocol and supervisor as a local run. One real run (coordinator, buffer, learner, two actors with their vLLM
engines) is observed by the first test; its Ctrl-C by the second; the backend's rules are tested in-process."""

import os
import signal
import threading
import time

import psutil
import pytest
from helpers import horizonrl_cmd, run_events, start_process, still_running, stop_process, wait_until

from horizonrl.apps.inline_run import InlineRoles, check_inline
from horizonrl.core.config import ConfigError, load_config
from horizonrl.core.run_events import RunEvent
from horizonrl.launcher.supervisor import ProcessSpec

REPO = __import__("pathlib").Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "signpost_test.yaml"
STEPS = 3


@pytest.mark.slow
def test_a_whole_run_in_one_process_trains_to_the_end(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    proc = start_process(horizonrl_cmd("train", str(CONFIG), f"model.path={tiny_model}", f"run.output_dir={run_dir}",
                                       "launcher.type=inline", "rollout.num_actors=2",
                                       f"learner.total_steps={STEPS}"), tmp_path / "run.log")
    try:
        rc = proc.wait(timeout=600)
    finally:
        stop_process(proc)
    assert rc == 0, (tmp_path / "run.log").read_text()[-5000:]
    [done] = run_events(run_dir, RunEvent.LEARNER_DONE)
    assert done["step"] == STEPS and not done["stopped_early"]
    assert [e["step"] for e in run_events(run_dir, RunEvent.STEP_TRAINED)] == list(range(1, STEPS + 1))
    assert len(run_events(run_dir, RunEvent.ENGINE_READY)) == 2
    # Every role wrote its events from the one process `horizonrl train` is: they were its threads.
    events = run_events(run_dir)
    roles = {e["role"] for e in events}
    assert {"coordinator", "learner-0", "actor-0", "actor-1", "launcher"} <= roles, roles
    assert {e["pid"] for e in events} == {proc.pid}
    started = [e["name"] for e in run_events(run_dir, RunEvent.PROCESS_STARTED)]
    assert sorted(started) == ["actor-0", "actor-1", "buffer", "coordinator", "learner-0"]
    assert (run_dir / "logs" / "inline.log").is_file() and not (run_dir / "logs" / "actor-0.log").exists()


@pytest.mark.slow
def test_ctrl_c_ends_an_inline_run_with_a_checkpoint_and_leaves_no_process(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    proc = start_process(horizonrl_cmd("train", str(CONFIG), f"model.path={tiny_model}", f"run.output_dir={run_dir}",
                                       "launcher.type=inline", "rollout.num_actors=1", "learner.total_steps=100000"),
                         tmp_path / "run.log")
    try:
        wait_until(lambda: run_events(run_dir, RunEvent.STEP_DONE), 300, "the first learner step")
        # vLLM's EngineCore and its worker, and multiprocessing's resource tracker (it ends once its parent has)
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children
        os.kill(proc.pid, signal.SIGINT)  # the process alone, as the launcher's tests do
        rc = proc.wait(timeout=180)
        # Before stop_process below kills the process group: what the run itself left behind.
        try:
            wait_until(lambda: not [p for p in children if still_running(p)], 30, "the run's child processes to end",
                       interval=0.2)
        except TimeoutError:
            raise AssertionError(f"left running: {[(p.pid, p.cmdline()[:3]) for p in children if still_running(p)]}"
                                 ) from None
    finally:
        stop_process(proc)
    assert rc == 130, (tmp_path / "run.log").read_text()[-5000:]
    [done] = run_events(run_dir, RunEvent.LEARNER_DONE)
    assert done["checkpoint"] and run_events(run_dir, RunEvent.CHECKPOINT_WRITTEN)


# ---------------------------------------------------------------------------- the backend, in-process


class ScriptedRoles(InlineRoles):
    """InlineRoles whose roles are functions of the test: the supervisor's side of the backend alone."""

    def __init__(self, tmp_path, roles) -> None:
        config = load_config(CONFIG, [f"model.path={tmp_path}", f"run.output_dir={tmp_path}"])
        super().__init__(config, status_out=lambda line: None)
        self.scripted = roles

    def _role(self, spec, stop):
        return lambda: self.scripted[spec.name](stop)


def test_the_backend_reports_exits_and_stops_a_role_through_its_own_flag(tmp_path):
    started = threading.Event()

    def waits_for_its_stop(stop):
        started.set()
        assert stop.wait(30)
        return 0 if stop.signal_name == "SIGTERM" else 3

    def fails(stop):
        raise RuntimeError("broken on purpose")

    roles = ScriptedRoles(tmp_path, {"buffer": waits_for_its_stop, "actor-0": fails})
    roles.start(ProcessSpec("buffer", []))
    roles.start(ProcessSpec("actor-0", []))
    assert started.wait(10)
    exits = wait_until(lambda: roles.poll(0.1), 10, "the failing role's exit")
    assert exits == [("actor-0", 1)]  # an exception is the role's failure, as a process's non-zero exit
    assert roles.running("buffer") and not roles.running("actor-0")
    roles.signal("buffer", signal.SIGTERM)
    assert wait_until(lambda: roles.poll(0.1), 10, "the stopped role's exit") == [("buffer", 0)]
    with pytest.raises(RuntimeError, match="does not start a role twice"):
        roles.start(ProcessSpec("buffer", []))
    roles.close()
    assert [e["name"] for e in run_events(tmp_path, RunEvent.PROCESS_STARTED)] == ["buffer", "actor-0"]


def test_close_does_not_wait_for_ever_on_a_role_that_ignores_its_stop(tmp_path, monkeypatch):
    import horizonrl.apps.inline_run as inline_run

    monkeypatch.setattr(inline_run, "ROLE_STOP_WAIT_S", 0.5)
    ended = []  # not this test's process's children for real: pytest's own would go with them
    monkeypatch.setattr(inline_run, "end_child_processes", lambda: ended.append(True))
    release = threading.Event()
    roles = ScriptedRoles(tmp_path, {"coordinator": lambda stop: release.wait(60) and 0})
    roles.start(ProcessSpec("coordinator", []))
    roles.kill("coordinator")  # cannot be killed: asked to stop, left to end
    start = time.monotonic()
    roles.close()
    assert time.monotonic() - start < 10 and roles.running("coordinator")
    assert ended == [True]  # a role left behind: the processes it may have left are ended
    release.set()


def test_what_needs_processes_is_refused_before_anything_starts(tmp_path):
    def config(*overrides):
        return load_config(CONFIG, [f"model.path={tmp_path}", *overrides])

    check_inline(config())
    with pytest.raises(ConfigError, match="one learner rank"):
        check_inline(config("learner.num_ranks=2"))
    with pytest.raises(ConfigError, match="resources.learner_cpus"):
        check_inline(config("resources.learner_cpus=[0]"))
    with pytest.raises(ConfigError, match="environment servers"):
        check_inline(config("envs=[{name: http, settings: {url: 'http://127.0.0.1:9', env: signpost, managed: true}}]"))
