"""The endpoint over HTTP (aiohttp): OpenAI's chat API, one session per episode.

Routes (``{sid}`` is a session id; a session is named by its base URL or by the ``X-Session-Id`` header):

- ``GET /v1/models`` (and ``/sessions/{sid}/v1/models``): the one served model;
- ``POST /v1/chat/completions`` with ``X-Session-Id``, or ``POST /sessions/{sid}/v1/chat/completions``:
  OpenAI's chat completion (``tools``/``tool_choice``, ``n``, ``temperature``, ``top_p``, ``max_tokens``,
  ``stop``, ``logprobs``, ``stream``; ``return_token_ids`` adds the prompt's and each choice's token ids, as
  vLLM does). ``stream: true`` answers server-sent events, the whole reply in one chunk once it is generated;
  ``system_fingerprint`` names the weights (``horizonrl-e<epoch>-v<version>``) that started the call;
- ``POST /v1/sessions {"task_id"?, "env"?}`` opens a session (the standalone endpoint only; in training the
  actor opens one per episode it hands to an agent) -> ``{"id", "base_url", "observation"?}``;
- ``POST /sessions/{sid}/reward {"reward", "success"?, "score"?}``: the agent's verdict (sessions without an
  environment);
- ``GET /sessions/{sid}/env/observation``, ``POST /sessions/{sid}/env/step {"action"}``: the session's project
  environment, which verifies the outcome itself (its rewards are the episode's);
- ``POST /sessions/{sid}/close`` (or ``DELETE /sessions/{sid}``): ends the episode -> its summary; a body
  ``{"reward", ...}`` sets the agent's reward first;
- ``GET /health``: open sessions and the endpoint's counters (no key needed).

Errors are OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with real status codes: 400 a
request to change (malformed JSON or fields, a template that cannot render it, a spent turn budget:
``turn_budget_exhausted``, a full context: ``context_length_exceeded``, a finished episode: ``episode_over``),
401 a missing or wrong key, 404 an unknown session, 413 a body over ``max_body_bytes``, 5xx an engine or
environment failure. One handler at the boundary answers every error; the server keeps serving.

A key (``api_key``) is required from every client when it is set, and it must be set when the endpoint binds
an address other than loopback (:func:`check_binding`).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import time
from typing import Any

from aiohttp import web

from horizonrl.actors.openai_endpoint.endpoint import AgentEndpoint, CallResult
from horizonrl.actors.openai_endpoint.session import Choice
from horizonrl.actors.openai_endpoint.wire import RequestError, parse_chat_request, parse_json_body
from horizonrl.core.environment import as_reply
from horizonrl.protocol import FAILURE_ENVIRONMENT

log = logging.getLogger("horizonrl.actors.openai_endpoint")

SESSION_HEADER = "X-Session-Id"
DEFAULT_MAX_BODY_BYTES = 4 << 20


def check_binding(host: str, api_key: str | None) -> None:
    """Refuse to serve beyond loopback without a key (the endpoint spends the engine and writes training data)."""
    if not api_key and not is_loopback(host):
        raise ValueError(f"the OpenAI endpoint binds {host!r}, which is not loopback: set its api key "
                         "(HORIZONRL_ENDPOINT_KEY or endpoint.api_key_file) so that only your agents can use it")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class EndpointApp:
    """The aiohttp application of an :class:`AgentEndpoint` (see the module docstring)."""

    def __init__(self, endpoint: AgentEndpoint, *, api_key: str | None = None, public_url: str = "",
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, open_sessions: bool = False,
                 make_env: Any = None) -> None:
        self.endpoint = endpoint
        self.api_key = api_key or None
        self.public_url = public_url.rstrip("/")  # set once the port is bound (base URLs handed to agents)
        self.max_body_bytes = max_body_bytes
        self.open_sessions = open_sessions
        self.make_env = make_env  # (name, task_id) -> (env, first observation), for POST /v1/sessions with "env"

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[self._errors, self._auth])
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/sessions/{sid}/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/sessions/{sid}/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/sessions", self.open)
        app.router.add_post("/sessions/{sid}/reward", self.reward)
        app.router.add_get("/sessions/{sid}/env/observation", self.env_observation)
        app.router.add_post("/sessions/{sid}/env/step", self.env_step)
        app.router.add_post("/sessions/{sid}/close", self.close)
        app.router.add_delete("/sessions/{sid}", self.close)
        return app

    def base_url(self, session_id: str) -> str:
        return f"{self.public_url}/sessions/{session_id}/v1"

    # ---------------------------------------------------------------- boundary

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except RequestError as error:
            return web.json_response(error.body(), status=error.status)
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"the request body is over {self.max_body_bytes} bytes", "request_too_large")
        except web.HTTPException as error:
            return _error(error.status, f"{request.method} {request.path}: {error.reason}", "http_error")
        except Exception as error:  # one handler at the boundary: log it, answer 500, keep serving
            log.exception("unexpected error in %s %s", request.method, request.path)
            return _error(500, f"internal error: {type(error).__name__}", "internal_error", "server_error")

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if self.api_key is not None and request.path != "/health":
            given = request.headers.get("Authorization", "")
            token = given[len("Bearer "):] if given.startswith("Bearer ") else ""
            if not hmac.compare_digest(token.encode(), self.api_key.encode()):
                raise RequestError(401, "a valid key is required: Authorization: Bearer <key> (OPENAI_API_KEY)",
                                   "invalid_api_key")
        return await handler(request)

    # ---------------------------------------------------------------- routes

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "sessions": len(self.endpoint.sessions),
                                  "stats": self.endpoint.stats.as_dict()})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.endpoint.settings.model_name, "object": "model", "created": 0, "owned_by": "horizonrl"}]})

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        session = self.endpoint.session(request.match_info.get("sid") or request.headers.get(SESSION_HEADER))
        chat = parse_chat_request(parse_json_body(await request.read()))
        result = await self.endpoint.complete(session, chat)
        answer = completion_body(result, self.endpoint.settings.model_name, self.endpoint.chat,
                                 chat.logprobs, chat.return_token_ids)
        if chat.stream:
            return await _stream(request, answer)
        return web.json_response(answer)

    async def open(self, request: web.Request) -> web.Response:
        if not self.open_sessions:
            raise RequestError(403, "sessions are opened by the trainer, one per episode it hands to an agent "
                                    "(the agent gets its base URL)", "sessions_closed_to_clients")
        body = parse_json_body(await request.read()) if request.can_read_body else {}
        task_id = body.get("task_id", 0)
        if not isinstance(task_id, int) or isinstance(task_id, bool) or task_id < 0:
            raise RequestError(400, "task_id must be a non-negative integer", param="task_id")
        env_name, env, observation = body.get("env"), None, None
        if env_name is not None:
            if self.make_env is None or not isinstance(env_name, str):
                raise RequestError(400, "this endpoint serves no environments; open a session without \"env\"",
                                   param="env")
            env, observation = await self.make_env(env_name, task_id)
        session = self.endpoint.open_session(env=env, env_name=env_name or "agent", task_id=task_id,
                                             first_observation=observation)
        answer = {"id": session.session_id, "base_url": self.base_url(session.session_id)}
        if observation is not None:
            answer["observation"] = observation
        return web.json_response(answer)

    async def reward(self, request: web.Request) -> web.Response:
        session = self.endpoint.session(request.match_info["sid"])
        _set_reward(session, parse_json_body(await request.read()))
        return web.json_response({"ok": True})

    async def env_observation(self, request: web.Request) -> web.Response:
        session = self._with_env(request.match_info["sid"])
        return web.json_response({"observation": session.last_env_observation or ""})

    async def env_step(self, request: web.Request) -> web.Response:
        session = self._with_env(request.match_info["sid"])
        body = parse_json_body(await request.read())
        action = body.get("action")
        if not isinstance(action, str):
            raise RequestError(400, "the body is {\"action\": string}", param="action")
        if session.env_done:
            raise RequestError(400, "the episode is over: its environment said done", "episode_over")
        async with session.lock:
            try:
                result = await session.env.step(as_reply(action, getattr(session.env, "reply_format", "react")))
            except Exception as error:  # noqa: BLE001 - the environment failed, not the agent
                session.failure, session.failure_message = FAILURE_ENVIRONMENT, f"{type(error).__name__}: {error}"
                raise RequestError(502, f"the environment failed: {type(error).__name__}", "environment_failure",
                                   kind="server_error") from None
            session.add_env_reward(float(result.reward), result.done, bool(result.success), float(result.score),
                                   bool((result.info or {}).get("invalid_action")))
            session.last_env_observation = result.observation
        return web.json_response({"observation": result.observation, "reward": result.reward, "done": result.done,
                                  "success": result.success})

    async def close(self, request: web.Request) -> web.Response:
        """Ends the episode; a body ``{"reward", ...}`` sets the agent's reward first (as ``.../reward``)."""
        raw = await request.read()
        body = parse_json_body(raw) if raw.strip() else {}
        if "reward" in body:
            _set_reward(self.endpoint.session(request.match_info["sid"]), body)
        episode = await self.endpoint.close(request.match_info["sid"])
        return web.json_response({"closed": True, "turns": episode.num_turns, "samples": len(episode.sample_starts)
                                  + 1, "tokens": len(episode.token_ids), "reward": episode.reward,
                                  "success": episode.success, "stop_reason": episode.stop_reason,
                                  "failure": episode.failure})

    def _with_env(self, session_id: str):
        session = self.endpoint.session(session_id)
        if session.env is None:
            raise RequestError(404, "this session has no environment", "no_environment")
        return session


