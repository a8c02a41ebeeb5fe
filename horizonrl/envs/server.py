"""HTTP environment server (aiohttp): any registered environment, one session per episode stream.

Endpoints (AgentGym's, plus /health and two for the client's metadata):

- ``POST /create {"env"?: name}`` -> ``{"id": int}`` (``env`` may be left out when one is served)
- ``POST /reset {"id", "data_idx"}`` (``env_idx`` / ``task_id`` accepted) -> ``{"observation",
  "reward": 0, "score": 0, "done": false}``
- ``POST /step {"id", "action"}`` -> ``{"observation", "reward", "score", "done", "success", "info"}``
- ``GET /observation?id=`` -> ``{"observation"}`` (the last one)
- ``POST /close {"id"}`` -> ``{"closed": true}``
- ``GET /health`` -> ``{"status": "ok", "envs", "sessions", "reaped", "rss_bytes"}``
- ``GET /tasks?env=`` -> ``{"train": [...], "test": [...], "categories": {...}}``
- ``GET /random_action?id=&seed=`` -> ``{"action"}``

Errors use real status codes with ``{"error": message, "kind": ...}``: 400 malformed request or
bad task id, 404 unknown session or route, 409 step before reset, 413 body over
``max_body_bytes``, 503 session limit reached, 500 environment failure. Environment code runs
off the event loop (every environment's blocking work goes through ``run_blocking``), requests
on one session are serialised by a per-session lock, and sessions idle longer than
``idle_timeout_s`` are closed by a reaper task.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

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
                 max_body_bytes: int = 1 << 20) -> None:
        if not env_names:
            raise ValueError("serve at least one environment")
        self.env_names = list(env_names)
        self.settings = settings or {}
        self.max_sessions = max_sessions
        self.idle_timeout_s = idle_timeout_s
        self.reap_interval_s = reap_interval_s
        self.max_body_bytes = max_body_bytes
        self.sessions: dict[int, Session] = {}
        self.reaped = 0
        self._ids = itertools.count()
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
        app.on_startup.append(self._start_reaper)
        app.on_cleanup.append(self._shutdown)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except HTTPError as error:
            return web.json_response({"error": error.message, "kind": error.kind}, status=error.status)
        except web.HTTPRequestEntityTooLarge:
            return web.json_response({"error": f"request body over {self.max_body_bytes} bytes",
                                      "kind": "too_large"}, status=413)
        except web.HTTPException as error:
            return web.json_response({"error": error.reason, "kind": "http"}, status=error.status)
        except EnvironmentFailure as error:
            return web.json_response({"error": str(error), "kind": "environment_failure"}, status=500)
        except Exception as error:  # one handler at the boundary: log it, answer 500, keep serving
            log.exception("unexpected error in %s", request.path)
            return web.json_response({"error": repr(error), "kind": "server_error"}, status=500)

    # ------------------------------------------------------------ handlers
    async def create(self, request: web.Request) -> web.Response:
        body = await self._json(request, allow_empty=True)
        name = body.get("env") or (self.env_names[0] if len(self.env_names) == 1 else None)
        if name not in self.env_names:
            raise HTTPError(400, f"choose env from {self.env_names}")
        if len(self.sessions) >= self.max_sessions:
            raise HTTPError(503, f"session limit {self.max_sessions} reached", "busy")
        env = make_env(name, self.settings.get(name, {}))
        session_id = next(self._ids)
        self.sessions[session_id] = Session(name, env)
        return web.json_response({"id": session_id})

    async def reset(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        session = self._session(body.get("id"))
        task_id = next((body[k] for k in ("data_idx", "task_id", "env_idx") if k in body), None)
        if not isinstance(task_id, int) or isinstance(task_id, bool):
            raise HTTPError(400, "reset needs an integer data_idx")
        async with session.lock:
            try:
                observation = await session.env.reset(task_id)
            except ValueError as error:
                raise HTTPError(400, str(error), "bad_task_id") from error
            session.started, session.observation, session.last_used = True, observation, time.monotonic()
        return web.json_response({"observation": observation, "reward": 0.0, "score": 0.0, "done": False})

    async def step(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        session = self._session(body.get("id"))
        action = body.get("action")
        if not isinstance(action, str):
            raise HTTPError(400, "step needs a string action")
        if not session.started:
            raise HTTPError(409, "reset the session before stepping", "not_started")
        async with session.lock:
            result = await session.env.step(action)
            session.observation, session.last_used = result.observation, time.monotonic()
        return web.json_response({"observation": result.observation, "reward": result.reward,
                                  "score": result.score, "done": result.done, "success": result.success,
                                  "info": _jsonable(result.info)})

    async def observation(self, request: web.Request) -> web.Response:
        session = self._session(_int_param(request, "id"))
        session.last_used = time.monotonic()
        return web.json_response({"observation": session.observation})

    async def close(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        session_id = body.get("id")
        self._session(session_id)
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
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as error:
            raise HTTPError(400, f"the body is not JSON: {error}") from error
        if not isinstance(body, dict):
            raise HTTPError(400, "the body must be a JSON object")
        return body

    def _session(self, session_id: Any) -> Session:
        if not isinstance(session_id, int) or isinstance(session_id, bool):
            raise HTTPError(400, "a request needs an integer session id")
        session = self.sessions.get(session_id)
        if session is None:
            raise HTTPError(404, f"no session {session_id} (closed, reaped or never created)", "unknown_session")
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
