"""The rollout benchmark's two loops, the heavy-tailed workload and the engine's busy clock.

A scripted engine stands in for vLLM here (the loops' bookkeeping is what is under test); the
same loops run on a real engine in tests/integration/test_bench_system.py.
"""

import asyncio
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from horizonrl.actors.engine import Generation
from horizonrl.apps.bench.cli import TRAINING_WORKLOADS
from horizonrl.apps.bench.rollout import SAMPLING, Workload, run_async, run_lockstep
from horizonrl.envs.heavy_tail import HeavyTailEnv, HeavyTailSettings
from horizonrl.core.config import load_config
from horizonrl.core.environment import StepResult
from horizonrl.core.runtime import BusyClock
from horizonrl.envs.registry import make_env


class ScriptedChat:
    stop_token_ids = [0]

    def prompt_ids(self, observation, system_prompt=None):
        return [1, 2, 3]

    def continuation_ids(self, observation, generated_ids):
        return [4, 5]

    def decode(self, ids):
        return "Action: go left"


class ScriptedEngine:
    """Replies with 3 tokens after ``delay`` seconds; records how many requests overlap."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.clock = BusyClock()
        self.max_in_flight = 0
        self.requests = 0

    async def generate(self, prompt_ids, *, max_tokens, temperature, top_p, stop_token_ids):
        self.clock.enter()
        self.requests += 1
        self.max_in_flight = max(self.max_in_flight, self.clock.in_flight)
        try:
            await asyncio.sleep(self.delay)
            return Generation([7, 8, 0], [-0.1, -0.2, -0.3], "stop")
        finally:
            self.clock.exit()


FAST = HeavyTailSettings(turns_median=3.0, turns_sigma=0.8, latency_median_s=0.002, latency_sigma=1.0)


def heavy_tail_workload(settings=FAST) -> Workload:
    return Workload("heavy-tail", lambda: HeavyTailEnv(settings), 24, "test")


def test_heavy_tail_plan_is_a_function_of_the_task():
    env = HeavyTailEnv(FAST)
    assert env.plan(7) == HeavyTailEnv(FAST).plan(7)
    turns = [env.plan(t, max_turns=24)[0] for t in range(2000)]
    assert min(turns) >= 1 and max(turns) <= 24
    turns.sort()
    median, p99 = turns[1000], turns[1980]
    assert median == 3 and p99 >= 3 * median, (median, p99)  # most short, a long tail


def test_the_training_benchmark_config_builds_the_same_workload_by_name():
    """`horizonrl bench --workload heavy-tail`'s actors make the env from the registry and its config's settings."""
    config = load_config(TRAINING_WORKLOADS["heavy-tail"], [])
    assert Path(TRAINING_WORKLOADS["signpost"]).exists()
    (spec,) = config.envs
    by_name = make_env(spec.name, spec.settings)
    direct = HeavyTailEnv(HeavyTailSettings())  # the rollout part's defaults
    budget = config.algorithm.rounds_ctrl.rounds[-1]
    assert budget == 24 and all(by_name.plan(t, budget) == direct.plan(t, budget) for t in range(50))


def test_the_workload_option_is_refused_without_the_training_part():
    proc = subprocess.run([sys.executable, "-m", "horizonrl", "bench", "--parts", "rollout", "--workload",
                           "heavy-tail"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "training part only" in proc.stderr


def test_both_loops_play_the_same_episodes():
    workload = heavy_tail_workload()
    tasks = list(range(40))
    env = HeavyTailEnv(FAST)
    expected = [env.plan(t, workload.max_turns)[0] for t in tasks]

    async def play(loop):
        engine = ScriptedEngine()
        episodes = await loop(engine, ScriptedChat(), workload, tasks, 8)
        return engine, episodes

    for loop in (run_async, run_lockstep):
        engine, episodes = asyncio.run(play(loop))
        assert [ep.num_turns for ep in episodes] == expected, loop.__name__
        assert all(ep.success and not ep.failure for ep in episodes)
        assert engine.requests == sum(expected)
        assert engine.max_in_flight <= 8
        # Prompt, then per turn: 3 generated tokens (mask 1) and a 2-token observation (mask 0).
        ep = episodes[0]
        assert ep.loss_mask == [0, 0, 0] + ([1, 1, 1, 0, 0] * ep.num_turns)[:-2]


class OneLongPerBatch:
    """Task t lasts 12 turns when t % 8 == 0, else 1 turn: one straggler in every batch of 8."""

    async def reset(self, task_id: int) -> str:
        self._left = 12 if task_id % 8 == 0 else 1
        return "go"

    async def step(self, action_text: str) -> StepResult:
        self._left -= 1
        return StepResult("go", 1.0 if self._left == 0 else 0.0, self._left == 0, success=self._left == 0)


class InFlightAtStart(ScriptedEngine):
    """Records how many requests were in flight (itself included) when each request started."""

    def __init__(self) -> None:
        super().__init__(delay=0.001)
        self.in_flight_at_start: list[int] = []

    async def generate(self, prompt_ids, **kwargs):
        self.in_flight_at_start.append(self.clock.in_flight + 1)
        return await super().generate(prompt_ids, **kwargs)


def test_lockstep_waits_for_the_slowest_episode_and_async_does_not():
    """Structural, not timed: while a batch's straggler plays its 11 extra turns, lock-step starts
    nothing else (each of those requests is alone in flight); the asynchronous loop refills the
    freed slots, so its requests mostly have company."""
    workload = Workload("one-long-per-batch", OneLongPerBatch, 16, "test")
    tasks = list(range(48))
    alone = {}
    for loop in (run_lockstep, run_async):
        engine = InFlightAtStart()
        asyncio.run(loop(engine, ScriptedChat(), workload, tasks, 8))
        assert len(engine.in_flight_at_start) == 6 * (12 + 7)  # every turn of every episode
        alone[loop.__name__] = sum(n == 1 for n in engine.in_flight_at_start)
    # per batch: the round's first request (the others start right after it) and the straggler's turns 2..12
    assert alone["run_lockstep"] == 6 * (1 + 11)
    assert alone["run_async"] <= 1 + 11  # the very first request, and the last straggler once no task is left


def test_busy_clock_counts_idle_time_and_the_requests_in_flight(monkeypatch):
    from horizonrl.core import runtime

    now = [0.0]
    monkeypatch.setattr(runtime, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    clock = BusyClock()
    now[0] = 0.05
    clock.enter()
    clock.enter()
    now[0] = 0.10
    clock.exit()
    now[0] = 0.12  # still one in flight: busy
    clock.exit()
    assert clock.idle_s == 0.05 and clock.in_flight == 0
    now[0] = 0.15
    assert clock.idle_s == 0.05 + 0.03 and clock.wall_s == 0.15
    # requests in flight, integrated over time: 2 for 0.05 s, then 1 for 0.02 s
    assert clock.unit_s == pytest.approx(2 * 0.05 + 1 * 0.02)
    clock.enter()
    now[0] = 0.25  # one in flight, still open
    assert clock.unit_s == pytest.approx(0.12 + 0.10)
    clock.reset()
    assert clock.idle_s == 0 and clock.unit_s == 0


def test_sampling_settings_fit_the_tiny_model():
    assert SAMPLING.max_context_tokens >= 512 and SAMPLING.temperature == 1.0


def test_the_partitioned_bare_engines_keep_as_many_requests_in_flight_as_the_training_run_with_its_overrides():
    """`horizonrl bench --partition --set rollout.n=4 --set learner.groups_per_step=2`: the bare engines get the
    training run's 8 requests in flight, not the config's 64 (before, the --set overrides reached only the runs)."""
    from horizonrl.apps.bench.engine_bound import partitioned_spec
    from horizonrl.apps.bench.partition import CorePartition

    partition = CorePartition(learner=(0,), engines=((1,),))
    cfg, spec = partitioned_spec(True, "/m", partition, ["rollout.n=4", "learner.groups_per_step=2"])
    assert (cfg.rollout.n, cfg.learner.groups_per_step, cfg.rollout.num_actors) == (4, 2, 1)
    assert spec.concurrency == 8 and spec.num_engines == 1
    _, plain = partitioned_spec(True, "/m", partition, [])
    assert plain.concurrency == 64


def test_the_bare_engines_replay_the_training_runs_environment():
    """`--set envs=[...]` (a workload whose rewards are not all zero for the model at hand): the bare engines
    replay prompts of that environment, not Signpost's (before, every bare engine replayed Signpost)."""
    from horizonrl.apps.bench.engine_bound import partitioned_spec
    from horizonrl.apps.bench.partition import CorePartition

    partition = CorePartition(learner=(0,), engines=((1,),))
    babyai = '[{"name": "babyai", "settings": {"levels": ["BabyAI-GoToRedBall-v0"], "high_level_actions": true}}]'
    cfg, spec = partitioned_spec(True, "/m", partition, [f"envs={babyai}"])
    assert cfg.envs[0].name == spec.env_name == "babyai"
    assert spec.env_settings == {"levels": ["BabyAI-GoToRedBall-v0"], "high_level_actions": True}
    _, plain = partitioned_spec(True, "/m", partition, [])
    assert plain.env_name == "signpost"


