"""One episode, token-in/token-out.

The sequence the learner trains on is built here, incrementally, exactly as the engine
saw it: the prompt ids, then for each turn the generated ids (loss mask 1, with their
behaviour logprobs) and the observation's ids (loss mask 0). Model output is never
re-tokenized, so an episode's tokens cannot drift from what was sampled.

A chat template that rewrites history (``chat.append_only`` False, e.g. Qwen3's) renders each next
prompt in full. Where that rendering does not extend the tokens the current sample holds, the
episode *branches*: the current sample ends and a new one starts, whose prompt is the rendering.
The episode's arrays are then its samples one after another (``sample_starts`` says where each
after the first begins); the engine is always prompted with the current sample only.

The same mechanism carries an episode past the context (``rollout.context.policy``: window or
summarize, ``actors/context.py``): when the next turn would not fit, a new sample (a *segment*) starts
whose prompt drops the history, keeping the newest turns or the model's own summary of them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Protocol, TypeVar

from horizonrl.actors.context import (CONTEXT_CUT, CONTEXT_SUMMARIZE, SUMMARY_REQUEST, ContextPolicy,
                                      shown_conversation, summary_head, windowed_prompt)
from horizonrl.core.environment import Environment, EnvironmentFailure, extract_action
from horizonrl.protocol import (
    FAILURE_ENGINE,
    FAILURE_ENVIRONMENT,
    FAILURE_NONE,
    FAILURE_PROMPT_TOO_LONG,
    FAILURE_TIMEOUT,
    STOP_CONTEXT,
    STOP_DONE,
    STOP_FAILURE,
    STOP_MAX_TURNS,
)

log = logging.getLogger("horizonrl.actors.episode")

T = TypeVar("T")


class Generator(Protocol):
    async def generate(self, prompt_ids: list[int], *, max_tokens: int, temperature: float, top_p: float,
                       stop_token_ids: list[int]): ...


@dataclass(frozen=True)
class SamplingSettings:
    """How an episode is generated, and the wall-clock limits that keep a straggler from holding
    its group forever (None: no limit)."""

    temperature: float
    top_p: float
    max_tokens_per_turn: int
    max_context_tokens: int
    system_prompt: str | None = None
    turn_timeout_s: float | None = None  # one generation
    episode_timeout_s: float | None = None  # the whole episode, environment steps included
    context: ContextPolicy = ContextPolicy()  # when the next turn would not fit (actors/context.py)

    @classmethod
    def from_config(cls, rollout) -> "SamplingSettings":
        """As the run's ``rollout`` section says (core/config.py RolloutConfig)."""
        return cls(rollout.temperature, rollout.top_p, rollout.max_tokens_per_turn, rollout.max_context_tokens,
                   rollout.system_prompt, rollout.turn_timeout_s, rollout.episode_timeout_s,
                   ContextPolicy.from_config(rollout.context))


