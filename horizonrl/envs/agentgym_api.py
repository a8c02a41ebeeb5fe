"""What AgentGym's environment servers (``agentenv-*``) accept and answer, environment by environment.

AgentGym's own clients (``agentenv.envs.BabyAIEnvClient`` and its siblings) differ in small ways
that matter on the wire; this module names each difference once, for both directions:

- ``horizonrl env serve`` answers AgentGym clients at ``/<env>/create|reset|step|observation|close``
  exactly as that environment's AgentGym server would (``server.py`` uses :data:`DIALECTS`);
- ``HTTPEnv(protocol="agentgym")`` talks to AgentGym's own servers (``client.py`` uses the same
  table and :func:`agentgym_action`).

What the clients send (read from agentenv's client code):

- BabyAI and SciWorld: ``POST /create`` with no body; ``/reset {"id", "data_idx"}``;
  ``/step {"id", "action"}`` with the *bare* action: the text after the first ``Action:`` of the
  reply, stripped (the whole reply when it has none).
- TextCraft: ``/create {"minecraft_dir", "commands", "goal"}`` and it reads ``observation`` from
  the answer; the action is the text after ``Action:`` up to the line's end with every character
  but letters, digits, commas and spaces removed (``""`` when there is no ``Action:``), and
  ``look`` becomes ``inventory``; ``/close {"id"}``.
- SearchQA: ``/create {"id": 0}`` answered by the bare session id (an integer); the session is
  named ``env_idx`` in every later body (``/reset {"env_idx", "id": task}``, ``/step {"env_idx",
  "action"}`` with the whole reply, ``/close {"env_idx"}``) and ``GET /observation?env_idx=``;
  ``/reset`` and ``/observation`` answer a bare string.
- WebArena: ``POST /create`` with no body, answered ``{"env_idx": id}``; the session is named ``env_idx``
  in every later body (``/reset {"env_idx", "seed": 0, "idx": task}``, ``/step {"env_idx", "action"}``
  with the whole reply, ``/close {"env_idx"}``) and ``GET /observation?env_idx=``; ``/reset`` answers
  ``{"observation"}``, ``/observation`` a bare string, ``/step`` ``{"observation", "reward",
  "terminated", "truncated", "info"}`` (no ``done``).

What they read: ``id`` (create; WebArena's ``env_idx``), ``observation``, ``reward``, ``score`` (BabyAI
and SciWorld use ``score`` as the reward), ``done`` (WebArena's ``terminated``); SciWorld's reset also
``task_description`` (the client shows ``task_description + "\\n" + observation``).
AgentGym's servers answer every failure with HTTP 200 and ``{"error": message}``; its clients assert status 200.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from horizonrl.core.environment import as_reply  # noqa: F401 - the bottom layer's now (the endpoint uses it too)


@dataclass(frozen=True)
class Dialect:
    """How one AgentGym environment server names things and shapes its answers."""

    session_key: str = "id"                 # the body / query key that names the session
    task_key: str = "data_idx"              # the reset body key that names the task
    create_body: dict | None = None         # what the client posts to /create (None: no body)
    create_answers_bare_id: bool = False    # /create answers the id itself, not {"id": ...}
    create_answer_key: str = "id"           # the key of the session id in /create's answer
    create_starts_episode: bool = False     # /create starts an episode and answers its observation
    reset_answers_bare_text: bool = False   # /reset answers the observation string
    observation_answers_bare_text: bool = False  # GET /observation answers the observation string
    reset_extra: dict | None = None         # more keys the client sends in /reset's body (WebArena's seed)
    reset_splits_task: bool = False         # /reset answers task_description apart from observation
    action: str = "first_action"            # how the client cuts the action out of a reply
    score_in_points: bool = False           # reward and score on a 0-100 scale (ScienceWorld's)


DIALECTS: dict[str, Dialect] = {
    "babyai": Dialect(),
    "sciworld": Dialect(reset_splits_task=True, score_in_points=True),
    "textcraft": Dialect(create_body={"minecraft_dir": "agentenv_textcraft/", "commands": None, "goal": None},
                         create_starts_episode=True, action="textcraft"),
    "searchqa": Dialect(session_key="env_idx", task_key="id", create_body={"id": 0}, create_answers_bare_id=True,
                        reset_answers_bare_text=True, observation_answers_bare_text=True, action="whole_reply"),
    "webarena": Dialect(session_key="env_idx", task_key="idx", create_answer_key="env_idx",
                        observation_answers_bare_text=True, reset_extra={"seed": 0}, action="whole_reply"),
}
# AgentGym's names for the session and the task beside horizonrl's, accepted on the root routes.
SESSION_KEYS = ("id", "env_idx")
TASK_KEYS = ("data_idx", "task_id", "idx")
DEFAULT_DIALECT = Dialect()


def dialect(env_name: str | None) -> Dialect:
    return DIALECTS.get(env_name or "", DEFAULT_DIALECT)


_TEXTCRAFT_ACTION = re.compile(r"Action:\s*(.*?)(?=\n|$)", re.DOTALL)


def agentgym_action(env_name: str | None, reply: str) -> str:
    """The action AgentGym's client for ``env_name`` would send for the model's ``reply``."""
    how = dialect(env_name).action
    if how == "whole_reply":
        return reply
    if how == "textcraft":
        found = _TEXTCRAFT_ACTION.findall(reply)
        action = re.sub(r"[^A-Za-z0-9, ]+", "", found[-1] if found else "")
        action = " ".join(action.split())
        return "inventory" if action.lower() == "look" else action
    if reply.endswith("</s>"):
        reply = reply[:-len("</s>")]
    parts = reply.split("Action:")
    return (parts[1] if len(parts) > 1 else parts[0]).strip()
