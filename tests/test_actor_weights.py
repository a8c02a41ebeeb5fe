"""How the actor follows the announced weight versions (actors/actor.py's ``_follow_weights``) against a stand-in
engine: each version staged then swapped in, a version overtaken by a newer announcement while it was staged is
not loaded, a failed receive makes the engine join the hub again, the inline path is used without staging, and an
engine that dies while the actor starts fails the actor at once.
The real engine's staging and swap are tested in tests/integration/test_engine_weights.py."""

from __future__ import annotations

import asyncio
import time

import pytest

from horizonrl.actors.actor import Actor
from horizonrl.actors.engine import StagedWeights, WeightUpdate
from horizonrl.core.config import TrainConfig
from horizonrl.core.runtime import StopFlag
from horizonrl.envs.signpost import SignpostEnv
from horizonrl.launcher import resolve_ports
from horizonrl.protocol import Control
from horizonrl.protocol.weights import WeightSyncError

from helpers import CharChat

RUN_ID = "weights"


def make_config(tmp_path, **rollout) -> TrainConfig:
    return resolve_ports(TrainConfig.model_validate({
        "run": {"output_dir": str(tmp_path), "run_id": RUN_ID}, "model": {"path": "unused"},
        "envs": [{"name": "signpost", "settings": {"length": 2}}], "network": {"host": "127.0.0.1"},
        "rollout": {"max_tokens_per_turn": 24, "max_context_tokens": 512, **rollout}}))


class StagingEngine:
    """Stages the next version the hub would send (one after another) and records what it was asked to do."""

    dead = False

    def __init__(self, actor_control=None) -> None:
        self.weights = (0, 0)
        self.next_version = 1
        self.calls: list[str] = []
        self.on_stage = None  # called while a version is being staged (to announce a newer one meanwhile)
        self.fail_next_stage = False
        self.continued_requests = 0
        self.kept_requests = 0
        self.lost_stage_messages = 0

    async def stage_weights(self, timeout_s):
        self.calls.append(f"stage {self.next_version}")
        await asyncio.sleep(0.01)
        if self.on_stage is not None:
            self.on_stage(self.next_version)
        if self.fail_next_stage:
            self.fail_next_stage = False
            raise WeightSyncError("the learner dropped this member")
        self.staged, self.next_version = self.next_version, self.next_version + 1
        return StagedWeights(self.staged, 0, 0.01)

    async def load_staged(self):
        self.calls.append(f"load {self.staged}")
        self.weights = (0, self.staged)
        return WeightUpdate(self.staged, 0, 0.01, 0.002, 0.005)

    async def receive_weights(self, timeout_s):
        self.calls.append(f"receive {self.next_version}")
        self.weights, self.next_version = (0, self.next_version), self.next_version + 1
        return WeightUpdate(self.weights[1], 0, 0.01, 0.002, 0.02)

    async def join_weights(self, host, port, *, actor, run_id, timeout_s):
        newest = self.next_version  # the hub answers a join with its newest version
        self.calls.append(f"join {newest}")
        self.weights, self.next_version = (0, newest), newest + 1
        return WeightUpdate(newest, 0, 0.01, 0.002, 0.02)


def control(version: int) -> Control:
    return Control(run_id=RUN_ID, learner_step=version, max_turns=2, weight_version=version)


async def follow(actor: Actor, engine: StagingEngine, until: tuple[int, int]) -> None:
    task = asyncio.create_task(actor._follow_weights())
    try:
        for _ in range(500):
            if engine.weights >= until:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"the engine holds {engine.weights}, not {until}: {engine.calls}")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def make_actor(tmp_path, engine, **rollout) -> Actor:
    return Actor(make_config(tmp_path, **rollout), 0, StopFlag(), engine, CharChat(),
                 lambda name, settings: SignpostEnv(**settings))


async def test_each_announced_version_is_staged_then_swapped_in(tmp_path):
    engine = StagingEngine()
    actor = make_actor(tmp_path, engine)
    try:
        for version in (1, 2):
            actor.control = control(version)
            actor._new_control.set()
            await follow(actor, engine, (0, version))
        assert engine.calls == ["stage 1", "load 1", "stage 2", "load 2"]
        assert actor.counters.weight_updates == 2 and actor.counters.weight_stall_s == 0.01
    finally:
        await actor.close()


async def test_a_version_overtaken_while_staged_is_not_loaded(tmp_path):
    engine = StagingEngine()
    actor = make_actor(tmp_path, engine)

    def announce_newer(version):
        if version == 1:
            actor.control = control(2)  # the learner's next step was announced while version 1 came

    engine.on_stage = announce_newer
    try:
        actor.control = control(1)
        actor._new_control.set()
        await follow(actor, engine, (0, 2))
        assert engine.calls == ["stage 1", "stage 2", "load 2"]
        assert actor.counters.weight_versions_skipped == 1 and actor.counters.weight_updates == 1
    finally:
        await actor.close()


async def test_a_failed_receive_joins_the_hub_again(tmp_path):
    engine = StagingEngine()
    engine.fail_next_stage = True
    actor = make_actor(tmp_path, engine)
    try:
        actor.control = control(1)
        actor._new_control.set()
        await follow(actor, engine, (0, 1))
        assert engine.calls == ["stage 1", "join 1"]
        assert actor.counters.weight_receive_failures == 1
    finally:
        await actor.close()


async def test_without_staging_each_version_is_received_inline(tmp_path):
    engine = StagingEngine()
    actor = make_actor(tmp_path, engine, weight_staging=False)
    try:
        actor.control = control(2)
        actor._new_control.set()
        await follow(actor, engine, (0, 2))
        assert engine.calls == ["receive 1", "receive 2"]
    finally:
        await actor.close()


class EngineDyingInStartUp(StagingEngine):
    """An engine whose processes die while the actor waits for its first weights (they never come)."""

    def __init__(self) -> None:
        super().__init__()
        self.died_at: float | None = None

    @property
    def dead(self) -> bool:
        return self.died_at is not None

    async def join_weights(self, host, port, *, actor, run_id, timeout_s):
        self.calls.append("join")
        await asyncio.sleep(0.3)
        self.died_at = time.monotonic()
        await asyncio.sleep(timeout_s)  # a join with a dead engine waits for its timeout


async def test_an_engine_that_dies_during_start_up_fails_the_actor_at_once(tmp_path):
    engine = EngineDyingInStartUp()
    actor = make_actor(tmp_path, engine)
    try:
        with pytest.raises(RuntimeError, match="engine died during the actor's start-up"):
            await asyncio.wait_for(actor.run(), timeout=60)  # the join alone would wait weight_sync_timeout_s (300 s)
        assert time.monotonic() - engine.died_at < 5 and engine.calls == ["join"]
    finally:
        await actor.close()