# -------------------------------------------------------------------- answers

def completion_body(result: CallResult, model: str, chat, logprobs: bool, token_ids: bool) -> dict[str, Any]:
    """The ``chat.completion`` object of one call."""
    epoch, version = result.weights
    body: dict[str, Any] = {
        "id": f"chatcmpl-{result.session.session_id}-{result.call_index}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": f"horizonrl-e{epoch}-v{version}",
        "choices": [_choice_body(j, c, chat, logprobs, token_ids) for j, c in enumerate(result.choices)],
        "usage": {"prompt_tokens": len(result.plan.prompt_ids),
                  "completion_tokens": sum(len(c.ids) for c in result.choices),
                  "total_tokens": len(result.plan.prompt_ids) + sum(len(c.ids) for c in result.choices)},
    }
    if token_ids:
        body["prompt_token_ids"] = result.plan.prompt_ids
    return body


def _choice_body(index: int, choice: Choice, chat, logprobs: bool, token_ids: bool) -> dict[str, Any]:
    message = choice.message
    out: dict[str, Any] = {"role": "assistant", "content": message.content or (None if message.tool_calls else "")}
    if message.tool_calls:
        out["tool_calls"] = [{"id": i, "type": "function",
                              "function": {"name": c.name, "arguments": c.arguments_json()}}
                             for i, c in zip(choice.tool_call_ids, message.tool_calls)]
    body: dict[str, Any] = {"index": index, "message": out, "finish_reason": choice.finish_reason,
                            "logprobs": _logprobs_body(choice, chat) if logprobs else None}
    if token_ids:
        body["token_ids"] = choice.ids
    return body


