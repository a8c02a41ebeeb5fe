"""``horizonrl accounting`` on a hand-made run directory: a trajectory the checkpoints name as trained in two
steps is listed under ``trained_twice`` (the check that guards against a replay bug training twice)."""

from __future__ import annotations

import json

import pytest

from horizonrl.apps.hostile import trajectory
from horizonrl.buffer.accounting import account
from horizonrl.buffer.server import BufferServer
from horizonrl.core.config import TrainConfig
from horizonrl.core.run_dirs import STATE_FILE, checkpoint_dir
from horizonrl.core.runtime import StopFlag
from horizonrl.launcher import resolve_ports
from horizonrl.protocol import encode

RUN_ID = "ledger"


@pytest.fixture
def config(tmp_path) -> TrainConfig:
    return resolve_ports(TrainConfig.model_validate({
        "run": {"output_dir": str(tmp_path), "run_id": RUN_ID}, "model": {"path": "unused", "vocab_size": 128},
        "envs": [{"name": "signpost"}], "network": {"host": "127.0.0.1"},
        "rollout": {"n": 2, "max_context_tokens": 64, "max_tokens_per_turn": 8},
        "learner": {"total_steps": 10, "groups_per_step": 1}, "buffer": {"capacity_groups": 4}}))


def accept(config: TrainConfig, ids: list[str]) -> None:
    server = BufferServer(config, StopFlag())
    try:
        for trajectory_id in ids:
            t = trajectory(RUN_ID, trajectory_id)
            server._admit(b"actor-0", t, encode(t))
        server._flush()
    finally:
        server.close()


def checkpoint(config: TrainConfig, step: int, since: int, trained: list[list[str]]) -> None:
    """A checkpoint at ``step`` whose steps since ``since`` trained on ``trained`` (one list per step)."""
    path = checkpoint_dir(config.output_dir, step)
    path.mkdir(parents=True)
    consumed = [{"step": since + 1 + i, "request_id": since + 1 + i, "trajectories": {"trained": ids}}
                for i, ids in enumerate(trained)]
    (path / STATE_FILE).write_text(json.dumps({"step": step, "consumed": consumed, "consumed_since": since}))


def test_a_trajectory_trained_in_two_steps_is_listed_as_trained_twice(config):
    accept(config, ["a-0", "a-1", "b-0", "b-1"])
    checkpoint(config, 1, 0, [["a-0", "a-1"]])
    checkpoint(config, 3, 1, [["b-0", "b-1"], ["a-1"]])  # a replay bug: a-1 again, two steps later
    ledger = account(config.output_dir)
    assert ledger["accepted"] == 4 and ledger["steps"] == 3
    assert ledger["trained_twice"] == ["a-1"]
    assert ledger["trained_once"] == 3 and ledger["lost"] == []


def test_a_run_that_trained_each_trajectory_once_has_none_trained_twice(config):
    accept(config, ["a-0", "a-1", "b-0", "b-1"])
    checkpoint(config, 2, 0, [["a-0", "a-1"], ["b-0", "b-1"]])
    ledger = account(config.output_dir)
    assert ledger["trained_twice"] == [] and ledger["trained_once"] == 4 and ledger["lost"] == []