@dataclass
class Episode:
    """An episode as it grows. ``token_ids``, ``loss_mask`` and ``logprobs`` stay aligned."""

    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    prompt_length: int = 0
    turn_spans: list[tuple[int, int]] = field(default_factory=list)
    turn_versions: list[int] = field(default_factory=list)
    turn_epochs: list[int] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    # (start, end, epoch, version) per run of generated tokens from one weight version: one per turn, more
    # when a weight update came in the middle of a turn (the engine went on with the new weights).
    version_spans: list[tuple[int, int, int, int]] = field(default_factory=list)
    success: bool = False
    score: float = 0.0
    # The agent's own errors: replies the environment could not read as an action (an observation said so,
    # the episode went on). Counted, never an exception; episodes with them are trained on like any other.
    invalid_actions: int = 0
    stop_reason: str = ""
    failure: str = FAILURE_NONE
    failure_message: str = ""
    generate_s: float = 0.0
    env_s: float = 0.0
    replies: list[str] = field(default_factory=list)
    actions: list[str] = field(default_factory=list)  # the action each reply names ("" when none), for people
    observations: list[str] = field(default_factory=list)  # the first (the task), then one per turn
    # Where each sample after the first begins (a template that rewrites history: see the module docstring).
    sample_starts: list[int] = field(default_factory=list)
    system_prompt: str | None = None  # what the episode's conversation starts with (rendered prompts need it)
    # The context manager (actors/context.py): the first turn the current sample's prompt shows (0: all of them);
    # for each sample start it made, how many earlier turns that prompt does not show; the turns that are summaries
    # (no environment step), the turns whose segment starts with a summary, and a summary asked for, not yet written
    # (the latest observation it must keep).
    shown_from: int = 0
    hidden_turns_at: dict[int, int] = field(default_factory=dict)
    summary_turns: list[int] = field(default_factory=list)
    summary_heads: set[int] = field(default_factory=set)
    summary_due: str | None = None

    def transcript(self) -> list[tuple[str, str]]:
        """What the agent saw and said, in order: ("observation", text) and ("reply", text) pairs."""
        out: list[tuple[str, str]] = []
        for i, observation in enumerate(self.observations):
            out.append(("observation", observation))
            if i < len(self.replies):
                out.append(("reply", self.replies[i]))
        return out + [("reply", r) for r in self.replies[len(self.observations):]]

    def cut_to(self, max_tokens: int) -> None:
        """Keep the first ``max_tokens`` tokens: a failed episode (never trained on) whose prompt alone overflows
        the context is sent no longer than any episode the buffer accepts (its message says how long it was)."""
        del self.token_ids[max_tokens:], self.loss_mask[max_tokens:], self.logprobs[max_tokens:]
        self.prompt_length = min(self.prompt_length, len(self.token_ids))

    def append_context(self, ids: list[int]) -> None:
        self.token_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)

    def append_generated(self, ids: list[int], logprobs: list[float], weights: tuple[int, int],
                         version_spans: list[tuple[int, int, int]] | None = None) -> None:
        """A generated turn. ``version_spans`` (``Generation.version_spans``: ``(end, epoch, version)`` per run of
        tokens, ends relative to ``ids``) say which weights generated which tokens; without them the whole turn
        is ``weights`` = (epoch, version), the weights when it started."""
        start = len(self.token_ids)
        self.token_ids += ids
        self.loss_mask += [1] * len(ids)
        self.logprobs += logprobs
        self.turn_spans.append((start, len(self.token_ids)))
        runs = version_spans or [(len(ids), *weights)]
        begin = start
        for end, epoch, version in runs:
            self.version_spans.append((begin, start + end, epoch, version))
            begin = start + end
        # A turn is tagged with its oldest weights (what staleness is measured against).
        self.turn_epochs.append(runs[0][1])
        self.turn_versions.append(runs[0][2])

    @property
    def sample_start(self) -> int:
        """Where the current sample (the one the engine is prompted with) begins."""
        return self.sample_starts[-1] if self.sample_starts else 0

    @property
    def sample_ids(self) -> list[int]:
        """The current sample's ids: exactly what the engine is prompted with next (no copy for one sample)."""
        return self.token_ids[self.sample_start:] if self.sample_starts else self.token_ids

    def stop_before_turn(self, max_turns: int, max_context_tokens: int) -> bool:
        """Whether the turn budget or the context is spent (sets ``stop_reason``) before the next turn."""
        if self.env_turns >= max_turns:
            self.stop_reason = STOP_MAX_TURNS
        elif max_context_tokens - (len(self.token_ids) - self.sample_start) < 1:
            self.stop_reason = STOP_CONTEXT
        return bool(self.stop_reason)

    def close_turn(self, chat, generated_ids: list[int], result, sampling: SamplingSettings) -> bool:
        """Record the environment's answer to a turn; append the next observation — in a new segment when the next
        turn would not fit and the context policy is window, after a request for a summary (``summary_due``) when
        it is summarize. False: the episode ended."""
        self.turn_rewards.append(float(result.reward))
        self.score = float(result.score)
        self.invalid_actions += bool((result.info or {}).get("invalid_action"))
        self.observations.append(result.observation)
        if result.done:
            self.success, self.stop_reason = bool(result.success), STOP_DONE
            return False
        if getattr(chat, "append_only", True):
            continuation, branch = chat.continuation_ids(result.observation, generated_ids), False
        else:
            continuation, branch = self._rendered_next(chat)
        held = 0 if branch else len(self.token_ids) - self.sample_start
        context, window = sampling.context, None
        if (context.policy != CONTEXT_CUT and len(self.sample_starts) + 1 < context.max_segments
                and held + len(continuation) + sampling.max_tokens_per_turn + context.reserve(chat)
                > sampling.max_context_tokens):
            if context.policy == CONTEXT_SUMMARIZE and self._ask_for_summary(chat, generated_ids, sampling):
                return True
            window = windowed_prompt(self, chat, context.window_fill, sampling.max_context_tokens)
            if window is not None:
                continuation, branch, held = window[0], True, 0
        if held + len(continuation) >= sampling.max_context_tokens:
            self.stop_reason = STOP_CONTEXT
            return False
        if branch:
            self.sample_starts.append(len(self.token_ids))
        if window is not None:
            self.shown_from = self.hidden_turns_at[len(self.token_ids)] = window[1]
        self.append_context(continuation)
        return True

    def _ask_for_summary(self, chat, generated_ids: list[int], sampling: SamplingSettings) -> bool:
        """Append the latest observation with the request for a summary, if the request and the summary fit in
        the current segment (else False, and nothing changed)."""
        observation = self.observations[-1]
        self.observations[-1] = f"{observation}\n\n{SUMMARY_REQUEST}"
        if getattr(chat, "append_only", True):
            request, branch = chat.continuation_ids(self.observations[-1], generated_ids), False
        else:
            request, branch = self._rendered_next(chat)
        held = 0 if branch else len(self.token_ids) - self.sample_start
        if held + len(request) + sampling.context.summary_tokens > sampling.max_context_tokens:
            self.observations[-1] = observation
            return False
        if branch:
            self.sample_starts.append(len(self.token_ids))
        self.append_context(request)
        self.summary_due = observation
        return True

    def close_summary(self, chat, generation, weights: tuple[int, int], max_context_tokens: int) -> bool:
        """Record the summary the model wrote as a turn (reward 0, no action), then start the segment whose prompt
        is the task, the summary and the latest observation. False: not even that fits (the episode ended)."""
        self.append_generated(generation.token_ids, generation.logprobs, weights, generation.version_spans)
        summary = chat.decode(generation.token_ids)
        self.replies.append(summary)
        self.actions.append("")
        self.turn_rewards.append(0.0)
        self.summary_turns.append(self.num_turns - 1)
        self.observations.append(summary_head(self, summary, self.summary_due))
        self.summary_due = None
        first = len(self.replies)
        self.summary_heads.add(first)
        prompt = chat.conversation_ids(*shown_conversation(self, first), self.system_prompt)
        if len(prompt) >= max_context_tokens:
            self.stop_reason = STOP_CONTEXT
            return False
        self.sample_starts.append(len(self.token_ids))
        self.shown_from = self.hidden_turns_at[len(self.token_ids)] = first
        self.append_context(prompt)
        return True

    def drop_unplayed_sample(self) -> None:
        """A sample started for a turn that was never played (the turn budget ran out, a failure) is only a
        prompt: nothing to train, so it is not sent."""
        if self.sample_starts and self.sample_starts[-1] >= (self.turn_spans[-1][1] if self.turn_spans else 0):
            start = self.sample_starts.pop()
            self.hidden_turns_at.pop(start, None)
            self.cut_to(start)

    def _rendered_next(self, chat) -> tuple[list[int], bool]:
        """The next prompt rendered in full: (the ids that extend the current sample to it, False) when the
        sample is a prefix of it, else (the whole rendering, True): a new sample starts there."""
        rendered = chat.conversation_ids(*shown_conversation(self, self.shown_from), self.system_prompt)
        current = self.sample_ids
        if rendered[:len(current)] == current:
            return rendered[len(current):], False
        return rendered, True

    @property
    def reward(self) -> float:
        return float(sum(self.turn_rewards))

    @property
    def num_turns(self) -> int:
        """Every generated turn, summaries included (``env_turns``: those the environment answered)."""
        return len(self.turn_spans)

    @property
    def env_turns(self) -> int:
        return len(self.turn_spans) - len(self.summary_turns)

    @property
    def generated_tokens(self) -> int:
        return sum(e - s for s, e in self.turn_spans)


