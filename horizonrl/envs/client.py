"""Client of an environment server: the same async Environment interface, over HTTP.

``make_env("http", {"url": "http://host:8000", "env": "babyai"})``. Server and network failures
(connection refused, timeouts, HTTP 5xx, a lost session) raise :class:`EnvironmentFailure`; a bad
task id (HTTP 400 on reset) raises ``ValueError`` as the in-process environment does. Requests
that are safe to repeat (create, reset, metadata) are retried with a back-off that doubles (0.2 s
up to 5 s) for up to ``retry_for_s`` — long enough for a server the launcher restarts to come
back; ``step`` is sent once, because repeating it could apply an action twice, so an episode whose
server dies mid-way ends as an environment failure (counted, never trained on).

``managed: true`` (with ``env`` and ``env_settings``) asks the launcher to start and supervise the
server itself (``url`` is then optional: it picks a free port); the client ignores those keys.

``protocol="agentgym"`` talks to AgentGym's own servers (``agentenv-*``), with ``env`` naming
which one (``babyai``, ``textcraft``, ``sciworld``, ``searchqa``, ``webarena``): bodies, keys and answer shapes
as that server has them (``agentgym_api.DIALECTS``), the bare action cut from the reply as
AgentGym's own client cuts it, errors answered with HTTP 200 and ``{"error": ...}`` turned into
EnvironmentFailure; SciWorld's 0-100 reward is scaled to 0-1 as in-process. Those servers
publish no task metadata: use id files.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import random
import time
import urllib.parse
import urllib.request
from typing import Any

from horizonrl.envs.agentgym_api import Dialect, agentgym_action, dialect
from horizonrl.envs.base import EnvironmentFailure, StepResult

log = logging.getLogger("horizonrl.envs.client")

MAX_ACTION_CHARS = 65_536  # longer replies are cut so they never trip the server's body limit


class HTTPEnv:
    """One remote session; created on the first reset, closed by ``close``."""

    def __init__(self, url: str, env: str | None = None, timeout_s: float = 60.0, retry_for_s: float = 60.0,
                 protocol: str = "horizonrl", managed: bool = False,
                 env_settings: dict[str, Any] | None = None) -> None:
        if protocol not in ("horizonrl", "agentgym"):
            raise ValueError("protocol must be 'horizonrl' or 'agentgym'")
        self.url = url.rstrip("/")
        self.env_name = env
        self.name = env or "http"
        self.timeout_s = timeout_s
        self.retry_for_s = retry_for_s
        self.protocol = protocol
        self._session: Any = None
        self._id: int | None = None
        self._metadata: dict[str, Any] | None = None

    # -------------------------------------------------------------- episode
    async def reset(self, task_id: int) -> str:
        speaks = self._dialect()
        if self._id is None:
            if self.protocol == "agentgym":
                created = await self._post("/create", speaks.create_body, retry=True)
            else:
                created = await self._post("/create", {"env": self.env_name} if self.env_name else {}, retry=True)
            # SearchQA's AgentGym server answers the bare id (parsed into {"value": id}), WebArena's {"env_idx": id}
            self._id = next((created[k] for k in ("id", speaks.create_answer_key, "value") if k in created), None)
            if not isinstance(self._id, int):
                raise EnvironmentFailure(f"{self.url}/create answered no session id: {created!r}"[:300])
        payload = await self._post("/reset", {speaks.session_key: self._id, speaks.task_key: task_id,
                                              **(speaks.reset_extra or {})}, retry=True)
        observation = payload.get("observation", "")
        if "task_description" in payload:  # SciWorld's servers send the task apart
            observation = f"{payload['task_description']}\n{observation}"
        return observation

    async def step(self, action_text: str) -> StepResult:
        if self._id is None:
            return StepResult("The episode is over; no more actions are accepted.", 0.0, True,
                              info={"invalid_action": True})
        reply = action_text[:MAX_ACTION_CHARS]
        speaks = self._dialect()
        if self.protocol == "agentgym":
            body = {speaks.session_key: self._id, "action": agentgym_action(self.env_name, reply)}
        else:  # the whole reply, its format checked as in-process
            body = {"id": self._id, "action": reply, "whole_reply": True}
        p = await self._post("/step", body, retry=False)
        done = bool(p.get("done", p.get("terminated", False)) or p.get("truncated", False))
        reward, score = float(p.get("reward", 0.0) or 0.0), float(p.get("score", 0.0) or 0.0)
        if "success" in p:
            success = bool(p["success"])
        elif speaks.score_in_points:
            reward, success = reward / 100.0, done and score >= 100
        else:  # AgentGym's BabyAI pays less than 1 for a slow success; a failure pays 0
            success = done and reward > 0
        return StepResult(str(p.get("observation", "")), reward, done, success, score, p.get("info") or {})

    def _dialect(self) -> Dialect:
        return dialect(self.env_name if self.protocol == "agentgym" else None)

    async def close(self) -> None:
        session_id, self._id = self._id, None
        try:
            if session_id is not None:
                await self._post("/close", {self._dialect().session_key: session_id}, retry=False, missing_ok=True)
        except EnvironmentFailure as exc:
            # The server is unreachable: its sessions died with it (a restarted server starts empty).
            log.info("closing session %s on %s: %s", session_id, self.url, exc)
        finally:
            if self._session is not None:
                await self._session.close()
                self._session = None

    # ------------------------------------------------------------ metadata
    def task_ids(self, split: str) -> list[int]:
        if split not in ("train", "test"):
            raise ValueError(f"unknown split {split!r}; use 'train' or 'test'")
        return list(self._tasks()[split])

    def task_category(self, task_id: int) -> str:
        return self._tasks()["categories"].get(str(task_id), "unknown")

    def random_action(self, rng: random.Random) -> str:
        """Asks the server (a blocking call: meant for building warm-up data, not for hot loops)."""
        if self._id is None:
            return "Action: look around"
        query = urllib.parse.urlencode({"id": self._id, "seed": rng.getrandbits(32)})
        return self._get_blocking(f"/random_action?{query}")["action"]

    def _tasks(self) -> dict[str, Any]:
        if self._metadata is None:
            if self.protocol == "agentgym":
                raise EnvironmentFailure("AgentGym servers publish no task ids; use id files instead")
            query = urllib.parse.urlencode({"env": self.env_name} if self.env_name else {})
            self._metadata = self._get_blocking(f"/tasks?{query}")
        return self._metadata

    def _get_blocking(self, path: str) -> dict[str, Any]:
        deadline = time.monotonic() + self.retry_for_s
        for attempt in itertools.count():
            try:
                with urllib.request.urlopen(self.url + path, timeout=self.timeout_s) as response:
                    return json.loads(response.read())
            except Exception as error:
                delay = _backoff(attempt)
                if time.monotonic() + delay > deadline:
                    raise EnvironmentFailure(f"environment server {self.url}{path} failed: {error!r}") from error
                time.sleep(delay)

    # ------------------------------------------------------------ transport
    async def _post(self, path: str, body: dict[str, Any] | None, retry: bool,
                    missing_ok: bool = False) -> dict[str, Any]:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        deadline = time.monotonic() + (self.retry_for_s if retry else 0.0)
        last: BaseException | None = None
        for attempt in itertools.count():
            if attempt > 0:
                delay = _backoff(attempt - 1)
                if time.monotonic() + delay > deadline:
                    break
                await asyncio.sleep(delay)
            try:
                async with self._session.post(self.url + path, **({} if body is None else {"json": body})) as response:
                    text = await response.text()
                    status = response.status
            except (aiohttp.ClientError, asyncio.TimeoutError) as error:
                last = error
                continue
            payload = _parse(text)
            if status == 404 and missing_ok:
                return payload
            if status == 400 and path == "/reset":
                raise ValueError(payload.get("error", "bad task id"))
            if status == 404:
                raise EnvironmentFailure(f"lost session on {self.url}: {payload.get('error', text[:200])}")
            if status >= 400:
                error = payload.get("error", text[:200])
                last = EnvironmentFailure(f"{self.url}{path} answered HTTP {status}: {error}")
                if status >= 500:
                    continue
                raise last
            if "error" in payload:  # AgentGym's servers report failures with HTTP 200
                raise EnvironmentFailure(f"{self.url}{path}: {payload['error']}")
            return payload
        if isinstance(last, EnvironmentFailure):
            raise last
        raise EnvironmentFailure(f"environment server {self.url}{path} unreachable: {last!r}") from last


def _backoff(attempt: int) -> float:
    """Seconds before retry ``attempt + 1``: 0.2, 0.4, 0.8, ... up to 5."""
    return min(5.0, 0.2 * 2**attempt)


def _parse(text: str) -> dict[str, Any]:
    try:
        payload = json.loads(text) if text else {}
    except ValueError:
        return {"error": text[:200]}
    if isinstance(payload, str):  # some AgentGym endpoints return a bare string
        return {"observation": payload}
    return payload if isinstance(payload, dict) else {"value": payload}
