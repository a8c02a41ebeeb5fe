"""The endpoint's core: sessions and model calls, with no HTTP (``http_app.py`` serves it).

:class:`AgentEndpoint` owns the open sessions, makes each chat call (plan the prompt, sample ``n`` choices from
the engine, parse tool calls, record: ``session.py``) and ends sessions into episodes. Whoever opened a session
gets its episode: the actor's agent runner waits on ``session.closed`` and sends it to the buffer like any other
episode; sessions opened over HTTP (the standalone endpoint) go to ``on_finished``.

Sampling for training: with ``EndpointSettings.temperature``/``top_p`` set (the actor sets the run's
``rollout.temperature``/``top_p``), every call samples with them whatever the agent asks, because the learner
computes its log-probabilities with those (a call that asked otherwise is counted in ``temperature_overridden``).
Unset (the standalone endpoint), the agent's own settings apply.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, field, fields
from typing import Any, Awaitable, Callable, Protocol

from horizonrl.actors.episode import Episode
from horizonrl.actors.openai_endpoint.rendering import ChatRenderer
from horizonrl.actors.openai_endpoint.session import AgentSession, Choice, PromptPlan
from horizonrl.actors.openai_endpoint.tool_calls import parse_reply
from horizonrl.actors.openai_endpoint.wire import ChatMessage, ChatRequest, RequestError
from horizonrl.core.chat import ChatTokenizer
from horizonrl.protocol import FAILURE_TIMEOUT

log = logging.getLogger("horizonrl.actors.openai_endpoint")


class Generator(Protocol):
    async def generate(self, prompt_ids: list[int], *, max_tokens: int, temperature: float, top_p: float,
                       stop_token_ids: list[int]): ...


@dataclass(frozen=True)
class EndpointSettings:
    model_name: str
    max_context_tokens: int
    default_max_tokens: int = 256  # a call's max_tokens when the agent does not say
    temperature: float | None = None  # fixed for every call (training); None: the agent's (default 1.0)
    top_p: float | None = None
    tool_call_format: str = "hermes"
    tool_prompt: str = "hermes"
    max_sessions: int = 1024
    idle_timeout_s: float = 600.0  # a session without a call for this long is ended as a timeout failure
    turn_timeout_s: float | None = 300.0  # one call's generation
    default_max_turns: int = 1 << 20  # model calls of a session opened over HTTP without a budget


@dataclass
class EndpointStats:
    """Cumulative counts over the endpoint's life (``GET /health``; the actor's log)."""

    sessions_opened: int = 0
    sessions_closed: int = 0
    sessions_reaped: int = 0
    calls: int = 0
    refused_calls: int = 0  # RequestError answers to a chat call (budget, context, template, bad input)
    engine_failures: int = 0
    branches: int = 0
    tool_calls: int = 0
    tool_parse_failures: int = 0
    unadopted_choices: int = 0
    temperature_overridden: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class CallResult:
    session: AgentSession
    call_index: int
    plan: PromptPlan
    choices: list[Choice]
    weights: tuple[int, int]


@dataclass
class AgentEndpoint:
    generator: Generator
    chat: ChatTokenizer
    settings: EndpointSettings
    weights: Callable[[], tuple[int, int]] = lambda: (0, 0)
    on_finished: Callable[[AgentSession, Episode], Awaitable[None]] | None = None
    sessions: dict[str, AgentSession] = field(default_factory=dict)
    stats: EndpointStats = field(default_factory=EndpointStats)

    def __post_init__(self) -> None:
        self.renderer = ChatRenderer(self.chat, self.settings.tool_call_format, self.settings.tool_prompt)
        special = set(getattr(self.chat.tokenizer, "all_special_tokens", ()))
        self._markup_is_special = bool(special & {"<tool_call>", "</tool_call>", "<|python_tag|>"})

    # ---------------------------------------------------------------- sessions

    def open_session(self, *, env: Any = None, env_name: str = "agent", task_id: int = 0,
                     first_observation: str | None = None, max_turns: int | None = None, group_id: str = "",
                     group_size: int = 1) -> AgentSession:
        """A new session (an unguessable id: it is also what lets an agent into its own episode only)."""
        if len(self.sessions) >= self.settings.max_sessions:
            raise RequestError(503, f"{self.settings.max_sessions} sessions are open; close one first", "busy",
                               kind="server_error")
        session_id = secrets.token_urlsafe(12)
        session = AgentSession(session_id, self.renderer, max_turns or self.settings.default_max_turns,
                               self.settings.max_context_tokens, env_name=env_name, task_id=task_id,
                               group_id=group_id or session_id, group_size=group_size, env=env,
                               closed=asyncio.get_running_loop().create_future())
        if first_observation is not None:
            session.episode.observations.append(first_observation)
            session.last_env_observation = first_observation
        self.sessions[session_id] = session
        self.stats.sessions_opened += 1
        return session

    def session(self, session_id: str | None) -> AgentSession:
        if not session_id:
            raise RequestError(400, "name the session: the X-Session-Id header, or the base URL "
                                    "http://HOST:PORT/sessions/<id>/v1", "missing_session")
        session = self.sessions.get(session_id)
        if session is None:
            raise RequestError(404, f"no open session {session_id[:64]!r} (closed, reaped or never opened)",
                               "unknown_session")
        return session

    async def close(self, session_id: str, *, failure: str = "", failure_message: str = "") -> Episode:
        """End the session: its episode, handed to ``on_finished`` and to whoever waits on ``session.closed``."""
        session = self.session(session_id)
        async with session.lock:
            if self.sessions.pop(session_id, None) is None:  # closed meanwhile by another request
                return await session.closed
            if failure and not session.failure:
                session.failure, session.failure_message = failure, failure_message
            episode = session.finish()
        self.stats.sessions_closed += 1
        self.stats.branches += session.branches
        self.stats.unadopted_choices += session.unadopted_choices
        if self.on_finished is not None:
            await self.on_finished(session, episode)
        if not session.closed.done():
            session.closed.set_result(episode)
        return episode

    async def reap_idle(self) -> int:
        """End every session idle for longer than ``idle_timeout_s`` (its agent is gone): a timeout failure."""
        now = time.monotonic()
        stale = [sid for sid, s in self.sessions.items()
                 if now - s.last_used > self.settings.idle_timeout_s and not s.lock.locked()]
        for session_id in stale:
            await self.close(session_id, failure=FAILURE_TIMEOUT,
                             failure_message=f"no model call for {self.settings.idle_timeout_s:.0f} s (idle_timeout_s)")
        self.stats.sessions_reaped += len(stale)
        return len(stale)

    # ---------------------------------------------------------------- calls

    async def complete(self, session: AgentSession, request: ChatRequest) -> CallResult:
        """One chat call of ``session``: RequestError for what the agent must change (4xx) or what failed (5xx)."""
        async with session.lock:
            try:
                session.check_open_for_call()
                plan = session.plan(request)
            except RequestError:
                self.stats.refused_calls += 1
                raise
            room = self.settings.max_context_tokens - len(plan.prompt_ids)
            max_tokens = min(request.max_tokens or self.settings.default_max_tokens, room)
            temperature, top_p = self._sampling(request)
            weights = self.weights()
            generations = await asyncio.gather(*(self._generate(plan.prompt_ids, max_tokens, temperature, top_p)
                                                 for _ in range(request.n)))
            call_index = session.calls
            choices = [self._choice(session.session_id, call_index, j, gen, weights, request)
                       for j, gen in enumerate(generations)]
            session.record(request, plan, choices)
        self.stats.calls += 1
        self.stats.prompt_tokens += len(plan.prompt_ids)
        self.stats.generated_tokens += sum(len(c.ids) for c in choices)
        self.stats.tool_calls += sum(len(c.message.tool_calls) for c in choices)
        self.stats.tool_parse_failures += sum(bool(c.parse_error) for c in choices)
        return CallResult(session, call_index, plan, choices, weights)

    def reply_text(self, ids: list[int], tools_allowed: bool) -> str:
        """A reply's text as the agent reads it: without special tokens, except where the tokenizer makes the
        tool-call markup special (it must stay for the parser to see the calls)."""
        if tools_allowed and self._markup_is_special:
            stops = set(self.chat.stop_token_ids)
            end = len(ids)
            while end and ids[end - 1] in stops:
                end -= 1
            return self.chat.decode(ids[:end], skip_special_tokens=False)
        return self.chat.decode(ids)

    def _sampling(self, request: ChatRequest) -> tuple[float, float]:
        s = self.settings
        if s.temperature is None:
            return (1.0 if request.temperature is None else request.temperature,
                    1.0 if request.top_p is None else request.top_p)
        asked = (request.temperature, request.top_p)
        if any(a is not None and a != fixed for a, fixed in zip(asked, (s.temperature, s.top_p or 1.0))):
            self.stats.temperature_overridden += 1
        return s.temperature, s.top_p or 1.0

    async def _generate(self, prompt_ids: list[int], max_tokens: int, temperature: float, top_p: float):
        try:
            gen = await asyncio.wait_for(self.generator.generate(
                prompt_ids, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                stop_token_ids=self.chat.stop_token_ids), self.settings.turn_timeout_s)
        except asyncio.TimeoutError:
            self.stats.engine_failures += 1
            raise RequestError(504, f"the generation took longer than {self.settings.turn_timeout_s} s",
                               "generation_timeout", kind="server_error") from None
        except Exception as error:  # noqa: BLE001 - the engine failed this request: the agent may retry
            self.stats.engine_failures += 1
            log.exception("generation failed")
            raise RequestError(500, f"the engine failed: {type(error).__name__}: {error}"[:300], "engine_error",
                               kind="server_error") from None
        if not gen.token_ids or gen.finish_reason == "abort":
            self.stats.engine_failures += 1
            raise RequestError(503, f"the engine returned no reply (finish_reason={gen.finish_reason})",
                               "engine_error", kind="server_error")
        return gen

    def _choice(self, session_id: str, call_index: int, index: int, gen, weights: tuple[int, int],
                request: ChatRequest) -> Choice:
        ids, logprobs, spans = list(gen.token_ids), list(gen.logprobs), list(gen.version_spans)
        text, stopped = self.reply_text(ids, request.tools_allowed), gen.finish_reason == "stop"
        if request.stop:
            cut = cut_at_stop(ids, request.stop, lambda part: self.reply_text(part, request.tools_allowed))
            if cut is not None:
                keep, text = cut
                ids, logprobs, stopped = ids[:keep], logprobs[:keep], True
                spans = clip_spans(spans, keep)
        parsed = parse_reply(text, self.settings.tool_call_format, request.tools_allowed)
        call_ids = tuple(f"call_{session_id[:8]}_{call_index}_{index}_{i}" for i in range(len(parsed.tool_calls)))
        message = ChatMessage("assistant", parsed.content or "", tuple(parsed.tool_calls), tool_call_ids=call_ids)
        finish = "tool_calls" if parsed.tool_calls else ("stop" if stopped else "length")
        return Choice(ids, logprobs, spans, weights, finish, text, message, call_ids, parsed.parse_error)


def cut_at_stop(ids: list[int], stops: tuple[str, ...], decode: Callable[[list[int]], str]) -> tuple[int, str] | None:
    """Where a reply ends at its first stop string: (the tokens to keep: the fewest whose text holds it, the text
    before it), or None when no stop string occurs. The tokens after it were generated but never shown to the
    agent; a stock server would not have generated them (it checks stop strings as it goes), so they are dropped.
    """
    def first_stop(text: str) -> int:
        found = [i for i in (text.find(s) for s in stops) if i >= 0]
        return min(found) if found else -1

    full = decode(ids)
    if first_stop(full) < 0:
        return None
    low, high = 1, len(ids)  # the shortest prefix whose text holds a stop string (a prefix's text only grows)
    while low < high:
        mid = (low + high) // 2
        if first_stop(decode(ids[:mid])) >= 0:
            high = mid
        else:
            low = mid + 1
    text = decode(ids[:low])
    return low, text[:first_stop(text)]


def clip_spans(spans: list[tuple[int, int, int]], keep: int) -> list[tuple[int, int, int]]:
    """``Generation.version_spans`` ((end, epoch, version) runs) of the first ``keep`` tokens."""
    out = []
    for end, epoch, version in spans:
        out.append((min(end, keep), epoch, version))
        if end >= keep:
            break
    return out
