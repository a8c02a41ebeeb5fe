"""The actor process: one vLLM engine, many concurrent episodes, trajectories out.

Coroutines on one event loop:
- ``_read_control``: reads the coordinator's ``Control`` (turn budget, weight version, stop).
- ``_follow_weights``: takes each weight version the learner announces into the live engine,
  in order: received into a staging buffer while the engine keeps generating, then swapped in
  between two engine steps, requests in flight going on under the new weights (``engine.py``);
  a version already overtaken by a newer announcement when it arrives is not loaded. The engine
  is a member of the learner's weight hub (joined at start, with the learner's newest weights);
  dropped by the hub, or facing a restarted learner, it joins again.
- ``_run_groups`` × ``groups_in_flight``: each runs GRPO groups back to back — ``n``
  episodes of one task (the next of the actor's task sequence, ``task_sequence.py``) under
  one turn budget — and hands every finished episode to the delivery. With
  ``rollout.concurrency.mode=adaptive`` there are ``max_groups`` slots, of which the first
  ``InFlightController.groups`` run: ``_adapt_in_flight`` moves that number with the engine's
  KV-cache use (``concurrency.py``); a slot above it finishes its group, then waits.
- ``delivery.run``: acknowledged, resent-until-acknowledged sends to the buffer, with an
  outbox on disk (``delivery.py``); too many unacknowledged trajectories hold the groups back.
- ``_heartbeat``: liveness and cumulative counters to the coordinator.
- ``_evaluate_held_out`` (actor 0, with ``eval.every``): the held-out evaluations the coordinator
  asks for (``Control.eval_step``), on test-split tasks with the engine's current weights; their
  episodes never go to the buffer and are not in the rollout counters. While one runs, this actor
  starts no new groups (those in flight go on), so the evaluation has the engine mostly to itself
  and ends before many newer weights arrive.

Stopping (SIGINT/SIGTERM, or the coordinator's stop): no new episodes; episodes in progress are
abandoned (counted, never produced); what was sent gets ``STOP_DRAIN_S`` to be acknowledged (less
when the buffer stops acknowledging: full or gone), the rest stays in the outbox and is sent by the
next start.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from collections import defaultdict

import zmq
import zmq.asyncio

from horizonrl.actors.concurrency import InFlightBand, InFlightController
from horizonrl.actors.delivery import MAX_ACK_BYTES, TrajectoryDelivery
from horizonrl.actors.engine import RolloutEngine
from horizonrl.actors.episode import Episode, SamplingSettings, run_episode
from horizonrl.actors.episode_messages import episode_sample, recorded, to_trajectory
from horizonrl.core.chat import load_chat_tokenizer
from horizonrl.actors.evaluate import EvalSpec, evaluate_with
from horizonrl.actors.task_sequence import TaskSequence
from horizonrl.core.config import EnvSpec, TrainConfig
from horizonrl.core.environment import EnvFactory, Environment
from horizonrl.core.placement import engine_cpus_of, is_colocated
from horizonrl.protocol import (
    ENDPOINT_COLOCATED_ENGINE,
    ENDPOINT_TRAJECTORIES,
    ENDPOINT_WEIGHTS,
    FAILURE_ENVIRONMENT,
    FAILURE_TIMEOUT,
    MAX_CONTROL_BYTES,
    Control,
    Heartbeat,
    HeldOutEval,
    ProtocolError,
    decode_as,
    encode,
    signed_by,
)
from horizonrl.protocol.counters import ActorCounters, ActorGauges, DeliveryCounters, heartbeat_counters
from horizonrl.protocol.registry import FollowedEndpoint, registration
from horizonrl.protocol.transport import keep_collectives_on, make_socket, split_endpoint, wire_security
from horizonrl.protocol.weights import RUN_KEY_ENV, WeightSyncError
from horizonrl.core.run_dirs import read_run_key
from horizonrl.core.run_events import EventLog, RunEvent
from horizonrl.core.runtime import RateLimitedLog, StopFlag

log = logging.getLogger("horizonrl.actors")

CONTROL_WAIT_S = 120.0  # the first Control must arrive within this
HUB_PROBE_S = 1.0  # a registered weight hub that refuses connections is looked up again this often
HUB_ANSWER_S = 30.0  # a hub that took the probe's connection answers a join's store this soon, or is not the hub
STOP_DRAIN_S = 10.0  # at a stop, how long sent trajectories may take to be acknowledged
UNHEALTHY_ENV_FAILURES = (FAILURE_ENVIRONMENT, FAILURE_TIMEOUT)  # the instance is not reused after these
EVALUATING_ACTOR = 0  # the actor that plays the held-out evaluations during training (eval.every)
EVAL_SEND_TIMEOUT_S = 30.0
EVAL_METRICS = ("success_rate", "episodes_valid", "infra_failures", "mean_reward", "mean_score", "mean_turns")


def new_incarnation() -> str:
    """64 random bits naming one actor process (see :func:`group_id_of`)."""
    return secrets.token_hex(8)


def group_id_of(actor: int, incarnation: str, number: int) -> str:
    """``a<actor>-<incarnation>-g<number>``: unique in the run (a group number is never used twice by an actor),
    and unguessable before the actor uses it (the incarnation is random: a sender that read the group number in
    ``actors/actor_<i>.json`` still cannot pre-empt the id); its trajectories are ``<group id>-<member>``."""
    return f"a{actor}-{incarnation}-g{number}"


class EnvPool:
    """Reusable environment instances per name (an instance serves one episode at a time)."""

    def __init__(self, specs: list[EnvSpec], make_env: EnvFactory) -> None:
        self.specs = {s.name: s for s in specs}
        self._make_env = make_env
        self._free: dict[str, list[Environment]] = defaultdict(list)

    def acquire(self, name: str) -> Environment:
        free = self._free[name]
        return free.pop() if free else self._make_env(name, self.specs[name].settings)

    def release(self, name: str, env: Environment, healthy: bool = True) -> None:
        """Back to the pool; an instance whose episode failed for the environment's sake (or timed out
        inside it) is closed and dropped instead: its state is unknown."""
        if healthy:
            self._free[name].append(env)
        else:
            asyncio.ensure_future(_close_quietly(env))

    async def close(self) -> None:
        for envs in self._free.values():
            for env in envs:
                await env.close()


async def _close_quietly(env: Environment, timeout_s: float = 30.0) -> None:
    try:
        await asyncio.wait_for(env.close(), timeout_s)
    except Exception:  # noqa: BLE001 - a broken instance: its close may fail or hang; it is dropped anyway
        log.debug("closing a broken environment instance failed", exc_info=True)


class Actor:
    def __init__(self, config: TrainConfig, index: int, stop: StopFlag, engine: RolloutEngine, chat,
                 make_env: EnvFactory) -> None:
        self.config = config
        self.index = index
        self.stop = stop
        self.engine = engine
        self.chat = chat
        self.run_id = config.run.run_id
        self.run_key = read_run_key(config.output_dir)  # the coordinator takes held-out evaluations only with it
        # Part of every group id: random per incarnation, so no one can send an episode under an id this actor is
        # about to use (the group number alone is in actors/actor_<i>.json, readable to anyone who can read the run)
        self.incarnation = new_incarnation()
        self.envs = EnvPool(config.envs, make_env)
        self.make_env = make_env
        self.evaluating = False  # a held-out evaluation is running: start no new groups
        self.agents = None  # rollout.agent: an AgentRunner plays the episodes (actors/openai_endpoint/agent_runs.py)
        probe = {s.name: make_env(s.name, s.settings) for s in config.envs}
        self.category = {name: env.task_category for name, env in probe.items()}
        self.tasks = TaskSequence(config.run_dir.task_sequence(index), config.run.seed, index, config.envs,
                                  {name: env.task_ids("train") for name, env in probe.items()})
        self.control: Control | None = None
        self._new_control = asyncio.Event()
        self._control_reader_running = False
        self.counters = ActorCounters()
        self.gauges = ActorGauges()
        self._last_sample: dict[str, float] = {}  # env -> when its last episode sample was sent
        r = config.rollout
        c = r.concurrency
        # rollout.concurrency.mode=adaptive: how many of the group slots run (None: groups_in_flight, fixed)
        self.in_flight = (InFlightController(InFlightBand(c.kv_cache_low, c.kv_cache_high, c.min_groups, c.max_groups,
                                                          c.hold_s), start=r.groups_in_flight)
                          if c.mode == "adaptive" else None)
        self.groups_running = 0
        self.sampling = SamplingSettings.from_config(r)
        net = config.network
        self.ctx = zmq.asyncio.Context()
        self.security = wire_security(self.ctx, net.host, net.curve_keys_dir)
        self.intake = make_socket(self.ctx, zmq.DEALER, hwm=max(4, r.n), max_message_bytes=MAX_ACK_BYTES,
                                  security=self.security)
        # The buffer at its configured port, or wherever it registered (followed when it restarts elsewhere).
        self.buffer_endpoint = FollowedEndpoint(self.intake, ENDPOINT_TRAJECTORIES,
                                                net.endpoint(net.trajectory_port) if net.trajectory_port else None)
        self.delivery = TrajectoryDelivery(self.intake, config.run_dir.outbox(index), self.run_id,
                                           ack_timeout_s=r.ack_timeout_s, max_unacked=r.max_unacked)
        self.sub = make_socket(self.ctx, zmq.SUB, max_message_bytes=MAX_CONTROL_BYTES, security=self.security)
        self.sub.connect(net.endpoint(net.control_port))
        self.reports = make_socket(self.ctx, zmq.PUSH, security=self.security)
        self.reports.connect(net.endpoint(net.report_port))
        self._bad_log = RateLimitedLog(log)
        self._failure_log = RateLimitedLog(log)
        self.events = EventLog(config.output_dir, f"actor-{index}")

    @property
    def weights(self) -> tuple[int, int]:
        """(epoch, version) of the weights in the engine: version 0 is model.path."""
        return self.engine.weights

    @property
    def weight_version(self) -> int:
        return self.weights[1]

    async def run(self) -> None:
        if is_colocated(os.environ):
            # The learner on this GPU waits for this before it touches the GPU (learner/main.py says why).
            await self.reports.send(registration(self.run_id, f"actor-{self.index}",
                                                 {ENDPOINT_COLOCATED_ENGINE: str(os.getpid())}, self.run_key))
        if not await self._unless_stopped(self._resolve_endpoints()):
            return
        host, port = self._weight_hub_address()
        log.info("joining the learner's weight hub at %s:%d", host, port)
        if not await self._unless_stopped(self._join_weights()):
            return
        self._control_reader_running = True  # from here on, only _read_control reads the subscription
        services = [asyncio.create_task(self._read_control(), name="control"),
                    asyncio.create_task(self._follow_weights(), name="weights"),
                    asyncio.create_task(self._heartbeat(), name="heartbeat"),
                    asyncio.create_task(self.delivery.run(), name="delivery")]
        if self.config.eval.every and self.index == EVALUATING_ACTOR:
            services.append(asyncio.create_task(self._evaluate_held_out(), name="held-out evaluation"))
        if not await self._unless_stopped(self._wait_for_first_control()):
            await self._stop([], services)
            return
        if self.config.rollout.synchronous:
            workers = [asyncio.create_task(self._run_synchronous(), name="synchronous")]
        else:
            slots = self.in_flight.band.max_groups if self.in_flight else self.config.rollout.groups_in_flight
            workers = [asyncio.create_task(self._run_groups(slot), name=f"groups-{slot}") for slot in range(slots)]
            if self.in_flight:
                services.append(asyncio.create_task(self._adapt_in_flight(), name="in-flight"))
        try:
            while not self.stop and not (self.control and self.control.stop):
                for t in services + workers:
                    if t.done():
                        t.result()  # a dead coroutine fails the actor loudly
                if self.engine.dead:
                    # Every generation would fail from now on: exit non-zero so the launcher restarts
                    # the actor with a new engine (the episodes it failed are counted as engine failures).
                    raise RuntimeError("the vLLM engine died (its EngineCore or worker process exited)")
                await asyncio.sleep(0.2)
        finally:
            await self._stop(workers, services)

    async def _unless_stopped(self, step) -> bool:
        """Run a start-up step (bounded by its own timeout) unless a stop signal comes first: False then. An
        engine that dies meanwhile fails the actor at once, rather than when the step times out (a join
        waits up to learner.weight_sync_timeout_s for an engine that will never answer)."""
        task = asyncio.ensure_future(step)
        while not task.done():
            if self.stop:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                log.info("stopped during start-up")
                return False
            if self.engine.dead:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise RuntimeError("the vLLM engine died during the actor's start-up (its EngineCore or worker "
                                   "process exited)")
            await asyncio.wait([task], timeout=0.2)
        task.result()  # a failed step fails the actor loudly
        return True

    async def _stop(self, workers: list[asyncio.Task], services: list[asyncio.Task]) -> None:
        """Start no more episodes, abandon those in progress, give the buffer a moment to acknowledge
        what was sent (the rest stays in the outbox for the next start)."""
        for t in workers:
            t.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        delivery = next(t for t in services if t.get_name() == "delivery")
        left = await self.delivery.drain(STOP_DRAIN_S) if not delivery.done() else len(self.delivery.unacked)
        for t in services:
            t.cancel()
        await asyncio.gather(*services, return_exceptions=True)
        log.info("stopped: %d episodes abandoned in progress; %d trajectories unacknowledged (kept in the outbox)",
                 self.counters.abandoned_episodes, left)

    async def _wait_for_first_control(self) -> None:
        """The first Control, then the weights it announces (a resumed learner's): no episode is played
        with weights older than the learner's at start."""
        deadline = time.monotonic() + CONTROL_WAIT_S
        while self.control is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no Control from the coordinator within {CONTROL_WAIT_S:.0f} s")
            if self.stop:
                return
            await asyncio.sleep(0.05)
        deadline = time.monotonic() + self.config.learner.weight_sync_timeout_s
        while self.weights < (self.control.weight_epoch, self.control.weight_version) and not self.stop:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the announced weights {(self.control.weight_epoch, self.control.weight_version)} "
                                   f"did not arrive within {self.config.learner.weight_sync_timeout_s:.0f} s")
            await asyncio.sleep(0.05)
        log.info("started: learner step %d, turn budget %d, weights %s (epoch, version)", self.control.learner_step,
                 self.control.max_turns, self.weights)
        self.events.emit(RunEvent.ENGINE_READY, actor=self.index, weights=list(self.weights))

    async def _resolve_endpoints(self) -> None:
        """Where the buffer and the weight hub are, when their ports are not configured: the first Control
        that names both (they register with the coordinator once they are up; the weight hub once the
        learner has its model, which may take minutes: the join would wait as long)."""
        net = self.config.network
        if net.trajectory_port and net.weight_port:
            return
        wanted = [name for name, port in ((ENDPOINT_TRAJECTORIES, net.trajectory_port),
                                          (ENDPOINT_WEIGHTS, net.weight_port)) if not port]
        timeout_s = max(CONTROL_WAIT_S, self.config.learner.weight_sync_timeout_s)
        deadline = time.monotonic() + timeout_s
        while self.control is None or any(name not in self.control.endpoints for name in wanted):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the coordinator did not publish {', '.join(wanted)} within {timeout_s:.0f} s "
                                   f"(registered: {sorted(self.control.endpoints) if self.control else 'no Control'})")
            if await self.sub.poll(200):
                await self._read_queued_control()

    async def _read_queued_control(self) -> None:
        """Every Control queued on the subscription, keeping the newest: it was made before the engine started
        (minutes, on a loaded machine), and what queued meanwhile may name a learner that has restarted since."""
        while True:
            try:
                data = await self.sub.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                self.control = self._signed_control(data)
            except ProtocolError as exc:
                self._bad_log.warning("rejected control message: %s", exc)
        if self.control is not None:
            self.buffer_endpoint.update(self.control.endpoints)

    def _weight_hub_address(self) -> tuple[str, int]:
        """The learner's weight hub: its configured port on network.host, or the newest registered one."""
        net = self.config.network
        if net.weight_port:
            return net.host, net.weight_port
        return split_endpoint(self.control.endpoints[ENDPOINT_WEIGHTS])

    async def _reachable_weight_hub(self, deadline: float) -> tuple[str, int]:
        """The registered weight hub, once it accepts connections. A hub that does not is one of a learner
        that has died: its successor registers a new one, which the next Control names — so look again
        there, rather than wait in the join until the timeout for a hub that will never come back."""
        while True:
            host, port = self._weight_hub_address()
            try:
                _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), HUB_PROBE_S)
                writer.close()
                return host, port
            except (OSError, asyncio.TimeoutError):
                if time.monotonic() > deadline:
                    timeout_s = self.config.learner.weight_sync_timeout_s
                    raise TimeoutError(f"no weight hub answered at {host}:{port} (the newest registered) within "
                                       f"learner.weight_sync_timeout_s={timeout_s:.0f} s")
                await self._wait_for_newer_control()

    async def _wait_for_newer_control(self) -> None:
        """A pause before the weight hub is looked up again, with the Control that arrived meanwhile read."""
        await asyncio.sleep(HUB_PROBE_S)
        if not self._control_reader_running:  # else _read_control keeps self.control current
            await self._read_queued_control()

    async def _join_weights(self) -> None:
        """Join the learner's weight hub; its newest weights are in the engine when this returns."""
        timeout_s = self.config.learner.weight_sync_timeout_s
        if self.config.network.weight_port:
            host, port = self._weight_hub_address()  # a configured hub: the join waits for it to be up
            update = await self.engine.join_weights(host, port, actor=self.index, run_id=self.run_id,
                                                    timeout_s=timeout_s)
        else:
            update = await self._join_registered_hub(time.monotonic() + timeout_s)
        self._took(update)
        self.counters.weight_joins += 1
        log.info("joined the weight hub at weights %s (epoch, version)", self.weights)

    async def _join_registered_hub(self, deadline: float):
        """Join the newest registered hub that takes a connection. Taking one is not proof: a dead learner's
        port may have been taken by another process's listener, which never answers. So the join's store gets
        HUB_ANSWER_S to answer, and a join that fails before ``deadline`` looks the hub up again."""
        while True:
            host, port = await self._reachable_weight_hub(deadline)
            try:
                return await self.engine.join_weights(host, port, actor=self.index, run_id=self.run_id,
                                                      timeout_s=self.config.learner.weight_sync_timeout_s,
                                                      connect_timeout_s=HUB_ANSWER_S)
            except WeightSyncError as exc:
                if time.monotonic() > deadline:
                    raise
                self.counters.weight_receive_failures += 1
                log.warning("joining the weight hub at %s:%d failed (%s); looking it up again", host, port,
                            str(exc).splitlines()[0][:300])
                await self._wait_for_newer_control()

    async def _read_control(self) -> None:
        while True:
            data = await self.sub.recv()
            try:
                control = self._signed_control(data)
            except ProtocolError as exc:
                self._bad_log.warning("rejected control message: %s", exc)
                continue
            self.control = control
            self.buffer_endpoint.update(control.endpoints)
            self.delivery.backpressure = control.pause_rollout
            self._new_control.set()

    def _signed_control(self, data: bytes) -> Control:
        """The coordinator's Control; ProtocolError for anything else — another run's, or one not signed with the
        run's key (anyone can reach the coordinator's ports: a Control could end the run or pause it)."""
        control = decode_as(data, Control, MAX_CONTROL_BYTES, self.run_id)
        if not signed_by(control, self.run_key):
            raise ProtocolError("a Control not signed with the run's key")
        return control

    def _announced(self) -> tuple[int, int]:
        return (self.control.weight_epoch, self.control.weight_version) if self.control else (0, 0)

    async def _follow_weights(self) -> None:
        """Take every version the learner announces. The hub sends every member each version once, in order;
        a newer weight epoch is a restarted learner, hence a new hub: join that one, which answers with its
        newest weights."""
        # An engine on the learner's GPU reads each version from the learner's memory: nothing to stage.
        staged_updates = self.config.rollout.weight_staging and not is_colocated(os.environ)
        timeout_s = self.config.learner.weight_sync_timeout_s
        while True:
            if self._announced() <= self.weights:
                self._new_control.clear()
                await self._new_control.wait()
                continue
            if self._announced()[0] > self.weights[0]:
                log.info("the learner restarted (weight epoch %d): joining its weight hub", self._announced()[0])
                await self._join_weights()
                continue
            before = self.weights
            try:
                if staged_updates:
                    staged = await self.engine.stage_weights(timeout_s)
                    if staged.key > before and staged.key < self._announced():
                        # A newer version was announced while this one came: it is on its way to the same
                        # staging buffer, so this one is never loaded.
                        self.counters.weight_versions_skipped += 1
                        self.counters.weight_transfer_s += staged.receive_s
                        continue
                    update = await self.engine.load_staged()
                else:
                    update = await self.engine.receive_weights(timeout_s)
            except Exception as exc:  # noqa: BLE001 - the learner dropped us, or it is gone: join again
                self.counters.weight_receive_failures += 1
                log.warning("receiving weights after %s failed (%s); joining the weight hub again", self.weights,
                            str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__)
                await self._join_weights()  # a failure here fails the actor (the launcher restarts it)
                continue
            if (update.epoch, update.version) <= before:
                raise RuntimeError(f"received weights {(update.epoch, update.version)} after {before} (epoch, version)")
            self._took(update)

    def _took(self, update) -> None:
        """The engine holds ``update``'s weights now."""
        self.counters.weight_updates += 1
        self.counters.weight_stall_s += update.stall_s  # the engine generated nothing meanwhile
        self.counters.weight_pause_wait_s += update.pause_wait_s  # it ended the step it was in meanwhile
        self.counters.weight_transfer_s += update.receive_s
        self.counters.weight_load_s += update.load_s
        log.debug("weights %s: stall %.3f s (receive %.3f s, load %.3f s; before it, %.3f s to end a step)",
                  self.weights, update.stall_s, update.receive_s, update.load_s, update.pause_wait_s)

    @property
    def groups_in_flight(self) -> int:
        """How many group slots run now: the controller's number, or rollout.groups_in_flight."""
        return self.in_flight.groups if self.in_flight else self.config.rollout.groups_in_flight

    async def _adapt_in_flight(self) -> None:
        """rollout.concurrency.mode=adaptive: move the number of groups in flight with the engine's KV-cache use
        (concurrency.py), and say so when it changes."""
        load, interval = self.engine.load, self.config.rollout.concurrency.interval_s
        warned, began = False, time.monotonic()
        while True:
            await asyncio.sleep(interval)
            decision = self.in_flight.decide(now=time.monotonic(), peak_usage=load.take_peak(),
                                             preemptions=load.preemptions, busy_groups=self.groups_running,
                                             reporting=load.reports > 0)
            if decision.changed:
                log.info("groups in flight: %d (%s; KV cache %.0f%% used, %d requests preempted so far)",
                         decision.groups, decision.reason.replace("_", " "), 100 * load.kv_cache_usage,
                         load.preemptions)
            elif decision.reason == "no_report" and not warned and time.monotonic() - began > 60:
                warned = True
                log.warning("rollout.concurrency.mode=adaptive, but the engine reports no KV-cache use (vLLM %s): "
                            "the groups in flight stay at %d", self.engine.api.version if self.engine.api else "?",
                            decision.groups)

    async def _run_groups(self, slot: int) -> None:
        while not self.stop and not self.control.stop:
            if slot >= self.groups_in_flight:  # adaptive: this slot is above the number in flight now
                await asyncio.sleep(0.05)
                continue
            if self.evaluating:
                await asyncio.sleep(0.05)
                continue
            if self.control.pause_rollout:
                start = time.monotonic()
                while self.control.pause_rollout and not self.control.stop and not self.stop:
                    await asyncio.sleep(0.05)
                self.counters.paused_s += time.monotonic() - start
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
            weights = self.weights
            await asyncio.gather(*(self._run_group() for _ in range(share)))
            start = time.monotonic()
            limit = self.config.learner.batch_timeout_s + self.config.learner.weight_sync_timeout_s
            while self.weights == weights and not self.control.stop and not self.stop:
                if time.monotonic() - start > limit:
                    raise TimeoutError(f"synchronous rollout: no weights after {weights} within {limit:.0f} s "
                                       "(is the learner alive and receiving the batch?)")
                await asyncio.sleep(0.01)
            self.counters.weights_wait_s += time.monotonic() - start

    async def _run_group(self) -> None:
        self.groups_running += 1
        try:
            await self._play_group()
        finally:
            self.groups_running -= 1

    async def _play_group(self) -> None:
        task = self.tasks.next()
        max_turns = self.control.max_turns  # one budget for the whole group
        n = self.config.rollout.n
        group_id = group_id_of(self.index, self.incarnation, task.number)
        env = task.env.name
        try:
            episodes = await asyncio.gather(*(self._play(env, task.task_id, max_turns) for _ in range(n)))
        except asyncio.CancelledError:
            self.counters.abandoned_episodes += n  # stopping: never produced, never sent
            raise
        await self._maybe_send_sample(env, task.task_id, max_turns, episodes)
        monitor = self.config.monitor
        sampled = recorded(group_id, monitor.record_fraction)
        for i, ep in enumerate(episodes):
            traj = to_trajectory(ep, run_id=self.run_id, trajectory_id=f"{group_id}-{i}", group_id=group_id,
                                 group_size=n, env=env, task_id=task.task_id, actor_id=self.index,
                                 max_turns=max_turns, category=self.category[env](task.task_id),
                                 with_text=sampled or (monitor.record_failures and bool(ep.failure)))
            await self.delivery.send(traj)

    async def _play(self, env_name: str, task_id: int, max_turns: int) -> Episode:
        env = self.envs.acquire(env_name)
        ep = None
        # A gauge in the heartbeat: if this actor dies, the coordinator counts these episodes as lost.
        self.gauges.episodes_in_progress += 1
        try:
            if self.agents is not None:
                ep = await self.agents.play(env, env_name, task_id, max_turns)
            else:
                ep = await run_episode(self.engine, env, self.chat, task_id, max_turns=max_turns,
                                       sampling=self.sampling, weights=lambda: self.weights)
        finally:
            self.gauges.episodes_in_progress -= 1
            self.envs.release(env_name, env, healthy=ep is not None and ep.failure not in UNHEALTHY_ENV_FAILURES)
        self.counters.episodes += 1
        self.counters.generated_tokens += ep.generated_tokens
        self.counters.turns += ep.env_turns
        self.counters.context_windows += len(ep.hidden_turns_at)
        if ep.failure:
            # Never trained on; counted by kind (rollout/failures/<kind> in TensorBoard).
            self.counters.count_failure(ep.failure)
            self._failure_log.warning("%s failure in %s task %d: %s", ep.failure, env_name, task_id,
                                      ep.failure_message)
            self.events.emit(RunEvent.EPISODE_FAILED, actor=self.index, env=env_name, task=task_id,
                             failure=ep.failure, message=ep.failure_message)
        else:
            self.counters.completed += 1
            self.counters.successes += ep.success
            self.counters.reward_sum += ep.reward
            self.counters.count_stop(ep.stop_reason)  # the agent's outcomes: done, max_turns, context_limit
            self.counters.completed_turns += ep.env_turns
            self.counters.invalid_actions += ep.invalid_actions  # the agent's errors (observations, not failures)
        return ep

    def held_out_specs(self) -> list[EvalSpec]:
        """One evaluation per environment: its first ``eval.episodes_during_training`` test-split tasks."""
        episodes = self.config.eval.episodes_during_training
        return [EvalSpec.for_run(self.config, spec, episodes=episodes) for spec in self.config.envs]

    async def _evaluate_held_out(self) -> None:
        """Evaluate the newest step the coordinator asks for, once the engine holds that step's weights
        (a request that comes while one runs is served next; older ones are skipped)."""
        done = -1
        while True:
            step = self.control.eval_step if self.control is not None else -1
            if step <= done:
                await asyncio.sleep(0.1)
                continue
            await self._wait_for_version(step)
            start = time.monotonic()
            self.evaluating = True
            try:
                results = await asyncio.gather(*(evaluate_with(self.engine, self.chat, spec, self.make_env,
                                                               weights=lambda: self.weights)
                                                 for spec in self.held_out_specs()))
            finally:
                self.evaluating = False
            wall_s = time.monotonic() - start
            versions = [r["weight_versions"] for r in results if r["weight_versions"][0] >= 0]
            message = HeldOutEval(
                run_id=self.run_id, learner_step=step, wall_s=wall_s,
                weight_versions=(min(v[0] for v in versions), max(v[1] for v in versions)) if versions else (-1, -1),
                results={r["env"]: {key: float(r[key]) for key in EVAL_METRICS} for r in results}, key=self.run_key)
            self.counters.eval_runs += 1
            self.counters.eval_episodes += sum(r["episodes"] for r in results)
            self.counters.eval_s += wall_s
            log.info("held-out evaluation of step %d: %s (%.1f s, weights v%d-v%d)", step,
                     ", ".join(f"{r['env']} {r['success_rate']:.2f}" for r in results), wall_s,
                     *message.weight_versions)
            try:
                await asyncio.wait_for(self.reports.send(encode(message)), EVAL_SEND_TIMEOUT_S)
            except asyncio.TimeoutError:
                log.warning("the held-out evaluation of step %d could not be sent to the coordinator within %.0f s",
                            step, EVAL_SEND_TIMEOUT_S)
            done = step

    async def _wait_for_version(self, step: int) -> None:
        """Until the engine holds the weights of learner ``step`` (or newer): they are announced with the step
        and arrive within the weight-sync timeout. Past it, the evaluation goes on with what the engine has
        (its message names the versions that played)."""
        deadline = time.monotonic() + self.config.learner.weight_sync_timeout_s
        while self.weights[1] < step:
            if time.monotonic() > deadline:
                log.warning("held-out evaluation of step %d: the engine still holds weights %s after %.0f s; "
                            "evaluating those", step, self.weights, self.config.learner.weight_sync_timeout_s)
                return
            await asyncio.sleep(0.05)

    async def _maybe_send_sample(self, env: str, task_id: int, max_turns: int, episodes: list[Episode]) -> None:
        """At most one episode per environment every ``monitor.episode_sample_every_s``, as text."""
        every = self.config.monitor.episode_sample_every_s
        now = time.monotonic()
        if not every or now - self._last_sample.get(env, -every) < every:
            return
        self._last_sample[env] = now
        ep = episodes[self.tasks.next_group % len(episodes)]  # a different member each time
        sample = episode_sample(ep, run_id=self.run_id, env=env, task_id=task_id, actor_id=self.index,
                                max_turns=max_turns)
        try:
            await self.reports.send(encode(sample), zmq.NOBLOCK)
        except zmq.Again:
            pass  # the coordinator is not reading: a sample is disposable

    async def _heartbeat(self) -> None:
        while True:
            beat = Heartbeat(run_id=self.run_id, role="actor", index=self.index, pid=os.getpid(),
                             counters=heartbeat_counters(*self.counts()), key=self.run_key)
            try:
                await self.reports.send(encode(beat), zmq.NOBLOCK)
            except zmq.Again:
                pass
            await asyncio.sleep(1.0)

    def counts(self) -> tuple[ActorCounters, DeliveryCounters, ActorGauges]:
        """What the heartbeat reports: this actor's counters with its engine's, its delivery's, its gauges."""
        e = self.engine
        self.counters.continued_requests, self.counters.kept_requests = e.continued_requests, e.kept_requests
        self.counters.lost_stage_messages = e.lost_stage_messages
        self.counters.engine_idle_s, self.counters.engine_wall_s = e.clock.idle_s, e.clock.wall_s
        self.counters.engine_request_s = e.clock.unit_s
        self.counters.engine_preemptions = e.load.preemptions
        self.counters.in_flight_changes = self.in_flight.changes if self.in_flight else 0
        self.gauges.groups_in_flight = self.groups_in_flight
        self.gauges.groups_running = self.groups_running
        self.gauges.kv_cache_usage = e.load.kv_cache_usage
        self.gauges.unacknowledged = len(self.delivery.unacked)
        self.gauges.weight_epoch, self.gauges.weight_version = self.weights
        return self.counters, self.delivery.counters, self.gauges

    async def close(self) -> None:
        await self.envs.close()
        self.delivery.close()
        for sock in (self.intake, self.sub, self.reports):
            sock.close(linger=0)
        if self.security is not None:
            self.security.stop()
        self.ctx.term()


