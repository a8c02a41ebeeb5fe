"""The OpenAI chat API's requests and answers, as far as the endpoint takes and gives them.

:func:`parse_chat_request` turns a request body into a :class:`ChatRequest` or raises :class:`RequestError`
(HTTP 4xx, OpenAI's error shape, a message that says what to fix). Sampling settings that would change the
distribution the learner trains against without the learner knowing (penalties, biases, constrained outputs)
are refused rather than ignored; settings that do not (``seed``, ``user``, ``metadata``, ``store``,
``parallel_tool_calls``, ``stream_options``) are accepted and ignored.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from horizonrl.actors.openai_endpoint.tool_calls import ToolCall

MAX_N = 16
MAX_STOP = 4
ROLES = ("system", "developer", "user", "assistant", "tool")


class RequestError(Exception):
    """A request the endpoint refuses: ``status`` (4xx, or 503 when busy), OpenAI's ``type`` and ``code``."""

    def __init__(self, status: int, message: str, code: str = "invalid_request", param: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.kind = status, message, code, param, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ChatMessage:
    """One message, normalized: ``content`` is text ("" for none); ``developer`` is read as ``system``.
    Equality is what "the agent sent back what it was given" means: the ids of tool calls do not count."""

    role: str
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None
    tool_call_ids: tuple[str, ...] = field(default=(), compare=False)

    def for_template(self) -> dict[str, Any]:
        """The message as Hugging Face chat templates take it (tool-call arguments as objects)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            ids = self.tool_call_ids or tuple(f"call_{i}" for i in range(len(self.tool_calls)))
            out["tool_calls"] = [{"id": i, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                 for i, c in zip(ids, self.tool_calls)]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


@dataclass(frozen=True)
class ChatRequest:
    messages: tuple[ChatMessage, ...]
    model: str = ""
    tools: tuple[dict, ...] = ()  # OpenAI function specs, as sent
    tool_choice: str = "auto"  # none | auto | required | the name of the one function to call
    n: int = 1
    temperature: float | None = None  # None: the endpoint's default
    top_p: float | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    logprobs: bool = False
    return_token_ids: bool = False  # vLLM's extension: the prompt's and each choice's token ids in the answer

    @property
    def tools_allowed(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


def parse_json_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as error:
        raise RequestError(400, f"the body is not JSON: {error}", "invalid_json") from None
    if not isinstance(body, dict):
        raise RequestError(400, "the body must be a JSON object", "invalid_json")
    return body


def parse_chat_request(body: dict[str, Any]) -> ChatRequest:
    """A ``/v1/chat/completions`` body as a :class:`ChatRequest`; :class:`RequestError` (400) says what is wrong."""
    _refuse_unsupported(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "messages must be a non-empty list of {role, content} objects", param="messages")
    tools = _tools(body.get("tools"))
    model = body.get("model", "")
    if not isinstance(model, str):
        raise RequestError(400, "model must be a string", param="model")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    return ChatRequest(
        messages=tuple(_message(m, i) for i, m in enumerate(messages)),
        model=model,
        tools=tools,
        tool_choice=_tool_choice(body.get("tool_choice"), tools),
        n=_int(body, "n", 1, 1, MAX_N),
        temperature=_number(body, "temperature", 0.0, 2.0),
        top_p=_number(body, "top_p", 0.0, 1.0, low_open=True),
        max_tokens=None if max_tokens is None else _int({"max_tokens": max_tokens}, "max_tokens", None, 1, None),
        stop=_stop(body.get("stop")),
        stream=_bool(body, "stream"),
        logprobs=_bool(body, "logprobs"),
        return_token_ids=_bool(body, "return_token_ids"),
    )


def _refuse_unsupported(body: dict[str, Any]) -> None:
    for key in ("frequency_penalty", "presence_penalty"):
        if body.get(key) not in (None, 0, 0.0):
            raise RequestError(400, f"{key} is not supported: the learner trains against the model's own "
                                    "distribution, which a penalty would change", param=key)
    if body.get("logit_bias"):
        raise RequestError(400, "logit_bias is not supported (it changes the sampled distribution)", param="logit_bias")
    if body.get("top_logprobs") not in (None, 0):
        raise RequestError(400, "top_logprobs is not supported: logprobs=true returns the sampled tokens' logprobs",
                           param="top_logprobs")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise RequestError(400, "response_format other than {\"type\": \"text\"} is not supported (no constrained "
                                "decoding)", param="response_format")
    if "functions" in body or "function_call" in body:
        raise RequestError(400, "the legacy functions/function_call fields are not supported; use tools and "
                                "tool_choice", param="functions")


def _message(raw: Any, index: int) -> ChatMessage:
    where = f"messages[{index}]"
    if not isinstance(raw, dict):
        raise RequestError(400, f"{where} must be an object", param=where)
    role = raw.get("role")
    if role not in ROLES:
        raise RequestError(400, f"{where}.role must be one of {list(ROLES)}, not {role!r}", param=f"{where}.role")
    content = _content(raw.get("content"), where)
    calls, ids = _assistant_calls(raw.get("tool_calls"), where) if role == "assistant" else ((), ())
    if role != "assistant" and raw.get("tool_calls"):
        raise RequestError(400, f"{where}: only assistant messages carry tool_calls", param=f"{where}.tool_calls")
    tool_call_id = raw.get("tool_call_id")
    if role == "tool" and not isinstance(tool_call_id, str):
        raise RequestError(400, f"{where}: a tool message needs the tool_call_id it answers",
                           param=f"{where}.tool_call_id")
    name = raw.get("name")
    if name is not None and not isinstance(name, str):
        raise RequestError(400, f"{where}.name must be a string", param=f"{where}.name")
    return ChatMessage("system" if role == "developer" else role, content, calls,
                       tool_call_id if role == "tool" else None, name, ids)


def _content(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(400, f"{where}.content: only text parts are supported ({{\"type\": \"text\", "
                                        "\"text\": ...}})", param=f"{where}.content")
            texts.append(part["text"])
        return "".join(texts)
    raise RequestError(400, f"{where}.content must be a string or a list of text parts", param=f"{where}.content")


def _assistant_calls(raw: Any, where: str) -> tuple[tuple[ToolCall, ...], tuple[str, ...]]:
    if raw is None:
        return (), ()
    if not isinstance(raw, list):
        raise RequestError(400, f"{where}.tool_calls must be a list", param=f"{where}.tool_calls")
    calls, ids = [], []
    for i, call in enumerate(raw):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError(400, f"{where}.tool_calls[{i}] must be {{\"type\": \"function\", \"function\": "
                                    "{\"name\", \"arguments\"}}", param=f"{where}.tool_calls")
        arguments = fn.get("arguments", "{}")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            raise RequestError(400, f"{where}.tool_calls[{i}].function.arguments is not JSON",
                               param=f"{where}.tool_calls") from None
        if not isinstance(arguments, dict):
            raise RequestError(400, f"{where}.tool_calls[{i}].function.arguments must be a JSON object",
                               param=f"{where}.tool_calls")
        calls.append(ToolCall(fn["name"], arguments))
        ids.append(str(call.get("id", f"call_{i}")))
    return tuple(calls), tuple(ids)


def _tools(raw: Any) -> tuple[dict, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise RequestError(400, "tools must be a list of {\"type\": \"function\", \"function\": {...}}", param="tools")
    names = set()
    for i, tool in enumerate(raw):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise RequestError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\", "
                                    "\"parameters\"}}}}", param=f"tools[{i}]")
        name = fn.get("name")
        if not isinstance(name, str) or not name or name in names:
            raise RequestError(400, f"tools[{i}].function.name must be a non-empty string, unique among the tools",
                               param=f"tools[{i}].function.name")
        if not isinstance(fn.get("parameters", {}), dict) or not isinstance(fn.get("description", ""), str):
            raise RequestError(400, f"tools[{i}].function: parameters must be a JSON schema object and description "
                                    "a string", param=f"tools[{i}].function")
        names.add(name)
    return tuple(raw)


def _tool_choice(raw: Any, tools: tuple[dict, ...]) -> str:
    if raw is None:
        return "auto" if tools else "none"
    if raw in ("none", "auto", "required"):
        if raw == "required" and not tools:
            raise RequestError(400, "tool_choice \"required\" needs tools", param="tool_choice")
        return raw
    name = raw.get("function", {}).get("name") if isinstance(raw, dict) else None
    if not isinstance(name, str) or name not in {t["function"]["name"] for t in tools}:
        raise RequestError(400, "tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": "
                                "{\"name\": one of the tools}}", param="tool_choice")
    return name


def _stop(raw: Any) -> tuple[str, ...]:
    stops = [raw] if isinstance(raw, str) else raw
    if stops is None:
        return ()
    if not isinstance(stops, list) or len(stops) > MAX_STOP or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(400, f"stop must be a non-empty string or a list of at most {MAX_STOP}", param="stop")
    return tuple(stops)


def _int(body: dict, key: str, default: int | None, low: int, high: int | None) -> int | None:
    value = body.get(key, default)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
        span = f"{low}..{high}" if high is not None else f">= {low}"
        raise RequestError(400, f"{key} must be an integer {span}, not {value!r}", param=key)
    return value


def _number(body: dict, key: str, low: float, high: float, low_open: bool = False) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value > high or value < low or (low_open and value == low):
        raise RequestError(400, f"{key} must be a number in {'(' if low_open else '['}{low}, {high}], not {value!r}",
                           param=key)
    return float(value)


def _bool(body: dict, key: str) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(400, f"{key} must be true or false", param=key)
    return value
