"""Tool calls in and out of the model's text: parsed from a completion, written into a prompt.

A model asks for a tool by writing it in its reply; the chat template's convention says how. Two
conventions are read:

- ``hermes`` (Qwen2.5, Qwen3, Hermes, and the endpoint's own prompt for templates that cannot render
  tools): each call is a JSON object ``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and
  ``</tool_call>``; text outside the blocks is the message's content.
- ``llama3_json`` (Llama 3.1/3.2's JSON tool calling): the reply is one JSON object ``{"name": ...,
  "parameters": {...}}`` (``arguments`` also read), or several separated by ``;``.

A reply that tries to call a tool and fails to parse (a ``<tool_call>`` block that is not a JSON object with a
string ``name`` and an object of arguments; a reply that starts a JSON object but is not the llama3 shape) is a
*parse failure*: the agent gets the whole reply as plain content, and the endpoint counts it. The tokens stay in
the trajectory as generated either way: parsing only decides what the agent is shown.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

TOOL_CALL_FORMATS = ("hermes", "llama3_json")

_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict  # the parsed JSON object (the wire carries it as a JSON string)

    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass(frozen=True)
class ParsedReply:
    """What the agent is shown of one completion: ``content`` (None when the reply is only tool calls, as
    OpenAI's API answers) and ``tool_calls``; ``parse_error`` says why a reply that tried to call a tool is
    shown as plain content instead ("" when it did not try, or parsed)."""

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)
    parse_error: str = ""


def parse_reply(text: str, tool_format: str, tools_allowed: bool = True) -> ParsedReply:
    """Split a completion's text into content and tool calls (``tools_allowed`` False: the request has no tools,
    or ``tool_choice`` is ``none``: the text is content, whatever it holds)."""
    if not tools_allowed:
        return ParsedReply(text)
    if tool_format == "hermes":
        return _parse_hermes(text)
    if tool_format == "llama3_json":
        return _parse_llama3_json(text)
    raise ValueError(f"unknown tool call format {tool_format!r}; one of {TOOL_CALL_FORMATS}")


def _parse_hermes(text: str) -> ParsedReply:
    blocks = list(_HERMES_BLOCK.finditer(text))
    if not blocks:
        return ParsedReply(text)
    calls = []
    for block in blocks:
        call, problem = _call_of(block.group(1).strip(), "arguments")
        if call is None:
            return ParsedReply(text, parse_error=f"<tool_call> block {len(calls) + 1}: {problem}")
        calls.append(call)
    content = _HERMES_BLOCK.sub("", text).strip()
    return ParsedReply(content or None, calls)


def _parse_llama3_json(text: str) -> ParsedReply:
    stripped = text.strip()
    if not stripped.startswith("{"):
        return ParsedReply(text)
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(stripped):
        try:
            obj, end = decoder.raw_decode(stripped, at)
        except ValueError as error:
            return ParsedReply(text, parse_error=f"not JSON at character {at}: {error}")
        call, problem = _call_of(obj, "parameters")
        if call is None:
            return ParsedReply(text, parse_error=problem)
        calls.append(call)
        at = end
        while at < len(stripped) and stripped[at] in " \t\r\n;":
            at += 1
    return ParsedReply(None, calls)


def _call_of(body: str | object, arguments_key: str) -> tuple[ToolCall | None, str]:
    """One call from a JSON text (or an already decoded object): ``name`` and an object of arguments under
    ``arguments_key`` or ``arguments`` (a JSON string of an object is accepted too)."""
    if isinstance(body, str):
        try:
            body = json.loads(body)
        except ValueError as error:
            return None, f"not JSON ({error})"
    if not isinstance(body, dict) or not isinstance(body.get("name"), str) or not body["name"]:
        return None, "not a JSON object with a string \"name\""
    arguments = body.get(arguments_key, body.get("arguments", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None, f"the arguments of {body['name']!r} are a string that is not JSON"
    if not isinstance(arguments, dict):
        return None, f"the arguments of {body['name']!r} are not a JSON object"
    return ToolCall(body["name"], arguments), ""


# ------------------------------------------------------------------ the endpoint's own tool prompt (hermes)

def hermes_tools_text(tools: list[dict]) -> str:
    """The system text that describes ``tools`` (OpenAI function specs) to a model whose chat template cannot
    render them, in the hermes convention the reply is then parsed with."""
    specs = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return ("# Tools\n\nYou can call the functions below. Their signatures are listed inside <tools></tools>:\n"
            f"<tools>\n{specs}\n</tools>\n\nTo call one, write a JSON object with its name and arguments inside "
            "<tool_call></tool_call> tags:\n<tool_call>\n{\"name\": <function name>, \"arguments\": "
            "<arguments as a JSON object>}\n</tool_call>")


def hermes_call_text(name: str, arguments: dict) -> str:
    """An assistant's tool call written as the model writes it (for history the template cannot render)."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def hermes_response_text(content: str) -> str:
    """A tool's result as the hermes convention hands it back to the model (in a user turn)."""
    return f"<tool_response>\n{content}\n</tool_response>"
