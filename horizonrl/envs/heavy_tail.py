"""A heavy-tailed agent environment, the benchmarks' workload (``envs: [{name: heavy-tail}]``).

:class:`HeavyTailEnv` stands in for the environments agents really meet: most episodes are
short, a few run long (the turn count is log-normal), and each step waits a log-normally
distributed time, as a tool call, a web page or a simulator does. Everything is a function of
the task id, so two rollout loops given the same task ids do exactly the same environment work.
The observations are Signpost's, so a model warmed up on Signpost answers them in its format.
"""

from __future__ import annotations

import asyncio
import math
import random
from dataclasses import dataclass

from horizonrl.envs.base import StepResult
from horizonrl.envs.signpost import DIRECTIONS, INSTRUCTION


@dataclass(frozen=True)
class HeavyTailSettings:
    turns_median: float = 3.0  # log-normal turn count, rounded (at least 1) and capped by the turn budget
    turns_sigma: float = 0.8
    latency_median_s: float = 0.05  # log-normal seconds per environment step
    latency_sigma: float = 1.0


class HeavyTailEnv:
    """An episode lasts a task-determined number of turns; each step sleeps a task-determined time."""

    name = "heavy-tail"

    def __init__(self, settings: HeavyTailSettings = HeavyTailSettings(), num_tasks: int = 10_000) -> None:
        self.settings = settings
        self.num_tasks = num_tasks
        self._turns = 0
        self._latencies: list[float] = []
        self._signs: list[str] = []
        self._turn = 0

    def plan(self, task_id: int, max_turns: int = 1_000) -> tuple[int, list[float]]:
        """(turns, per-step latencies) of ``task_id``: the same in every loop that plays it."""
        s = self.settings
        rng = random.Random(f"heavy-tail:{task_id}")
        turns = min(max_turns, max(1, round(rng.lognormvariate(math.log(s.turns_median), s.turns_sigma))))
        latencies = [rng.lognormvariate(math.log(s.latency_median_s), s.latency_sigma) for _ in range(max_turns)]
        return turns, latencies

    async def reset(self, task_id: int) -> str:
        self._turns, self._latencies = self.plan(task_id)
        rng = random.Random(f"heavy-tail-signs:{task_id}")
        self._signs = [rng.choice(DIRECTIONS) for _ in range(len(self._latencies) + 1)]
        self._turn = 0
        return f"{INSTRUCTION}\nA sign points {self._signs[0]}."

    async def step(self, action_text: str) -> StepResult:
        await asyncio.sleep(self._latencies[self._turn])
        self._turn += 1
        if self._turn >= self._turns:
            return StepResult("You reached the exit.", 1.0, True, success=True, score=1.0)
        return StepResult(f"A sign points {self._signs[self._turn]}.", 0.0, False)

    async def close(self) -> None:
        pass

    def task_ids(self, split: str) -> list[int]:
        return list(range(self.num_tasks))

    def task_category(self, task_id: int) -> str:
        return "heavy-tail"

    def random_action(self, rng: random.Random) -> str:
        return f"Thought: The sign points {self._signs[self._turn]}.\nAction: go {rng.choice(DIRECTIONS)}"


def heavy_tail_env(num_tasks: int = 10_000, **settings: float) -> HeavyTailEnv:
    """The registry's factory (``envs: [{name: heavy-tail, settings: {...}}]``, the settings being
    :class:`HeavyTailSettings`' fields), so that a training run's actors play the same workload:
    ``horizonrl bench --parts training --workload heavy-tail``."""
    return HeavyTailEnv(HeavyTailSettings(**settings), num_tasks=num_tasks)
