"""HTTP environment server (aiohttp): any registered environment, one session per episode stream.

Endpoints (AgentGym's, plus /health and two for the client's metadata):

- ``POST /create {"env"?: name}`` -> ``{"id": int}`` (``env`` may be left out when one is served)
- ``POST /reset {"id", "data_idx"}`` -> ``{"observation", "reward": 0, "score": 0, "done": false}``.
  AgentGym's names are accepted beside these: the session as ``env_idx`` (when there is no ``id``),
  the task as ``task_id`` or ``idx`` (WebArena's client sends ``{"env_idx", "seed", "idx"}``)
- ``POST /step {"id", "action", "whole_reply"?}`` -> ``{"observation", "reward", "score", "done",
  "terminated", "truncated", "success", "info"}`` (``terminated`` = ``done``, ``truncated`` false:
  WebArena's names). ``action`` is the model's whole reply or, as AgentGym's clients send it,
  the bare action (``turn left``); ``whole_reply: true`` (horizonrl's client) asks for the reply's
  format to be checked exactly as in-process, so a reply without ``Action:`` is "invalid format".
- ``GET /observation?id=`` (or ``?env_idx=``) -> ``{"observation"}`` (the last one)
- ``POST /close {"id"}`` -> ``{"closed": true}``; closing a closed session again is not an error
- ``GET /health`` -> ``{"status": "ok", "envs", "sessions", "reaped", "rss_bytes"}``
- ``GET /tasks?env=`` -> ``{"train": [...], "test": [...], "categories": {...}}``
- ``GET /random_action?id=&seed=`` -> ``{"action"}``

``/<env>/create|reset|step|observation|close`` serve AgentGym's clients for ``<env>``, with the
bodies they send and the answers they read (``agentgym_api.DIALECTS``: TextCraft's create starts
an episode, SearchQA and WebArena name the session ``env_idx``, SearchQA answers bare values, ...), so one process
hosts several environments, each at its own base URL ``http://HOST:PORT/<env>``. The root routes
add the same dictionary fields (TextCraft's create ``observation``, SciWorld's reset
``task_description``) so that an AgentGym client works there too when one environment is served.

Errors use real status codes with ``{"error": message, "kind": ...}``: 400 malformed request or
bad task id, 404 unknown session or route, 409 step before reset, 413 body over
``max_body_bytes``, 503 session limit reached, 500 environment failure. With ``agentgym_errors``
(``serve --agentgym-errors``) every error is HTTP 200 with the same body instead, as AgentGym's
servers answer (for old clients that expect it). Environment code runs off the event loop (every
environment's blocking work goes through ``run_blocking``), requests on one session are
serialised by a per-session lock, and sessions idle longer than ``idle_timeout_s`` are closed by
a reaper task.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import random
import re
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from horizonrl.envs.agentgym_api import DEFAULT_DIALECT, SESSION_KEYS, TASK_KEYS, as_reply, dialect
from horizonrl.envs.base import Environment, EnvironmentFailure
from horizonrl.envs.registry import make_env

log = logging.getLogger(__name__)


@dataclass
class Session:
    env_name: str
    env: Environment
    last_used: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    started: bool = False
    observation: str = ""


class HTTPError(Exception):
    def __init__(self, status: int, message: str, kind: str = "bad_request") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


class EnvServer:
    """Serves sessions of the named environments; see the module docstring for the API."""

    def __init__(self, env_names: list[str], settings: dict[str, dict[str, Any]] | None = None,
                 max_sessions: int = 4096, idle_timeout_s: float = 600.0, reap_interval_s: float = 10.0,
                 max_body_bytes: int = 1 << 20, agentgym_errors: bool = False) -> None:
        if not env_names:
            raise ValueError("serve at least one environment")
        self.env_names = list(env_names)
        self.settings = settings or {}
        self.max_sessions = max_sessions
        self.idle_timeout_s = idle_timeout_s
        self.reap_interval_s = reap_interval_s
        self.max_body_bytes = max_body_bytes
        self.agentgym_errors = agentgym_errors
        self.sessions: dict[int, Session] = {}
        self.reaped = 0
        self._next_id = 0  # ids are never reused: an id below it that is not open was closed
        self._metadata: dict[str, dict[str, Any]] = {}
        self._reaper: asyncio.Task | None = None

    # ----------------------------------------------------------------- app
    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[self._errors])
        app.router.add_post("/create", self.create)
        app.router.add_post("/reset", self.reset)
        app.router.add_post("/step", self.step)
        app.router.add_get("/observation", self.observation)
        app.router.add_post("/close", self.close)
        app.router.add_get("/health", self.health)
        app.router.add_get("/tasks", self.tasks)
        app.router.add_get("/random_action", self.random_action)
        app.router.add_get("/", self.health)
        # AgentGym clients, one base URL per environment: http://HOST:PORT/<env>
        app.router.add_post("/{env}/create", self.create)
        app.router.add_post("/{env}/reset", self.reset)
        app.router.add_post("/{env}/step", self.step)
        app.router.add_get("/{env}/observation", self.observation)
        app.router.add_post("/{env}/close", self.close)
        app.router.add_get("/{env}/", self.health)
        app.on_startup.append(self._start_reaper)
        app.on_cleanup.append(self._shutdown)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except HTTPError as error:
            return self._error(error.status, error.message, error.kind)
        except web.HTTPRequestEntityTooLarge:
            return self._error(413, f"request body over {self.max_body_bytes} bytes", "too_large")
        except web.HTTPException as error:
            return self._error(error.status, error.reason, "http")
        except EnvironmentFailure as error:
            return self._error(500, str(error), "environment_failure")
        except Exception as error:  # one handler at the boundary: log it, answer 500, keep serving
            log.exception("unexpected error in %s", request.path)
            return self._error(500, repr(error), "server_error")

    def _error(self, status: int, message: str, kind: str) -> web.Response:
        status = 200 if self.agentgym_errors else status
        return web.json_response({"error": message, "kind": kind}, status=status)

    # ------------------------------------------------------------ handlers
    async def create(self, request: web.Request) -> web.Response:
        route_env = self._route_env(request)
        body = await self._json(request, allow_empty=True)
        name = route_env or body.get("env") or (self.env_names[0] if len(self.env_names) == 1 else None)
        if name not in self.env_names:
            raise HTTPError(400, f"name the environment: {{\"env\": one of {self.env_names}}} in the body, "
                                 f"or, for AgentGym's clients, use the base URL http://HOST:PORT/<env>")
        if body.get("commands") is not None or body.get("goal") is not None:
            raise HTTPError(400, "custom TextCraft commands or goals are not supported: tasks come from data_idx")
        if len(self.sessions) >= self.max_sessions:
            raise HTTPError(503, f"session limit {self.max_sessions} reached", "busy")
        env = make_env(name, self.settings.get(name, {}))
        session_id, self._next_id = self._next_id, self._next_id + 1
        session = self.sessions[session_id] = Session(name, env)
        speaks = dialect(name)
        if speaks.create_answers_bare_id and route_env:
            return web.json_response(session_id)
        answer: dict[str, Any] = {"id": session_id, speaks.create_answer_key: session_id}
        if speaks.create_starts_episode:
            # AgentGym's TextCraft client reads an observation from /create (then resets anyway).
            first_task = min(env.task_ids("train"))
            async with session.lock:
                session.observation = await env.reset(first_task)
                session.started = True
            answer.update({"observation": session.observation, "reward": 0.0, "done": False})
        return web.json_response(answer)

    async def reset(self, request: web.Request) -> web.Response:
        route_env = self._route_env(request)
        keys = dialect(route_env) if route_env else DEFAULT_DIALECT
        body = await self._json(request)
        if not route_env and "env_idx" in body and "id" in body and "data_idx" not in body:
            raise HTTPError(400, "ambiguous reset {id, env_idx}: AgentGym's SearchQA client names the session "
                                 "env_idx; point it at the base URL http://HOST:PORT/searchqa")
        session = self._session(self._session_id(body, route_env), route_env)
        task_keys = (keys.task_key,) if route_env else TASK_KEYS
        task_id = next((body[k] for k in task_keys if k in body), None)
        if not isinstance(task_id, int) or isinstance(task_id, bool):
            raise HTTPError(400, f"reset needs an integer {task_keys[0]}")
        async with session.lock:
            try:
                observation = await session.env.reset(task_id)
            except ValueError as error:
                raise HTTPError(400, str(error), "bad_task_id") from error
            session.started, session.observation, session.last_used = True, observation, time.monotonic()
        shape = dialect(session.env_name)
        if shape.reset_answers_bare_text and route_env:
            return web.json_response(observation)
        answer: dict[str, Any] = {"observation": observation, "reward": 0.0, "score": 0.0, "done": False}
        description = getattr(session.env, "task_description", "")
        if shape.reset_splits_task and description and observation.startswith(description + "\n"):
            # AgentGym's SciWorld client shows task_description + "\n" + observation.
            answer.update(task_description=description, observation=observation[len(description) + 1:])
        return web.json_response(answer)

    async def step(self, request: web.Request) -> web.Response:
        route_env = self._route_env(request)
        body = await self._json(request)
        session = self._session(self._session_id(body, route_env), route_env)
        action = body.get("action")
        if not isinstance(action, str):
            raise HTTPError(400, "step needs a string action")
        if not session.started:
            raise HTTPError(409, "reset the session before stepping", "not_started")
        if body.get("whole_reply") is not True:
            action = as_reply(action, getattr(session.env, "reply_format", "react"))
        async with session.lock:
            result = await session.env.step(action)
            session.observation, session.last_used = result.observation, time.monotonic()
        return web.json_response({"observation": result.observation, "reward": result.reward,
                                  "score": result.score, "done": result.done, "terminated": result.done,
                                  "truncated": False, "success": result.success, "info": _jsonable(result.info)})

    async def observation(self, request: web.Request) -> web.Response:
        route_env = self._route_env(request)
        speaks = dialect(route_env) if route_env else DEFAULT_DIALECT
        key = speaks.session_key if route_env else next((k for k in SESSION_KEYS if k in request.query), "id")
        session = self._session(_int_param(request, key), route_env)
        session.last_used = time.monotonic()
        if speaks.observation_answers_bare_text and route_env:
            return web.json_response(session.observation)
        return web.json_response({"observation": session.observation})

    async def close(self, request: web.Request) -> web.Response:
        route_env = self._route_env(request)
        body = await self._json(request)
        session_id = self._session_id(body, route_env)
        if isinstance(session_id, int) and not isinstance(session_id, bool) \
                and 0 <= session_id < self._next_id and session_id not in self.sessions:
            return web.json_response({"closed": True})  # closed before (or reaped): closing is idempotent
        self._session(session_id, route_env)
        session = self.sessions.pop(session_id)
        async with session.lock:
            await session.env.close()
        return web.json_response({"closed": True})

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "envs": self.env_names, "sessions": len(self.sessions),
                                  "reaped": self.reaped, "rss_bytes": _rss()})

    async def tasks(self, request: web.Request) -> web.Response:
        name = request.query.get("env") or self.env_names[0]
        if name not in self.env_names:
            raise HTTPError(404, f"environment {name!r} is not served", "not_found")
        if name not in self._metadata:
            env = make_env(name, self.settings.get(name, {}))
            train, test = env.task_ids("train"), env.task_ids("test")
            self._metadata[name] = {"train": train, "test": test,
                                    "categories": {str(i): env.task_category(i) for i in [*train, *test]}}
            await env.close()
        return web.json_response(self._metadata[name])

    async def random_action(self, request: web.Request) -> web.Response:
        session = self._session(_int_param(request, "id"))
        rng = random.Random(_int_param(request, "seed"))
        async with session.lock:
            return web.json_response({"action": session.env.random_action(rng)})

    # ------------------------------------------------------------- helpers
    async def _json(self, request: web.Request, allow_empty: bool = False) -> dict[str, Any]:
        raw = await request.read()  # raises 413 past client_max_size
        if not raw and allow_empty:
            return {}
        depth = json_depth(raw)
        if depth > MAX_JSON_DEPTH:
            raise HTTPError(400, f"the body nests {depth} levels deep; at most {MAX_JSON_DEPTH}", "too_deep")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as error:
            raise HTTPError(400, f"the body is not JSON: {error}") from error
        except RecursionError as error:  # json_depth counts as the parser nests; this is only the last guard
            raise HTTPError(400, "the body nests too deep", "too_deep") from error
        if not isinstance(body, dict):
            raise HTTPError(400, "the body must be a JSON object")
        return body

    @staticmethod
    def _session_id(body: dict[str, Any], route_env: str | None) -> Any:
        """The session a body names: by the route's AgentGym key on ``/<env>/...``; on the root routes by
        ``id``, else by AgentGym's ``env_idx``."""
        if route_env:
            return body.get(dialect(route_env).session_key)
        return next((body[k] for k in SESSION_KEYS if k in body), None)

    def _route_env(self, request: web.Request) -> str | None:
        """The environment named in the path (``/<env>/step``), or None on the root routes."""
        name = request.match_info.get("env")
        if name is not None and name not in self.env_names:
            raise HTTPError(404, f"environment {name!r} is not served here; served: {self.env_names}", "not_found")
        return name

    def _session(self, session_id: Any, route_env: str | None = None) -> Session:
        if not isinstance(session_id, int) or isinstance(session_id, bool):
            raise HTTPError(400, "a request needs an integer session id")
        session = self.sessions.get(session_id)
        if session is None:
            raise HTTPError(404, f"no session {session_id} (closed, reaped or never created)", "unknown_session")
        if route_env is not None and session.env_name != route_env:
            raise HTTPError(404, f"session {session_id} is a {session.env_name} session, not {route_env}",
                            "unknown_session")
        return session

    async def _start_reaper(self, app: web.Application) -> None:
        self._reaper = asyncio.create_task(self._reap_forever())

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.reap_interval_s)
            await self.reap_idle()

    async def reap_idle(self) -> int:
        """Close every session idle for longer than ``idle_timeout_s`` and not in use."""
        now = time.monotonic()
        stale = [i for i, s in self.sessions.items()
                 if now - s.last_used > self.idle_timeout_s and not s.lock.locked()]
        for session_id in stale:
            session = self.sessions.pop(session_id, None)
            if session is not None:
                try:
                    await session.env.close()
                except Exception:
                    log.exception("closing reaped session %s", session_id)
                self.reaped += 1
        return len(stale)

    async def _shutdown(self, app: web.Application) -> None:
        if self._reaper:
            self._reaper.cancel()
        for session in list(self.sessions.values()):
            try:
                await session.env.close()
            except Exception:
                log.exception("closing a session at shutdown")
        self.sessions.clear()


