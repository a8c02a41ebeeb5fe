"""A BabyAI agent written against the ``openai`` client only: it keeps its own history, offers the model two tools
(``look``, ``act``) and loops until the room says the episode is over.

It knows nothing of horizonrl. ``horizonrl train configs/agent_babyai.yaml`` runs it once per training episode
with these environment variables (docs/agents.md):

- ``OPENAI_BASE_URL``, ``OPENAI_API_KEY``: read by the ``openai`` client itself; they name this episode's session of
  the trainer's OpenAI-compatible endpoint;
- ``HORIZONRL_SESSION_URL``: the session's own routes, here its environment (``GET /env/observation``,
  ``POST /env/step``) and ``POST /close``. The environment scores the episode, so the agent reports no reward.

The model may call a tool (``<tool_call>`` JSON, parsed by the endpoint into ``tool_calls``) or answer in ReAct
text (``Thought: ... Action: turn left``); the agent takes the text's action as an ``act`` call, as ReAct agents
do. The trainer's turn budget caps its model calls: when it is spent the endpoint answers HTTP 400
(``turn_budget_exhausted``) and the agent stops.
"""

from __future__ import annotations

import json
import os
import re
import sys
import urllib.request

import openai

SESSION = os.environ["HORIZONRL_SESSION_URL"]
KEY = os.environ.get("OPENAI_API_KEY", "")
TOOLS = [
    {"type": "function", "function": {"name": "look", "description": "What you see now, and the actions you can take.",
                                      "parameters": {"type": "object", "properties": {}}}},
    {"type": "function", "function": {"name": "act", "description": "Take one of the listed actions.",
                                      "parameters": {"type": "object",
                                                     "properties": {"action": {"type": "string"}},
                                                     "required": ["action"]}}},
]
EPISODE_OVER = ("turn_budget_exhausted", "context_length_exceeded", "episode_over")


def session(method: str, path: str, body: dict | None = None) -> dict:
    request = urllib.request.Request(SESSION + path, method=method, data=None if body is None else json.dumps(
        body).encode(), headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def run_tool(name: str, arguments: dict) -> tuple[str, bool]:
    """A tool's answer for the model, and whether the episode is over."""
    if name == "look":
        return session("GET", "/env/observation")["observation"], False
    if name == "act":
        step = session("POST", "/env/step", {"action": str(arguments.get("action", ""))})
        return step["observation"], step["done"]
    return f"There is no tool {name!r}; use look or act.", False


def react_action(text: str) -> str:
    found = re.findall(r"Action:\s*(.+)", text)
    return found[-1].strip() if found else text.strip()


def main() -> int:
    client = openai.OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY come from the environment
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": session("GET", "/env/observation")["observation"]}]
    done = False
    while not done:
        try:
            reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS)
        except openai.BadRequestError as error:
            if (error.code or "") in EPISODE_OVER:
                break
            raise
        message = reply.choices[0].message
        messages.append(message)
        if message.tool_calls:
            for call in message.tool_calls:
                result, done = run_tool(call.function.name, json.loads(call.function.arguments or "{}"))
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
                if done:
                    break
        else:
            result, done = run_tool("act", {"action": react_action(message.content or "")})
            messages.append({"role": "user", "content": result})
    session("POST", "/close")
    return 0


if __name__ == "__main__":
    sys.exit(main())
