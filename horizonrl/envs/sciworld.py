"""SciWorld on the ``scienceworld`` package (a JVM simulator), in AgentGym's format.

Ids follow AgentGym: the 30 ScienceWorld tasks in the package's order, without AgentGym's
exclusions (5-1, 5-2, 9-1, 9-2, 9-3, 10-1, 10-2), each with all its variations, flattened into
one list; id ``i`` is the ``i``-th (task, variation). The table lives in
``data/sciworld_tasks.json`` so listing ids needs no JVM.

Splits (fix): AgentGym's test ids overlap its training ids. Here an id is in ``train`` when its
variation is in ScienceWorld's own train variations of that task and in ``test`` when it is in
ScienceWorld's test variations (dev variations are in neither), so the splits are disjoint by
construction. The category is the task name (e.g. ``boil``).

First observation: the task description, then the output of ``look around``. The action is the
text after the last ``Action:``; a reply without one gets ``Invalid Action.``. ``score`` is
ScienceWorld's 0-100 score (a failed task's -100 is reported as 0); ``reward`` is the change of
that score divided by 100, so an episode's rewards sum to score/100; ``success`` is score 100.

Each instance holds one JVM while it is in use; ``close()`` returns it to a process-wide pool
that the next instance reuses (starting a JVM takes ~2 s). Java 17 must be on PATH.
"""

from __future__ import annotations

import functools
import json
import random
import shutil
import threading
from pathlib import Path
from typing import Any

from horizonrl.envs.base import EnvironmentFailure, StepResult, extract_react_action, run_blocking

EXCLUDED_TASKS = frozenset({"5-1", "5-2", "9-1", "9-2", "9-3", "10-1", "10-2"})
TABLE = Path(__file__).parent / "data" / "sciworld_tasks.json"
MAX_ACTION_CHARS = 500


@functools.lru_cache(maxsize=1)
def task_table() -> list[dict[str, Any]]:
    """AgentGym's flat (task, variation) list: [{"key", "name", "variation", "split"}, ...]."""
    rows = []
    for task in json.loads(TABLE.read_text())["tasks"]:
        if task["key"] in EXCLUDED_TASKS:
            continue
        train, test = set(task["train"]), set(task["test"])
        for variation in range(task["variations"]):
            split = "train" if variation in train else ("test" if variation in test else "dev")
            rows.append({"key": task["key"], "name": task["name"], "variation": variation, "split": split})
    return rows


def canonical_listing(text: str) -> str:
    """Sort the tab-indented sibling lines of every listing (keeping each line's sub-items
    under it): ScienceWorld lists a room's contents in an order that changes from load to load,
    and the same task must give the same text."""
    lines = text.split("\n")

    def depth(line: str) -> int:
        return len(line) - len(line.lstrip("\t"))

    def block(start: int, level: int) -> tuple[list[list[str]], int]:
        siblings: list[list[str]] = []
        i = start
        while i < len(lines) and depth(lines[i]) == level and level > 0:
            children, j = block(i + 1, level + 1)
            siblings.append([lines[i], *(line for child in children for line in child)])
            i = j
        return sorted(siblings), i

    out: list[str] = []
    i = 0
    while i < len(lines):
        if depth(lines[i]) == 1:
            siblings, i = block(i, 1)
            out.extend(line for sibling in siblings for line in sibling)
        else:
            out.append(lines[i])
            i += 1
    return "\n".join(out)


