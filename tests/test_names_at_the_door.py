"""Names at the door (protocol/names.py): every string a trajectory carries into metric or counter names is
bounded and charset-checked where it comes in, so no name that passed the buffer's door can make the
coordinator refuse the learner's own report (which the learner builds from those names)."""

from __future__ import annotations

import msgspec
import pytest

from horizonrl.apps.hostile import trajectory
from horizonrl.buffer.server import BufferServer
from horizonrl.coordinator.intake import ReportIntake
from horizonrl.core.config import TrainConfig
from horizonrl.core.runtime import StopFlag
from horizonrl.launcher import resolve_ports
from horizonrl.learner.loop import batch_metrics
from horizonrl.protocol import ACK_ACCEPTED, ACK_REJECTED, Batch, LearnerReport, encode
from horizonrl.protocol.names import MAX_LABEL_CHARS, is_label, is_name
from horizonrl.protocol.validation import trajectory_problem

RUN_ID = "names"
KEY = "k" * 32

HOSTILE_NAMES = [
    "x" * 200,  # longer than any name
    "x" * (MAX_LABEL_CHARS + 1),  # one past a label: "env/<it>/success_mean" would still be a name ...
    "y" * 120,  # ... and this one a name only without the prefix and suffix
    "",
    "a b",  # a space
    "tab\there",
    "new\nline",
    "nul\x00",
    "\u00e9t\u00e9",  # not ASCII
    "\U0001F600",
    "bad,comma",
    "quote\"d",
    "back\\slash",
    "<script>",
    "../../etc/passwd",
    "x" * MAX_LABEL_CHARS,  # the longest label: let in, and its metric names are names
    "ok-name_1.2/3:4+5=6@7",  # every allowed character: let in
]


@pytest.fixture
def config(tmp_path) -> TrainConfig:
    return resolve_ports(TrainConfig.model_validate({
        "run": {"output_dir": str(tmp_path), "run_id": RUN_ID}, "model": {"path": "unused", "vocab_size": 128},
        "envs": [{"name": "signpost"}], "network": {"host": "127.0.0.1"},
        "rollout": {"n": 2, "max_context_tokens": 64, "max_tokens_per_turn": 8},
        "learner": {"total_steps": 10, "groups_per_step": 1}, "buffer": {"capacity_groups": 4}}))


def named(trajectory_id: str, field: str, name: str):
    t = trajectory(RUN_ID, trajectory_id)
    if field == "timings":
        return msgspec.structs.replace(t, timings={name: 1.0})
    return msgspec.structs.replace(t, **{field: name})


def learner_report(trajectories) -> LearnerReport:
    """The report a learner makes from a batch of these trajectories (the metrics built from their names)."""
    batch = Batch(run_id=RUN_ID, request_id=1, groups=[list(trajectories)], buffer_stats={"received": 1.0})
    metrics = {"loss/policy": 0.1, **batch_metrics(batch, learner_version=0)}
    return LearnerReport(run_id=RUN_ID, step=1, weight_version=1, metrics=metrics, key=KEY)


@pytest.mark.parametrize("field", ["env", "category", "stop_reason", "timings"])
@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_a_name_that_passes_the_door_never_makes_the_coordinator_refuse_the_learners_report(config, field, name):
    t = named("t-0", field, name)
    # the door without the run's environments (as the learner checks a batch again): the charset and length alone
    if trajectory_problem(t, vocab_size=128) is not None:
        assert trajectory_problem(t, vocab_size=128)[0] in ("names", "ids")
        return
    intake = ReportIntake(config, KEY)
    report = learner_report([t])
    assert all(is_name(metric) for metric in report.metrics)
    accepted = intake.accept(encode(report), (LearnerReport,), learner_step=0, weight_epoch=0)
    assert accepted is not None and dict(intake.rejected) == {}, dict(intake.rejected)


@pytest.mark.parametrize("name", [n for n in HOSTILE_NAMES if not is_label(n)])
def test_an_odd_name_in_any_field_is_refused_at_the_buffers_door_and_counted(config, name):
    server = BufferServer(config, StopFlag())
    try:
        for n, field in enumerate(["env", "stop_reason", "timings", "category"]):
            if (field == "stop_reason" and name == "") or (field == "category" and len(name) <= MAX_LABEL_CHARS
                                                           and name.isprintable()):
                continue  # no stop reason (an episode cut short) and a printable category are fine
            t = named(f"t{n}-0", field, name)
            server._admit(b"actor-0", t, encode(t))
            [(_, status, reason)] = [e for e in server._outbox[b"actor-0"] if e[0] == t.trajectory_id]
            assert (status, reason) == (ACK_REJECTED, "names"), field
        assert server.groups.received == 0 and server.groups.rejected["names"] >= 2
    finally:
        server.close()


@pytest.mark.parametrize("bad_id", ["", "x" * 257, "a b-0", "a/b-0", "\u00e9-0", "nul\x00-0", "new\nline-0"])
def test_an_odd_trajectory_or_group_id_is_refused(bad_id):
    t = trajectory(RUN_ID, "fine-0")
    assert trajectory_problem(msgspec.structs.replace(t, trajectory_id=bad_id))[0] == "ids"
    assert trajectory_problem(msgspec.structs.replace(t, group_id=bad_id))[0] == "ids"


def test_the_buffer_takes_only_the_runs_own_environments(config):
    server = BufferServer(config, StopFlag())
    try:
        for tid, env in (("own-0", "signpost"), ("other-0", "babyai")):
            t = named(tid, "env", env)
            server._admit(b"actor-0", t, encode(t))
        assert [(e[0], e[1], e[2]) for e in server._outbox[b"actor-0"]] == [
            ("own-0", ACK_ACCEPTED, ""), ("other-0", ACK_REJECTED, "names")]
    finally:
        server.close()


def test_a_config_with_an_environment_name_that_is_not_a_label_is_refused(tmp_path):
    with pytest.raises(ValueError, match="pattern"):
        TrainConfig.model_validate({"run": {"output_dir": str(tmp_path)}, "model": {"path": "unused"},
                                    "envs": [{"name": "sign post"}]})
