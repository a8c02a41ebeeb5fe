"""Episodes played by an agent program (``rollout.agent``): one endpoint session and one run of the program each.

For every episode the actor hands it, :meth:`AgentRunner.play` resets the environment, opens a session bound to
it (the turn budget is the coordinator's ``max_turns``) and starts ``rollout.agent.command`` with:

- ``OPENAI_BASE_URL`` = the session's base URL, ``OPENAI_API_KEY`` = the endpoint's key (the ``openai`` client
  reads both, so an agent written against it needs no change);
- ``HORIZONRL_SESSION_URL`` = the session (``GET .../env/observation``, ``POST .../env/step {"action"}``,
  ``POST .../close``), ``HORIZONRL_SESSION_ID``, ``HORIZONRL_ENV``, ``HORIZONRL_TASK_ID``.

The environment verifies the outcome: its rewards are the episode's. The episode ends when the agent closes its
session or its program exits; then the session's episode goes to the buffer like any other. Who is at fault
decides, as in ``episode.py``: a program that exits non-zero, or an environment that fails, is an environment
failure; a program still running after ``rollout.episode_timeout_s`` is killed (a timeout failure); neither is
trained on. The program's output is appended to ``logs/agents-actor-<i>.log``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from horizonrl.actors.episode import Episode
from horizonrl.actors.openai_endpoint.endpoint import AgentEndpoint, EndpointSettings
from horizonrl.actors.openai_endpoint.http_app import EndpointApp, check_binding
from horizonrl.core.agent_config import AgentConfig
from horizonrl.protocol import FAILURE_ENVIRONMENT, FAILURE_TIMEOUT, STOP_FAILURE

log = logging.getLogger("horizonrl.actors.openai_endpoint")


@dataclass
class AgentRunner:
    """The actor's agent episodes (see the module docstring)."""

    endpoint: AgentEndpoint
    http: EndpointApp
    config: AgentConfig
    episode_timeout_s: float
    log_path: Path
    runner: Any = None  # aiohttp's AppRunner while serving

    @classmethod
    async def start(cls, agent: AgentConfig, *, generator, chat, weights, model_name: str, temperature: float,
                    top_p: float, max_tokens_per_turn: int, max_context_tokens: int, turn_timeout_s: float | None,
                    episode_timeout_s: float, log_path: Path) -> "AgentRunner":
        from aiohttp import web

        e = agent.endpoint
        api_key = Path(e.api_key_file).read_text().strip() if e.api_key_file else secrets.token_urlsafe(24)
        check_binding(e.host, api_key)
        settings = EndpointSettings(model_name=model_name, max_context_tokens=max_context_tokens,
                                    default_max_tokens=max_tokens_per_turn, temperature=temperature, top_p=top_p,
                                    tool_call_format=e.tool_call_format, tool_prompt=e.tool_prompt,
                                    turn_timeout_s=turn_timeout_s)
        endpoint = AgentEndpoint(generator, chat, settings, weights=weights)
        http = EndpointApp(endpoint, api_key=api_key, max_body_bytes=e.max_body_bytes)
        runner = web.AppRunner(http.app(), access_log=None)  # a line per model call is noise
        await runner.setup()
        await web.TCPSite(runner, e.host, e.port).start()
        http.public_url = f"http://{e.host}:{runner.addresses[0][1]}"
        log.info("OpenAI endpoint for the agent %s on %s (tool calls: %s; the chat template %s tools)",
                 " ".join(agent.command), http.public_url, e.tool_call_format,
                 "renders" if endpoint.renderer.native_tools else f"cannot render: a {e.tool_prompt} prompt for")
        log_path.parent.mkdir(parents=True, exist_ok=True)
        return cls(endpoint, http, agent, episode_timeout_s, log_path, runner)

    async def stop(self) -> None:
        log.info("OpenAI endpoint: %s", self.endpoint.stats.as_dict())
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    async def play(self, env, env_name: str, task_id: int, max_turns: int) -> Episode:
        """One episode of ``task_id`` played by the agent program (``env`` is the actor's instance, reset here)."""
        try:
            first = await asyncio.wait_for(env.reset(task_id), self.episode_timeout_s)
        except Exception as error:  # noqa: BLE001 - the environment failed (episode.py's rule)
            return Episode(failure=FAILURE_ENVIRONMENT, stop_reason=STOP_FAILURE,
                           failure_message=f"reset: {type(error).__name__}: {error}"[:500])
        session = self.endpoint.open_session(env=env, env_name=env_name, task_id=task_id, first_observation=first,
                                             max_turns=max_turns)
        with open(self.log_path, "ab") as output:
            proc = await asyncio.create_subprocess_exec(
                *agent_command(self.config.command), stdin=asyncio.subprocess.DEVNULL, stdout=output, stderr=output,
                env={**os.environ, **self.config.env, **self._variables(session, env_name, task_id)})
        try:
            failure, message = await self._until_done(proc, session)
        except asyncio.CancelledError:  # the actor stops: the program ends too, the episode is abandoned
            await _end(proc, 0.0)
            self.endpoint.sessions.pop(session.session_id, None)
            raise
        await _end(proc, self.config.stop_grace_s)
        if session.session_id in self.endpoint.sessions:
            return await self.endpoint.close(session.session_id, failure=failure, failure_message=message)
        return await session.closed

    def _variables(self, session, env_name: str, task_id: int) -> dict[str, str]:
        url = f"{self.http.public_url}/sessions/{session.session_id}"
        return {"OPENAI_BASE_URL": f"{url}/v1", "OPENAI_API_KEY": self.http.api_key or "",
                "HORIZONRL_SESSION_URL": url, "HORIZONRL_SESSION_ID": session.session_id,
                "HORIZONRL_ENV": env_name, "HORIZONRL_TASK_ID": str(task_id)}

    async def _until_done(self, proc, session) -> tuple[str, str]:
        """Wait for the session to close or the program to exit: ("", "") or the failure of the episode."""
        exited = asyncio.ensure_future(proc.wait())
        try:
            done, _ = await asyncio.wait({exited, session.closed}, timeout=self.episode_timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not exited.done():
                exited.cancel()
        if not done:
            return FAILURE_TIMEOUT, f"the agent program ran past rollout.episode_timeout_s={self.episode_timeout_s}"
        if exited in done and proc.returncode != 0 and not session.closed.done():
            return FAILURE_ENVIRONMENT, f"the agent program exited with {proc.returncode} (see {self.log_path})"
        return "", ""


def agent_command(command: list[str]) -> list[str]:
    """``rollout.agent.command`` as run: ``python`` (first) is the interpreter that runs horizonrl, so an agent in the
    project's virtual environment needs no path to it."""
    return [sys.executable, *command[1:]] if command[0] == "python" else list(command)


async def _end(proc, grace_s: float) -> None:
    """Let the program exit within ``grace_s``, then end it (by its pid: only the process this runner started)."""
    if proc.returncode is not None:
        return
    if grace_s > 0:
        try:
            await asyncio.wait_for(asyncio.shield(proc.wait()), grace_s)
            return
        except asyncio.TimeoutError:
            pass
    try:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 5.0)
    except ProcessLookupError:
        return  # it exited meanwhile
    except asyncio.TimeoutError:
        try:
            proc.kill()
        except ProcessLookupError:
            return
        await proc.wait()


async def start_for_actor(actor) -> AgentRunner:
    """The runner of an actor whose config has ``rollout.agent``: its engine, its run's sampling settings."""
    config, r = actor.config, actor.config.rollout
    return await AgentRunner.start(
        r.agent, generator=actor.engine, chat=actor.chat, weights=lambda: actor.weights,
        model_name=Path(config.model.path).name, temperature=r.temperature, top_p=r.top_p,
        max_tokens_per_turn=r.max_tokens_per_turn, max_context_tokens=r.max_context_tokens,
        turn_timeout_s=r.turn_timeout_s, episode_timeout_s=r.episode_timeout_s,
        log_path=config.run_dir.log(f"agents-actor-{actor.index}"))
