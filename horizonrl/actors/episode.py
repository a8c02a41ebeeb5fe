"""One episode, token-in/token-out.

The sequence the learner trains on is built here, incrementally, exactly as the engine
saw it: the prompt ids, then for each turn the generated ids (loss mask 1, with their
behaviour logprobs) and the observation's ids (loss mask 0). Model output is never
re-tokenized, so an episode's tokens cannot drift from what was sampled.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

from horizonrl.envs.base import Environment, EnvironmentFailure
from horizonrl.protocol import (
    FAILURE_ENGINE,
    FAILURE_ENVIRONMENT,
    FAILURE_NONE,
    STOP_CONTEXT,
    STOP_DONE,
    STOP_FAILURE,
    STOP_MAX_TURNS,
)

log = logging.getLogger("horizonrl.actors.episode")


class Generator(Protocol):
    async def generate(self, prompt_ids: list[int], *, max_tokens: int, temperature: float, top_p: float,
                       stop_token_ids: list[int]): ...


@dataclass(frozen=True)
class SamplingSettings:
    temperature: float
    top_p: float
    max_tokens_per_turn: int
    max_context_tokens: int
    system_prompt: str | None = None


@dataclass
class Episode:
    """An episode as it grows. ``token_ids``, ``loss_mask`` and ``logprobs`` stay aligned."""

    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    prompt_length: int = 0
    turn_spans: list[tuple[int, int]] = field(default_factory=list)
    turn_versions: list[int] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    success: bool = False
    score: float = 0.0
    stop_reason: str = ""
    failure: str = FAILURE_NONE
    failure_message: str = ""
    generate_s: float = 0.0
    env_s: float = 0.0
    replies: list[str] = field(default_factory=list)

    def append_context(self, ids: list[int]) -> None:
        self.token_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)

    def append_generated(self, ids: list[int], logprobs: list[float], version: int) -> None:
        start = len(self.token_ids)
        self.token_ids += ids
        self.loss_mask += [1] * len(ids)
        self.logprobs += logprobs
        self.turn_spans.append((start, len(self.token_ids)))
        self.turn_versions.append(version)

    def stop_before_turn(self, max_turns: int, max_context_tokens: int) -> bool:
        """Whether the turn budget or the context is spent (sets ``stop_reason``) before the next turn."""
        if self.num_turns >= max_turns:
            self.stop_reason = STOP_MAX_TURNS
        elif max_context_tokens - len(self.token_ids) < 1:
            self.stop_reason = STOP_CONTEXT
        return bool(self.stop_reason)

    def close_turn(self, chat, generated_ids: list[int], result, max_context_tokens: int) -> bool:
        """Record the environment's answer to a turn; append the next observation. False: the episode ended."""
        self.turn_rewards.append(float(result.reward))
        self.score = float(result.score)
        if result.done:
            self.success, self.stop_reason = bool(result.success), STOP_DONE
            return False
        continuation = chat.continuation_ids(result.observation, generated_ids)
        if len(self.token_ids) + len(continuation) >= max_context_tokens:
            self.stop_reason = STOP_CONTEXT
            return False
        self.append_context(continuation)
        return True

    @property
    def reward(self) -> float:
        return float(sum(self.turn_rewards))

    @property
    def num_turns(self) -> int:
        return len(self.turn_spans)

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
    weight_version: Callable[[], int],
) -> Episode:
    """Play one episode of ``task_id`` for at most ``max_turns`` turns.

    Environment failures end the episode with ``failure="environment"``; the episode is
    returned (so it can be counted) but must never be trained on.
    """
    ep = Episode()
    try:
        t0 = time.perf_counter()
        observation = await env.reset(task_id)
        ep.env_s += time.perf_counter() - t0
        ep.append_context(chat.prompt_ids(observation, sampling.system_prompt))
        ep.prompt_length = len(ep.token_ids)
        while not ep.stop_before_turn(max_turns, sampling.max_context_tokens):
            room = sampling.max_context_tokens - len(ep.token_ids)
            version = weight_version()
            t0 = time.perf_counter()
            gen = await engine.generate(
                ep.token_ids,
                max_tokens=min(sampling.max_tokens_per_turn, room),
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                stop_token_ids=chat.stop_token_ids,
            )
            ep.generate_s += time.perf_counter() - t0
            if not gen.token_ids:
                raise RuntimeError(f"engine returned no tokens (finish_reason={gen.finish_reason})")
            ep.append_generated(gen.token_ids, gen.logprobs, version)
            reply = chat.decode(gen.token_ids)
            ep.replies.append(reply)
            t0 = time.perf_counter()
            result = await env.step(reply)
            ep.env_s += time.perf_counter() - t0
            if not ep.close_turn(chat, gen.token_ids, result, sampling.max_context_tokens):
                break
    except EnvironmentFailure as exc:
        ep.failure, ep.failure_message, ep.stop_reason = FAILURE_ENVIRONMENT, str(exc)[:500], STOP_FAILURE
    except Exception as exc:  # noqa: BLE001 - an engine error fails this episode, counted, not the actor
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        log.exception("episode of task %d failed in generation", task_id)
        ep.failure, ep.failure_message, ep.stop_reason = FAILURE_ENGINE, repr(exc)[:500], STOP_FAILURE
    return ep
