"""Signpost: a small built-in multi-turn environment that a tiny model can learn in minutes.

The agent stands at a crossroads; a sign points left, right or straight. Following the
sign advances to the next crossroads; any other move is a dead end that returns it to
the same crossroads (the turn is spent). The episode succeeds after ``length`` correct
moves. A uniformly random policy succeeds only when it guesses right often enough within
the turn budget (about 0.10 for length 4 in 6 turns), while the learnable rule (read the
sign, follow it) succeeds always — so a rise in success shows that learning happened and
that the new weights reached the actors. The turn budget matters: fewer turns, fewer
chances to recover from a wrong guess.

Replies are ReAct (``Thought: … Action: …``). The random policy's replies (``random_action``,
used for the tiny model's format warm-up) restate what the agent sees in the thought and
then pick a uniformly random action: the warm-up teaches the format and the perception,
never the decision. ``straight_share`` sets how many signs point straight (default 1/3).
"""

from __future__ import annotations

import random

from horizonrl.envs.base import StepResult, extract_react_action

DIRECTIONS = ("left", "right", "straight")
ACTIONS = tuple(f"go {d}" for d in DIRECTIONS)
INSTRUCTION = "Follow the signs to the exit. Actions: go left, go right, go straight."


class SignpostEnv:
    name = "signpost"

    def __init__(self, length: int = 4, num_tasks: int = 10_000, straight_share: float = 1 / 3) -> None:
        if length < 1 or num_tasks < 2 or not 0.0 <= straight_share <= 1.0:
            raise ValueError("signpost needs length >= 1, num_tasks >= 2 and 0 <= straight_share <= 1")
        self.length = length
        self.num_tasks = num_tasks
        turn = (1.0 - straight_share) / 2
        self._sign_weights = (turn, turn, straight_share)  # in DIRECTIONS order
        self._signs: list[str] = []
        self._progress = 0
        self._done = True

    async def reset(self, task_id: int) -> str:
        if not 0 <= task_id < self.num_tasks:
            raise ValueError(f"signpost task id {task_id} is outside 0..{self.num_tasks - 1}")
        rng = random.Random(task_id)
        self._signs = rng.choices(DIRECTIONS, weights=self._sign_weights, k=self.length)
        self._progress = 0
        self._done = False
        return f"{INSTRUCTION}\n{self._sign_text()}"

    async def step(self, action_text: str) -> StepResult:
        if self._done:
            return StepResult("The episode is over; no more actions are accepted.", 0.0, True)
        action = (extract_react_action(action_text) or "").lower()
        if action not in ACTIONS:
            return StepResult(
                f"Invalid action. Reply with one of: {', '.join(ACTIONS)}.\n{self._sign_text()}", 0.0, False,
                info={"invalid_action": True})
        if action == f"go {self._signs[self._progress]}":
            self._progress += 1
            score = self._progress / self.length
            if self._progress == self.length:
                self._done = True
                return StepResult("You reached the exit.", 1.0 / self.length, True, success=True, score=score)
            return StepResult(self._sign_text(), 1.0 / self.length, False, score=score)
        return StepResult(f"Dead end. You walk back. {self._sign_text()}", 0.0, False,
                          score=self._progress / self.length)

    async def close(self) -> None:
        self._done = True

    def task_ids(self, split: str) -> list[int]:
        # Every fifth id is held out, so the splits are disjoint by construction.
        if split == "train":
            return [i for i in range(self.num_tasks) if i % 5 != 0]
        if split == "test":
            return [i for i in range(self.num_tasks) if i % 5 == 0]
        raise ValueError(f"unknown split {split!r}; use 'train' or 'test'")

    def task_category(self, task_id: int) -> str:
        return f"length-{self.length}"

    def random_action(self, rng: random.Random) -> str:
        sign = self._signs[self._progress] if not self._done else rng.choice(DIRECTIONS)
        return f"Thought: The sign points {sign}.\nAction: {rng.choice(ACTIONS)}"

    def _sign_text(self) -> str:
        return f"A sign points {self._signs[self._progress]}."
