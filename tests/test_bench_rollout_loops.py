"""The rollout benchmark's two loops, the heavy-tailed workload and the engine's busy clock.

A scripted engine stands in for vLLM here (the loops' bookkeeping is what is under test); the
same loops run on a real engine in tests/integration/test_bench_system.py.
"""

import asyncio
import time

from horizonrl.actors.engine import Generation
from horizonrl.bench.rollout import SAMPLING, Workload, run_async, run_lockstep
from horizonrl.bench.workload import HeavyTailEnv, HeavyTailSettings
from horizonrl.runtime import BusyClock


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


def test_lockstep_waits_for_the_slowest_episode_and_async_does_not():
    # One long episode per batch of short ones: lock-step holds every slot for the whole batch.
    settings = HeavyTailSettings(turns_median=2.0, turns_sigma=1.2, latency_median_s=0.004, latency_sigma=0.5)
    workload = heavy_tail_workload(settings)
    tasks = list(range(48))

    async def wall(loop):
        start = time.perf_counter()
        await loop(ScriptedEngine(delay=0.002), ScriptedChat(), workload, tasks, 8)
        return time.perf_counter() - start

    lockstep, concurrent = asyncio.run(wall(run_lockstep)), asyncio.run(wall(run_async))
    assert concurrent < lockstep, (concurrent, lockstep)


def test_busy_clock_counts_only_time_with_nothing_in_flight():
    clock = BusyClock()
    time.sleep(0.05)
    clock.enter()
    clock.enter()
    time.sleep(0.05)
    clock.exit()
    time.sleep(0.02)  # still one in flight: busy
    clock.exit()
    assert 0.045 < clock.idle_s < 0.065
    time.sleep(0.03)
    assert 0.075 < clock.idle_s < 0.1
    assert clock.wall_s >= 0.15 and clock.in_flight == 0
    clock.reset()
    assert clock.idle_s < 0.01


def test_sampling_settings_fit_the_tiny_model():
    assert SAMPLING.max_context_tokens >= 512 and SAMPLING.temperature == 1.0
