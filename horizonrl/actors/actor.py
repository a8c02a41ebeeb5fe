"""The actor process: one vLLM engine, many concurrent episodes, trajectories out.

Coroutines on one event loop:
- ``_follow_control``: reads the coordinator's ``Control`` (turn budget, weight
  version, stop) and receives each announced weight version into the live engine, in
  order (every broadcast is a collective the learner waits on).
- ``_run_groups`` × ``groups_in_flight``: each runs GRPO groups back to back — ``n``
  episodes of one task under one turn budget — and pushes every finished episode.
  Sends await the buffer's backpressure, so a full buffer slows the actor down.
- ``_heartbeat``: liveness and cumulative counters to the coordinator.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections import Counter, defaultdict

import zmq
import zmq.asyncio

from horizonrl.actors.engine import RolloutEngine
from horizonrl.actors.episode import Episode, SamplingSettings, run_episode
from horizonrl.config import EnvSpec, TrainConfig
from horizonrl.envs import Environment, make_env
from horizonrl.protocol import Control, Heartbeat, ProtocolError, Trajectory, decode_as, encode
from horizonrl.protocol.arrays import LOGPROB_DTYPE, MASK_DTYPE, TOKEN_DTYPE, pack
from horizonrl.protocol.transport import make_socket
from horizonrl.runtime import RateLimitedLog, StopFlag

log = logging.getLogger("horizonrl.actors")

CONTROL_WAIT_S = 120.0  # the first Control must arrive within this
SEND_WARN_S = 10.0


def to_trajectory(ep: Episode, *, trajectory_id: str, group_id: str, group_size: int, env: str, task_id: int,
                  actor_id: int, max_turns: int, category: str) -> Trajectory:
    return Trajectory(
        trajectory_id=trajectory_id,
        group_id=group_id,
        group_size=group_size,
        env=env,
        task_id=task_id,
        actor_id=actor_id,
        token_ids=pack(ep.token_ids, TOKEN_DTYPE),
        loss_mask=pack(ep.loss_mask, MASK_DTYPE),
        logprobs=pack(ep.logprobs, LOGPROB_DTYPE),
        prompt_length=ep.prompt_length,
        turn_spans=ep.turn_spans,
        turn_versions=ep.turn_versions,
        turn_rewards=ep.turn_rewards,
        reward=ep.reward,
        success=ep.success,
        score=ep.score,
        num_turns=ep.num_turns,
        max_turns=max_turns,
        stop_reason=ep.stop_reason,
        failure=ep.failure,
        failure_message=ep.failure_message,
        category=category,
        timings={"generate_s": ep.generate_s, "env_s": ep.env_s},
    )


class EnvPool:
    """Reusable environment instances per name (an instance serves one episode at a time)."""

    def __init__(self, specs: list[EnvSpec]) -> None:
        self.specs = {s.name: s for s in specs}
        self._free: dict[str, list[Environment]] = defaultdict(list)

    def acquire(self, name: str) -> Environment:
        free = self._free[name]
        return free.pop() if free else make_env(name, self.specs[name].settings)

    def release(self, name: str, env: Environment) -> None:
        self._free[name].append(env)

    async def close(self) -> None:
        for envs in self._free.values():
            for env in envs:
                await env.close()


class Actor:
    def __init__(self, config: TrainConfig, index: int, stop: StopFlag, engine: RolloutEngine, chat) -> None:
        self.config = config
        self.index = index
        self.stop = stop
        self.engine = engine
        self.chat = chat
        self.rng = random.Random(config.run.seed * 1000 + index)
        self.envs = EnvPool(config.envs)
        probe = {s.name: make_env(s.name, s.settings) for s in config.envs}
        self.train_ids = {name: env.task_ids("train") for name, env in probe.items()}
        self.category = {name: env.task_category for name, env in probe.items()}
        self.weight_version = 0
        self.control: Control | None = None
        self.counters: Counter[str] = Counter()
        self._group_counter = 0
        r = config.rollout
        self.sampling = SamplingSettings(r.temperature, r.top_p, r.max_tokens_per_turn, r.max_context_tokens,
                                         r.system_prompt)
        net = config.network
        self.ctx = zmq.asyncio.Context()
        self.push = make_socket(self.ctx, zmq.PUSH, hwm=max(4, r.n))
        self.push.connect(net.endpoint(net.trajectory_port))
        self.sub = make_socket(self.ctx, zmq.SUB)
        self.sub.connect(net.endpoint(net.control_port))
        self.reports = make_socket(self.ctx, zmq.PUSH)
        self.reports.connect(net.endpoint(net.report_port))
        self._bad_log = RateLimitedLog(log)
        self._send_log = RateLimitedLog(log)

    async def run(self) -> None:
        net = self.config.network
        log.info("joining the weight group as rank %d of %d", self.index + 1, self.config.rollout.num_actors + 1)
        await self.engine.join_weight_group(net.host, net.weight_port, self.index + 1,
                                            self.config.rollout.num_actors + 1, self.config.learner.weight_sync_timeout_s)
        tasks = [asyncio.create_task(self._follow_control(), name="control"),
                 asyncio.create_task(self._heartbeat(), name="heartbeat")]
        await self._wait_for_first_control()
        if self.config.rollout.synchronous:
            tasks.append(asyncio.create_task(self._run_synchronous(), name="synchronous"))
        else:
            tasks += [asyncio.create_task(self._run_groups(slot), name=f"groups-{slot}")
                      for slot in range(self.config.rollout.groups_in_flight)]
        try:
            while not self.stop and not (self.control and self.control.stop):
                done = [t for t in tasks if t.done()]
                for t in done:
                    t.result()  # a dead coroutine fails the actor loudly
                await asyncio.sleep(0.2)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _wait_for_first_control(self) -> None:
        deadline = time.monotonic() + CONTROL_WAIT_S
        while self.control is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no Control from the coordinator within {CONTROL_WAIT_S:.0f} s")
            if self.stop:
                return
            await asyncio.sleep(0.05)
        log.info("started: learner step %d, turn budget %d", self.control.learner_step, self.control.max_turns)

    async def _follow_control(self) -> None:
        while True:
            data = await self.sub.recv()
            try:
                control = decode_as(data, Control)
            except ProtocolError as exc:
                self._bad_log.warning("rejected control message: %s", exc)
                continue
            self.control = control
            # Every announced version is one collective broadcast; receive them in order.
            while self.weight_version < control.weight_version:
                update = await self.engine.receive_weights(self.config.learner.weight_sync_timeout_s)
                version = update.version
                # Versions only grow; a resumed learner's first broadcast jumps to its step.
                if version <= self.weight_version:
                    raise RuntimeError(f"received weight version {version} after {self.weight_version}")
                self.weight_version = version
                self.counters["weight_updates"] += 1
                self.counters["weight_receive_s"] += update.stall_s  # the engine's whole stall
                self.counters["weight_transfer_s"] += update.receive_s
                self.counters["weight_load_s"] += update.load_s
                log.debug("weights v%d: stall %.3f s (receive %.3f s, load %.3f s)", version, update.stall_s,
                          update.receive_s, update.load_s)

    async def _run_groups(self, slot: int) -> None:
        while not self.stop and not self.control.stop:
            if self.control.pause_rollout:
                start = time.monotonic()
                while self.control.pause_rollout and not self.control.stop and not self.stop:
                    await asyncio.sleep(0.05)
                self.counters["paused_s"] += time.monotonic() - start
                continue
            await self._run_group()

    def synchronous_share(self) -> int:
        """Groups this actor generates per weight version in synchronous mode (its share of a batch)."""
        total, actors = self.config.learner.groups_per_step, self.config.rollout.num_actors
        return total // actors + (1 if self.index < total % actors else 0)

    async def _run_synchronous(self) -> None:
        """The baseline loop: generate a batch share under version v, wait for v + 1, repeat."""
        share = self.synchronous_share()
        while not self.stop and not self.control.stop:
            version = self.weight_version
            await asyncio.gather(*(self._run_group() for _ in range(share)))
            start = time.monotonic()
            limit = self.config.learner.batch_timeout_s + self.config.learner.weight_sync_timeout_s
            while self.weight_version == version and not self.control.stop and not self.stop:
                if time.monotonic() - start > limit:
                    raise TimeoutError(f"synchronous rollout: no weight version after {version} within {limit:.0f} s "
                                       "(is the learner alive and receiving the batch?)")
                await asyncio.sleep(0.01)
            self.counters["weights_wait_s"] += time.monotonic() - start

    async def _run_group(self) -> None:
        spec = self.rng.choices(self.config.envs, weights=[s.weight for s in self.config.envs])[0]
        task_id = self.rng.choice(self.train_ids[spec.name])
        max_turns = self.control.max_turns  # one budget for the whole group
        n = self.config.rollout.n
        group_id = f"a{self.index}-g{self._group_counter}"
        self._group_counter += 1
        episodes = await asyncio.gather(*(self._play(spec.name, task_id, max_turns) for _ in range(n)))
        for i, ep in enumerate(episodes):
            traj = to_trajectory(ep, trajectory_id=f"{group_id}-{i}", group_id=group_id, group_size=n, env=spec.name,
                                 task_id=task_id, actor_id=self.index, max_turns=max_turns,
                                 category=self.category[spec.name](task_id))
            await self._send(traj)

    async def _play(self, env_name: str, task_id: int, max_turns: int) -> Episode:
        env = self.envs.acquire(env_name)
        try:
            ep = await run_episode(self.engine, env, self.chat, task_id, max_turns=max_turns, sampling=self.sampling,
                                   weight_version=lambda: self.weight_version)
        finally:
            self.envs.release(env_name, env)
        self.counters["episodes"] += 1
        self.counters["generated_tokens"] += ep.generated_tokens
        self.counters["turns"] += ep.num_turns
        if not ep.failure:
            self.counters["completed"] += 1
            self.counters["successes"] += ep.success
            self.counters["reward_sum"] += ep.reward
        if ep.failure == "environment":
            self.counters["infra_failures"] += 1
            log.warning("environment failure in %s task %d: %s", env_name, task_id, ep.failure_message)
        elif ep.failure:
            self.counters["engine_failures"] += 1
        return ep

    async def _send(self, traj: Trajectory) -> None:
        data = encode(traj)
        start = time.monotonic()
        while True:
            try:
                await asyncio.wait_for(self.push.send(data), timeout=SEND_WARN_S)
                break
            except asyncio.TimeoutError:
                self._send_log.warning("buffer has not accepted a trajectory for %.0f s (backpressure)",
                                       time.monotonic() - start)
                if self.stop:
                    return
        self.counters["sent"] += 1
        self.counters["send_wait_s"] += time.monotonic() - start

    async def _heartbeat(self) -> None:
        while True:
            counters = {k: float(v) for k, v in self.counters.items()}
            counters["weight_version"] = float(self.weight_version)
            counters["engine_idle_s"] = self.engine.clock.idle_s
            counters["engine_wall_s"] = self.engine.clock.wall_s
            beat = Heartbeat(role="actor", index=self.index, pid=os.getpid(), counters=counters)
            try:
                await self.reports.send(encode(beat), zmq.NOBLOCK)
            except zmq.Again:
                pass
            await asyncio.sleep(1.0)

    async def close(self) -> None:
        await self.envs.close()
        for sock in (self.push, self.sub, self.reports):
            sock.close(linger=0)
        self.ctx.term()


def load_chat_tokenizer(model_path: str):
    from transformers import AutoTokenizer

    from horizonrl.chat import ChatTokenizer

    return ChatTokenizer(AutoTokenizer.from_pretrained(model_path))


async def _amain(config: TrainConfig, index: int, stop: StopFlag) -> None:
    r = config.rollout
    engine = RolloutEngine.start(config.model.path, dtype=config.model.dtype, engine=r.engine,
                                 max_model_len=r.max_context_tokens, seed=config.run.seed + index)
    actor = Actor(config, index, stop, engine, load_chat_tokenizer(config.model.path))
    try:
        await actor.run()
    finally:
        log.info("stopping; counters %s", dict(actor.counters))
        await actor.close()
        engine.shutdown()


def main(config: TrainConfig, index: int) -> int:
    stop = StopFlag().install()
    asyncio.run(_amain(config, index, stop))
    return 0