def test_the_partitioned_bare_engines_replay_the_episodes_a_training_run_played(tmp_path):
    """workload.played_episodes: each accepted episode's turn prompts (the context before each generated turn,
    from the start of its sample), in the order the buffer's write-ahead log has them."""
    from helpers import make_trajectory

    from horizonrl.apps.bench.workload import played_episodes
    from horizonrl.buffer.records import Accepted, Served, encode_record
    from horizonrl.buffer.wal import WriteAheadLog
    from horizonrl.protocol import encode
    from horizonrl.protocol.arrays import TOKEN_DTYPE, pack

    one_turn = make_trajectory("g0", 0, tokens=12)  # prompt 0..5, reply 6..11
    two_turns = make_trajectory("g0", 1, tokens=12)
    two_turns.token_ids = pack(list(range(100, 120)), TOKEN_DTYPE)
    two_turns.turn_spans = [(4, 8), (12, 16)]
    two_samples = make_trajectory("g1", 0, tokens=12)
    two_samples.token_ids = pack(list(range(200, 220)), TOKEN_DTYPE)
    two_samples.turn_spans, two_samples.sample_starts = [(3, 6), (13, 16)], [10]  # the second sample starts at 10
    wal = WriteAheadLog(tmp_path / "buffer_wal")
    for t in (one_turn, two_turns, two_samples):
        wal.append(encode_record(Accepted(encode(t))))
    wal.append(encode_record(Served(0, 0, 0, ["g0"])))
    wal.submit()
    wal.close()

    assert played_episodes(tmp_path) == [[list(range(6))],
                                         [list(range(100, 104)), list(range(100, 112))],
                                         [list(range(200, 203)), list(range(210, 213))]]


def test_a_bare_engine_sends_an_episodes_next_turn_only_once_its_reply_is_back():
    """rollout._measure_bare: each episode's prompts one after another (as an actor plays), ``concurrency``
    episodes at a time; every generated token counted."""
    from horizonrl.apps.bench.rollout import _measure_bare

    class OrderEngine(ScriptedEngine):
        def __init__(self):
            super().__init__(delay=0.001)
            self.active: set[int] = set()
            self.overlaps = 0

        async def generate(self, prompt_ids, **kwargs):
            episode = prompt_ids[0]
            self.overlaps += episode in self.active
            self.active.add(episode)
            try:
                return await super().generate(prompt_ids, **kwargs)
            finally:
                self.active.discard(episode)

    engine = OrderEngine()
    episodes = [[[e, 1], [e, 1, 2], [e, 1, 2, 3]][: 1 + e % 3] for e in range(12)]
    [rate] = asyncio.run(_measure_bare([engine], ScriptedChat(), episodes, 4, 1))
    assert engine.overlaps == 0 and engine.max_in_flight == 4
    assert engine.requests == 4 + sum(map(len, episodes))  # the untimed warm-up: the first prompts of 4 episodes
    assert rate > 0