class _JVMPool:
    """Idle ScienceWorld JVMs kept for reuse; at most ``max_idle`` are kept."""

    def __init__(self, max_idle: int = 4) -> None:
        self.max_idle = max_idle
        self._idle: list[Any] = []
        self._lock = threading.Lock()

    def acquire(self, step_limit: int) -> Any:
        with self._lock:
            jvm = self._idle.pop() if self._idle else None
        if jvm is None:
            if shutil.which("java") is None:
                raise EnvironmentFailure(
                    "SciWorld needs Java 17: 'java' was not found on PATH (Debian/Ubuntu: "
                    "apt-get install openjdk-17-jre-headless)"
                )
            from scienceworld import ScienceWorldEnv

            try:
                jvm = ScienceWorldEnv("", envStepLimit=step_limit)
            except Exception as error:  # the JVM did not start: not the agent's fault
                raise EnvironmentFailure(f"could not start the ScienceWorld JVM: {error}") from error
        jvm.envStepLimit = step_limit
        return jvm

    def release(self, jvm: Any) -> None:
        with self._lock:
            if len(self._idle) < self.max_idle:
                self._idle.append(jvm)
                return
        _shutdown(jvm)

    def clear(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for jvm in idle:
            _shutdown(jvm)

    @property
    def idle(self) -> int:
        return len(self._idle)


def _shutdown(jvm: Any) -> None:
    try:
        jvm.close()
    except Exception:  # already dead; nothing left to free
        pass


POOL = _JVMPool()


def _printable(text: str) -> str:
    """Drop what the JVM bridge cannot carry (lone surrogates, control characters)."""
    text = text.encode("utf-8", "ignore").decode("utf-8")
    return "".join(c for c in text if c.isprintable() or c in "\n\t")


class SciWorldEnv:
    """One ScienceWorld episode at a time (see the module docstring for the format)."""

    name = "sciworld"

    def __init__(self, step_limit: int = 1000, gold_path: bool = False) -> None:
        self.step_limit = step_limit
        self.gold_path = gold_path
        self._jvm: Any = None
        self._done = True
        self._score = 0
        self._gold: list[str] = []
        self.task_description = ""  # the current task's, also the first line(s) of reset's observation

    def task_ids(self, split: str) -> list[int]:
        if split not in ("train", "test"):
            raise ValueError(f"unknown split {split!r}; use 'train' or 'test'")
        return [i for i, row in enumerate(task_table()) if row["split"] == split]

    def task_category(self, task_id: int) -> str:
        return task_table()[task_id]["name"]

    @property
    def num_tasks(self) -> int:
        return len(task_table())

    async def reset(self, task_id: int) -> str:
        if not isinstance(task_id, int) or isinstance(task_id, bool) or not 0 <= task_id < self.num_tasks:
            raise ValueError(f"sciworld task id must be an integer in 0..{self.num_tasks - 1}, got {task_id!r}")
        return await run_blocking(self._reset, task_id)

    async def step(self, action_text: str) -> StepResult:
        if self._done or self._jvm is None:
            return StepResult("The episode is over; no more actions are accepted.", 0.0, True,
                              self._score >= 100, float(self._score), {"invalid_action": True})
        action = extract_react_action(_printable(action_text or ""))
        if action is None or len(action) > MAX_ACTION_CHARS:
            return StepResult("Invalid Action.", 0.0, False, score=float(self._score), info={"invalid_action": True})
        return await run_blocking(self._step, action)

    async def close(self) -> None:
        jvm, self._jvm = self._jvm, None
        self._done = True
        if jvm is not None:
            await run_blocking(POOL.release, jvm)

    def random_action(self, rng: random.Random) -> str:
        return f"Action: {rng.choice(self._valid_actions())}"

    def expert_plan(self) -> list[str]:
        """ScienceWorld's gold action sequence for the current task (needs ``gold_path=True``)."""
        if not self.gold_path:
            raise RuntimeError("create the environment with gold_path=True to get the gold sequence")
        return [f"Action: {a}" for a in self._gold]

    # ------------------------------------------------------------ blocking
    def _reset(self, task_id: int) -> str:
        from py4j.protocol import Py4JError

        row = task_table()[task_id]
        if self._jvm is None:
            self._jvm = POOL.acquire(self.step_limit)
        try:
            self._jvm.load(row["name"], row["variation"], "", generateGoldPath=self.gold_path)
            self._gold = self._jvm.get_gold_action_sequence() if self.gold_path else []
            description = self._jvm.get_task_description()
            observation = canonical_listing(str(self._jvm.server.step("look around")))
        except Py4JError as error:
            self._drop_jvm()
            raise EnvironmentFailure(f"ScienceWorld JVM failed during reset: {error}") from error
        self._score = 0
        self._done = False
        self.task_description = description
        return f"{description}\n{observation}"

    def _step(self, action: str) -> StepResult:
        from py4j.protocol import Py4JError, Py4JJavaError, Py4JNetworkError

        # The package's own step() also builds every valid action/object combination on every
        # call (~20x slower); the server calls below are the part that advances the simulation.
        server = self._jvm.server
        try:
            observation = canonical_listing(str(server.step(action)))
            raw = int(round(100 * server.getScore()))
            completed = bool(server.getCompleted()) or raw < 0 or server.getNumMoves() > self.step_limit
        except Py4JJavaError:
            return StepResult("No known action matches that input.", 0.0, False, score=float(self._score),
                              info={"invalid_action": True})
        except (Py4JNetworkError, Py4JError) as error:
            self._drop_jvm()
            raise EnvironmentFailure(f"ScienceWorld JVM failed during step: {error}") from error
        score = max(0, min(100, raw))
        reward = (score - self._score) / 100.0
        self._score = score
        self._done = completed
        invalid = observation.startswith("No known action matches")
        return StepResult(observation, reward, completed, score >= 100, float(score),
                          {"invalid_action": invalid, "raw_score": raw})

    def _valid_actions(self) -> list[str]:
        if self._jvm is None or self._done:
            return ["look around"]
        try:
            return sorted(self._jvm.get_valid_action_object_combinations()) or ["look around"]
        except Exception:
            return ["look around"]

    def _drop_jvm(self) -> None:
        jvm, self._jvm = self._jvm, None
        self._done = True
        if jvm is not None:
            _shutdown(jvm)