def _int_param(request: web.Request, key: str) -> int:
    try:
        return int(request.query[key])
    except (KeyError, ValueError) as error:
        raise HTTPError(400, f"query parameter {key} must be an integer") from error


MAX_JSON_DEPTH = 64  # no request of the API nests more than 3 levels
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_BRACKETS = bytes.maketrans(b"[{]}", b"\x01\x01\x02\x02")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[{]}")


def json_depth(raw: bytes) -> int:
    """How deep the arrays and objects of a JSON text nest, counted without parsing it (strings are cut out
    first: a bracket inside one is text), so a body nested past any limit is refused before ``json.loads``
    recurses through it. Linear in the body, in C but for the last pass over its brackets alone."""
    brackets = _JSON_STRING.sub(b"", raw).translate(_BRACKETS, _NOT_BRACKETS)
    return max(itertools.accumulate(1 if b == 1 else -1 for b in brackets), default=0)


def _jsonable(info: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(info, default=str))


def _rss() -> int:
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except Exception:
        return 0


def serve(env_names: list[str], host: str = "127.0.0.1", port: int = 8000,
          settings: dict[str, dict[str, Any]] | None = None, **kwargs: Any) -> None:
    """Run the server until SIGINT or SIGTERM, then close every session.

    ``port=0`` binds a free port. Once listening, one line ``serving [names] on http://HOST:PORT``
    goes to stderr: the address to use, the bound port included (no pick-then-bind race).
    """
    asyncio.run(_serve(EnvServer(env_names, settings, **kwargs), env_names, host, port))


async def _serve(server: EnvServer, env_names: list[str], host: str, port: int) -> None:
    runner = web.AppRunner(server.app())
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        bound = runner.addresses[0][1]
        print(f"serving {env_names} on http://{host}:{bound}", file=sys.stderr, flush=True)
        stopped = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stopped.set)
        await stopped.wait()
        log.info("stopping: closing %d sessions", len(server.sessions))
    finally:
        await runner.cleanup()