async def _amain(config: TrainConfig, index: int, stop: StopFlag, make_env: EnvFactory) -> None:
    r = config.rollout
    # The engine's workers (its child processes) join the learner's weight hub with the run's key
    os.environ[RUN_KEY_ENV] = read_run_key(config.output_dir)
    keep_collectives_on(config.network.bind_address())  # their gloo sockets listen where the run binds
    engine = RolloutEngine.start(config.model.path, dtype=config.model.dtype, engine=r.engine,
                                 max_model_len=r.max_context_tokens, seed=config.run.seed + index,
                                 cpus=engine_cpus_of(config, index),
                                 lora_rank=config.learner.lora.rank if config.learner.lora else None)
    actor = Actor(config, index, stop, engine, load_chat_tokenizer(config.model.path), make_env)
    try:
        if r.agent is not None:
            from horizonrl.actors.openai_endpoint.agent_runs import start_for_actor

            actor.agents = await start_for_actor(actor)
        await actor.run()
    finally:
        log.info("stopping; counters %s", actor.counters)
        if actor.agents is not None:
            await actor.agents.stop()
        await actor.close()
        engine.shutdown()


def main(config: TrainConfig, index: int, make_env: EnvFactory) -> int:
    """The actor process; ``make_env`` creates the environments (the program wires in ``envs.make_env``)."""
    return run_actor(config, index, StopFlag().install(), make_env)


def run_actor(config: TrainConfig, index: int, stop: StopFlag, make_env: EnvFactory) -> int:
    """Actor ``index`` until ``stop`` (its own event loop: a thread of the inline launcher runs it too)."""
    asyncio.run(_amain(config, index, stop, make_env))
    return 0
