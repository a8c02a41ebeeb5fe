"""The supervisor's policy, with a backend that starts nothing: which exits end the run, which are restarted
and after what back-off, the learner's gang restart, a give-up past the limit, and the order of a stop. The
local and Ray launchers are two backends of this one class (launcher/supervisor.py); their processes are
started for real in tests/integration and tests/faults."""

from __future__ import annotations

import signal

import pytest

from horizonrl.core.config import TrainConfig
from horizonrl.core.runtime import StopFlag
from horizonrl.launcher.supervisor import ProcessSpec, Supervisor
from horizonrl.protocol import EVENT_DIED, EVENT_GAVE_UP, EVENT_RESTARTED


class FakeBackend:
    """Records what the supervisor asks; the test says which processes exit (``exit``)."""

    restartable = frozenset({"actor", "buffer", "env", "coordinator"})

    def __init__(self) -> None:
        self.started: list[str] = []
        self.signals: list[tuple[str, int, bool]] = []
        self.killed: list[str] = []
        self.alive: set[str] = set()
        self.exits: list[tuple[str, int | None]] = []
        self.gangs = 0

    def start(self, spec: ProcessSpec) -> None:
        self.started.append(spec.name)
        self.alive.add(spec.name)

    def exit(self, name: str, rc: int | None) -> None:
        self.alive.discard(name)
        self.exits.append((name, rc))

    def poll(self, wait_s: float) -> list[tuple[str, int | None]]:
        exits, self.exits = self.exits, []
        return exits

    def signal(self, name: str, sig: int, *, group: bool = False) -> None:
        self.signals.append((name, sig, group))
        self.alive.discard(name)  # every process here stops when asked

    def kill(self, name: str) -> None:
        self.killed.append(name)
        self.alive.discard(name)

    def running(self, name: str) -> bool:
        return name in self.alive

    def learner_gang(self, *extra: str) -> list[ProcessSpec]:
        self.gangs += 1
        return [ProcessSpec(f"learner-{r}", ["learner", *extra], essential=True) for r in range(2)]

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def run(tmp_path):
    config = TrainConfig.model_validate({
        "run": {"output_dir": str(tmp_path), "run_id": "sup"}, "model": {"path": "unused"},
        "envs": [{"name": "signpost"}], "supervision": {"max_restarts": 2, "max_learner_restarts": 1,
                                                        "backoff_s": 0.0, "max_backoff_s": 0.0}})
    backend = FakeBackend()
    supervisor = Supervisor(config, backend)
    reported: list[tuple[str, str]] = []
    supervisor.report = lambda name, event, **fields: reported.append((name, event))
    supervisor.start(ProcessSpec("coordinator", ["coordinator"], essential=True))
    supervisor.start(ProcessSpec("buffer", ["buffer"]))
    supervisor.start_learner()
    supervisor.start(ProcessSpec("actor-0", ["actor"]))
    return supervisor, backend, reported


def watch_once(supervisor: Supervisor) -> int | None:
    """One pass of the watch loop: due restarts, then the exits the backend has; None: it goes on."""
    supervisor._start_due()
    return supervisor.handle_exits(supervisor.backend.poll(0))


def test_a_dead_process_is_restarted_until_its_limit(run):
    supervisor, backend, reported = run
    for _ in range(2):
        backend.exit("actor-0", -9)
        assert watch_once(supervisor) is None and watch_once(supervisor) is None  # died; restarted (no back-off)
    assert backend.started.count("actor-0") == 3 and "actor-0" in backend.killed  # leftovers of the dead one
    backend.exit("actor-0", None)  # its host died: a death like any other
    assert watch_once(supervisor) == 1  # a third restart within the window: the run stops
    assert reported[-2:] == [("actor-0", EVENT_DIED), ("actor-0", EVENT_GAVE_UP)]
    assert reported.count(("actor-0", EVENT_RESTARTED)) == 2


def test_a_dead_learner_rank_restarts_the_whole_gang_from_its_checkpoint(run):
    supervisor, backend, reported = run
    backend.exit("learner-1", 1)
    assert watch_once(supervisor) is None
    assert ("learner-0", signal.SIGTERM, True) in backend.signals  # the survivor, with what it spawned
    assert {"learner-0", "learner-1"} <= set(backend.killed)
    assert watch_once(supervisor) is None  # the new gang starts
    assert backend.gangs == 2 and supervisor.specs["learner-0"].argv == ["learner", "--resume", "auto"]
    assert reported == [("learner-1", EVENT_DIED), ("learner", EVENT_RESTARTED)]
    backend.exit("learner-0", 1)  # past supervision.max_learner_restarts
    assert watch_once(supervisor) == 1 and reported[-1] == ("learner", EVENT_GAVE_UP)


def test_two_learner_ranks_dying_in_one_poll_restart_the_gang_once(run):
    # A rank killed and its peer failing on the broken collective a moment later: both exits can arrive in
    # the same poll, after the first has already stopped the gang and forgotten its members.
    supervisor, backend, reported = run
    backend.exit("learner-0", 1)
    backend.exit("learner-1", -9)
    assert watch_once(supervisor) is None
    assert reported == [("learner-0", EVENT_DIED)]
    assert watch_once(supervisor) is None  # the new gang starts, once
    assert backend.gangs == 2 and reported[-1] == ("learner", EVENT_RESTARTED)
    assert supervisor.specs["learner-1"].argv == ["learner", "--resume", "auto"]


def test_a_dead_coordinator_is_restarted_and_a_finished_one_let_go(run):
    supervisor, backend, reported = run
    backend.exit("coordinator", -9)
    assert watch_once(supervisor) is None and reported == [("coordinator", EVENT_DIED)]
    assert [what for _, what, _ in supervisor.due] == ["coordinator"]
    watch_once(supervisor)
    backend.exit("coordinator", 0)  # after the learner's final report
    assert watch_once(supervisor) is None and not supervisor.due


def test_the_run_is_over_when_every_essential_process_exited_0(run):
    supervisor, backend, _ = run
    for name in ("learner-0", "learner-1", "coordinator"):
        backend.exit(name, 0)
    backend.exit("buffer", 1)  # in the same poll: the run is over, the buffer is not restarted
    assert supervisor.watch(StopFlag()) == 0
    assert backend.started.count("buffer") == 1


def test_a_buffer_that_exits_0_before_the_end_stops_the_run(run):
    supervisor, backend, _ = run
    backend.exit("buffer", 0)
    assert watch_once(supervisor) == 1


def test_a_role_the_backend_cannot_restart_stops_the_run(run):
    supervisor, backend, reported = run
    backend.restartable = frozenset({"actor", "buffer"})  # as on Ray: the coordinator's address is fixed
    backend.exit("coordinator", -9)
    assert watch_once(supervisor) == 1 and reported == []


def test_a_stop_signals_the_actors_and_learner_first_then_the_rest(run):
    supervisor, backend, _ = run
    supervisor.stop_all()
    order = [name for name, sig, _ in backend.signals if sig == signal.SIGTERM]
    assert set(order[:3]) == {"actor-0", "learner-0", "learner-1"} and set(order[3:]) == {"buffer", "coordinator"}
    assert backend.closed