async def run_episode(
    engine: Generator,
    env: Environment,
    chat,
    task_id: int,
    *,
    max_turns: int,
    sampling: SamplingSettings,
    weights: Callable[[], tuple[int, int]] = lambda: (0, 0),
) -> Episode:
    """Play one episode of ``task_id`` for at most ``max_turns`` turns; ``weights()`` says which
    (epoch, version) of the weights generates a turn as it starts.

    Who is at fault decides what happens (every kind is counted by the actor):
    - the agent (a malformed or wrong reply): an observation from the environment; the episode goes on;
    - the environment (``EnvironmentFailure``, or any other exception raised inside ``reset``/``step``:
      a crash, a timeout, a lost server session, a bug in the environment's code): ``failure="environment"``;
    - the engine (an exception from generation, or no tokens): ``failure="engine"``;
    - the task (its first prompt alone does not fit in the context): ``failure="prompt_too_long"``;
    - the clock (a generation over ``turn_timeout_s``, or the episode over ``episode_timeout_s``: a hung
      environment step, an engine that does not answer): ``failure="timeout"``, the call abandoned;
    - anything else is a bug of this code (the chat layout, the bookkeeping) and propagates: the
      actor crashes loudly rather than fill the buffer with episodes it cannot vouch for.
    A failed episode is returned so it can be counted, but it is never trained on.
    """
    ep = Episode(system_prompt=sampling.system_prompt)
    clock = _Deadline(sampling.episode_timeout_s)
    try:
        observation = await _timed_env(ep, env.reset(task_id), clock.left())
        ep.observations.append(observation)
        ep.append_context(chat.prompt_ids(observation, sampling.system_prompt))
        ep.prompt_length = len(ep.token_ids)
        if ep.prompt_length >= sampling.max_context_tokens:
            ep.failure, ep.stop_reason = FAILURE_PROMPT_TOO_LONG, STOP_FAILURE
            ep.failure_message = (f"the first prompt has {ep.prompt_length} tokens; rollout.max_context_tokens is "
                                  f"{sampling.max_context_tokens}")
            ep.cut_to(sampling.max_context_tokens)
            return ep
        while not ep.stop_before_turn(max_turns, sampling.max_context_tokens):
            prompt = ep.sample_ids
            room = sampling.max_context_tokens - len(prompt)
            turn_weights = weights()
            gen = await _timed_generate(ep, engine.generate(
                prompt,
                max_tokens=min(sampling.max_tokens_per_turn, room),
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                stop_token_ids=chat.stop_token_ids,
            ), clock.left(sampling.turn_timeout_s))
            ep.append_generated(gen.token_ids, gen.logprobs, turn_weights, gen.version_spans)
            reply = chat.decode(gen.token_ids)
            ep.replies.append(reply)
            ep.actions.append(extract_action(reply, getattr(env, "reply_format", "react")))
            result = await _timed_env(ep, env.step(reply), clock.left())
            if not ep.close_turn(chat, gen.token_ids, result, sampling):
                break
            if ep.summary_due is not None and not await _summarize(ep, engine, chat, sampling, weights, clock):
                break
    except _EpisodeFailed as failed:
        ep.failure, ep.failure_message, ep.stop_reason = failed.kind, failed.message[:500], STOP_FAILURE
    ep.drop_unplayed_sample()
    return ep


