"""The environment contract shared by the actor and every environment (bottom layer).

An environment instance serves one episode at a time. All episode methods are
``async``; blocking environment code runs off the event loop. Anything that is the
agent's fault (a malformed reply, an impossible action, an action after ``done``) is
answered with an observation. Only failures of the environment itself — a crash, a
timeout, a lost server session, the network — raise :class:`EnvironmentFailure`, which
the actor turns into an infrastructure-failure trajectory that is counted and never
trained on.

The actor depends on this contract only; which environments exist (``envs/``) is wired in
by the program that starts the actor.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

SPLITS = ("train", "test")


class EnvironmentFailure(Exception):
    """The environment (not the agent) failed: crash, timeout, lost session, network."""


@dataclass(frozen=True)
class StepResult:
    """What one ``step`` returns.

    ``reward`` is this step's reward; ``success`` is meaningful when ``done``;
    ``score`` is the environment's own scale (e.g. SciWorld 0-100).
    """

    observation: str
    reward: float
    done: bool
    success: bool = False
    score: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    """One episode at a time; reusable after ``reset``.

    An environment whose replies are not ReAct (``Action: ...``) says so with a class attribute
    ``reply_format`` (e.g. ``"tags"``); the environment server then passes bare actions through
    unchanged instead of reading them as ``Action: <text>``.
    """

    name: str

    async def reset(self, task_id: int) -> str:
        """Start the episode for ``task_id`` (deterministic) and return the first observation,
        which includes the task's instruction."""

    async def step(self, action_text: str) -> StepResult:
        """Apply the model's whole reply; the environment extracts its action from it."""

    async def close(self) -> None:
        """Free everything this instance holds."""

    def task_ids(self, split: str) -> list[int]:
        """The task ids of ``split`` ("train" or "test"); the two are disjoint."""

    def task_category(self, task_id: int) -> str:
        """A difficulty or category label used by evaluation breakdowns."""

    def random_action(self, rng: random.Random) -> str:
        """A well-formed reply chosen uniformly among this state's valid actions.

        Used to build random-policy episodes (the tiny model's format warm-up) and
        random baselines; it teaches the format, not the skill.
        """


def extract_react_action(reply: str) -> str | None:
    """The text after the last ``Action:`` of a ReAct reply (first line only), or None."""
    last = reply.lower().rfind("action:")
    if last < 0:
        return None
    text = reply[last + len("action:"):].strip()
    text = text.splitlines()[0].strip() if text else ""
    return text.strip().strip("`").strip().rstrip(".").strip() or None


TAGGED_ACTION = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)
FENCED_ACTION = re.compile(r"```(.*?)```", re.DOTALL)


def extract_action(reply: str, reply_format: str = "react") -> str:
    """The action a reply names, for people to read ("" when it names none): the ReAct ``Action:``
    line, for tagged replies (``reply_format="tags"``) the first ``<search>``/``<answer>`` tag, for
    fenced ones (``"backticks"``, WebArena's) the text in the first ``` ``` pair (less a language tag)."""
    if reply_format == "tags":
        match = TAGGED_ACTION.search(reply)
        return f"{match.group(1)}: {match.group(2).strip()}" if match else ""
    if reply_format == "backticks":
        match = FENCED_ACTION.search(reply)
        if match is None:
            return ""
        first, _, rest = match.group(1).strip().partition("\n")
        return rest.strip() if rest.strip() and first.strip().isidentifier() else match.group(1).strip()
    return extract_react_action(reply) or ""


def as_reply(text: str, reply_format: str = "react") -> str:
    """A step's action as the whole reply an environment parses.

    AgentGym's clients send the bare action (``turn left``); horizonrl's environments read the
    action after ``Action:`` in the model's reply. Text with no ``Action:`` is taken as the action
    itself, so a valid bare action is applied and an invalid one gets the environment's "invalid
    action" answer (not its "invalid format" one). Environments whose replies are not ReAct
    (SearchQA's tags) get the text unchanged.
    """
    if reply_format != "react" or extract_react_action(text) is not None:
        return text
    return f"Action: {text.strip()}"


EnvFactory = Callable[[str, dict[str, Any] | None], Environment]
"""``make_env(name, settings) -> Environment``: how an actor gets environments."""