def _logprobs_body(choice: Choice, chat) -> dict[str, Any]:
    pieces = [chat.decode([i], skip_special_tokens=False) for i in choice.ids]
    return {"content": [{"token": p, "logprob": lp, "bytes": list(p.encode()), "top_logprobs": []}
                        for p, lp in zip(pieces, choice.logprobs)]}


async def _stream(request: web.Request, answer: dict[str, Any]) -> web.StreamResponse:
    """The answer as server-sent events: per choice one chunk with the whole message, then one with its
    finish reason, then ``[DONE]`` (the reply is streamed once generated, not token by token)."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    head = {k: answer[k] for k in ("id", "created", "model", "system_fingerprint")}
    for choice in answer["choices"]:
        delta = dict(choice["message"])
        if "tool_calls" in delta:
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(delta["tool_calls"])]
        for piece in ({"index": choice["index"], "delta": delta, "logprobs": choice["logprobs"], "finish_reason": None},
                      {"index": choice["index"], "delta": {}, "finish_reason": choice["finish_reason"]}):
            chunk = {**head, "object": "chat.completion.chunk", "choices": [piece]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def _error(status: int, message: str, code: str, kind: str = "invalid_request_error") -> web.Response:
    return web.json_response(RequestError(status, message, code, kind=kind).body(), status=status)


def _set_reward(session, body: dict[str, Any]) -> None:
    reward, success, score = body.get("reward"), body.get("success"), body.get("score")
    if not _finite(reward) or (success is not None and not isinstance(success, bool)) or (
            score is not None and not _finite(score)):
        raise RequestError(400, "the body is {\"reward\": number, \"success\"?: bool, \"score\"?: number}")
    if session.env is not None:
        raise RequestError(409, "this session's reward comes from its environment", "reward_from_environment")
    session.set_agent_reward(float(reward), success, None if score is None else float(score))


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value and abs(value) != float(
        "inf")