async def _summarize(ep: Episode, engine: Generator, chat, sampling: SamplingSettings,
                     weights: Callable[[], tuple[int, int]], clock: "_Deadline") -> bool:
    """The summary turn the context manager asked for (``Episode.close_summary``). False: the episode ended."""
    prompt = ep.sample_ids
    turn_weights = weights()
    gen = await _timed_generate(ep, engine.generate(
        prompt, max_tokens=min(sampling.context.summary_tokens, sampling.max_context_tokens - len(prompt)),
        temperature=sampling.temperature, top_p=sampling.top_p, stop_token_ids=chat.stop_token_ids,
    ), clock.left(sampling.turn_timeout_s))
    return ep.close_summary(chat, gen, turn_weights, sampling.max_context_tokens)


class _EpisodeFailed(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind, self.message = kind, message


class _Deadline:
    """The episode's wall-clock budget: how long the next call may take (None: unbounded)."""

    def __init__(self, episode_timeout_s: float | None) -> None:
        self.timeout_s = episode_timeout_s
        self.end = None if episode_timeout_s is None else time.monotonic() + episode_timeout_s

    def left(self, call_limit_s: float | None = None) -> float | None:
        limits = [x for x in (call_limit_s, None if self.end is None else self.end - time.monotonic()) if x is not None]
        if limits and min(limits) <= 0:
            raise _EpisodeFailed(FAILURE_TIMEOUT, f"the episode ran past rollout.episode_timeout_s={self.timeout_s}")
        return min(limits) if limits else None


async def _within(call: Awaitable[T], limit_s: float | None, what: str) -> T:
    try:
        return await asyncio.wait_for(call, limit_s)
    except asyncio.TimeoutError:
        raise _EpisodeFailed(FAILURE_TIMEOUT, f"{what} took longer than {limit_s:.1f} s; abandoned") from None


async def _timed_env(ep: Episode, call: Awaitable[T], limit_s: float | None = None) -> T:
    start = time.perf_counter()
    try:
        return await _within(call, limit_s, "an environment call")
    except _EpisodeFailed:
        raise
    except EnvironmentFailure as exc:
        raise _EpisodeFailed(FAILURE_ENVIRONMENT, str(exc)) from exc
    except Exception as exc:  # noqa: BLE001 - the environment's code failed, not ours and not the agent
        log.exception("the environment raised %s (counted as an environment failure)", type(exc).__name__)
        raise _EpisodeFailed(FAILURE_ENVIRONMENT, f"{type(exc).__name__}: {exc}") from exc
    finally:
        ep.env_s += time.perf_counter() - start


async def _timed_generate(ep: Episode, call: Awaitable[Any], limit_s: float | None = None) -> Any:
    start = time.perf_counter()
    try:
        gen = await _within(call, limit_s, "a generation")  # cancelling it aborts the engine's request
    except _EpisodeFailed:
        raise
    except Exception as exc:  # noqa: BLE001 - the engine failed this request
        log.exception("generation failed (counted as an engine failure)")
        raise _EpisodeFailed(FAILURE_ENGINE, f"{type(exc).__name__}: {exc}") from exc
    finally:
        ep.generate_s += time.perf_counter() - start
    if not gen.token_ids:
        raise _EpisodeFailed(FAILURE_ENGINE, f"the engine returned no tokens (finish_reason={gen.finish_reason})")
    return gen
