"""The actor's group slots follow the adaptive number of groups in flight (actors/actor.py, rollout.concurrency):
more groups run while the engine's KV cache is emptier than the band, fewer once it is fuller, and a slot above
the number finishes its group before it waits. A stand-in engine reports the load; groups are stand-ins too."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from test_actor_weights import StagingEngine, control, make_actor

from horizonrl.actors.concurrency import EngineLoad


class LoadedEngine(StagingEngine):
    def __init__(self) -> None:
        super().__init__()
        self.load = EngineLoad(reports=1)
        self.api = None
        self.clock = SimpleNamespace(idle_s=0.0, wall_s=0.0, unit_s=0.0)


async def wait_for(predicate, what: str, timeout_s: float = 20.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


async def test_the_slots_follow_the_kv_cache_band(tmp_path):
    engine = LoadedEngine()
    actor = make_actor(tmp_path, engine, groups_in_flight=2,
                       concurrency={"mode": "adaptive", "kv_cache_low": 0.5, "kv_cache_high": 0.8, "min_groups": 1,
                                    "max_groups": 5, "hold_s": 0.0, "interval_s": 0.02})
    actor.control = control(0)
    running, most = [0], [0]
    overshoot = []

    async def stand_in_group():
        actor.groups_running += 1
        running[0] += 1
        most[0] = max(most[0], running[0])
        slot = int(asyncio.current_task().get_name().split("-")[1])
        if slot >= actor.groups_in_flight:  # a slot above the number finishes its group, but starts none
            overshoot.append((slot, actor.groups_in_flight))
        try:
            await asyncio.sleep(0.05)
        finally:
            running[0] -= 1
            actor.groups_running -= 1

    actor._run_group = stand_in_group
    slots = [asyncio.create_task(actor._run_groups(slot), name=f"groups-{slot}") for slot in range(5)]
    adapt = asyncio.create_task(actor._adapt_in_flight())
    try:
        engine.load.kv_cache_usage = engine.load.peak_kv_cache_usage = 0.1  # room: grow to max_groups
        await wait_for(lambda: actor.groups_in_flight == 5, "5 groups in flight")
        await wait_for(lambda: most[0] == 5, "5 groups running at once")
        engine.load.kv_cache_usage = engine.load.peak_kv_cache_usage = 0.95  # full: shrink to min_groups
        await wait_for(lambda: actor.groups_in_flight == 1, "1 group in flight")
        await asyncio.sleep(0.2)  # every slot above 1 has finished its group by now
        assert running[0] <= 1 and not overshoot
        counters, _, gauges = actor.counts()
        assert counters.in_flight_changes >= 4 and gauges.groups_in_flight == 1 and gauges.kv_cache_usage == 0.95
    finally:
        for task in (*slots, adapt):
            task.cancel()
        await asyncio.gather(*slots, adapt, return_exceptions=True)
        await actor.close()


async def test_a_fixed_number_runs_without_a_controller(tmp_path):
    actor = make_actor(tmp_path, LoadedEngine(), groups_in_flight=3)
    try:
        assert actor.in_flight is None and actor.groups_in_flight == 3
    finally:
        await actor.close()
