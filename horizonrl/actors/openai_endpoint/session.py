"""One agent session: one episode, recorded token for token from the agent's model calls.

The agent keeps its own history and sends all of it with every call. The session keeps what the engine really
saw and generated (``actors/episode.py``'s :class:`Episode`: token ids, loss mask, behaviour logprobs, turn
spans, weight versions, samples), and decides for each call how its prompt relates to them:

- the first call: the template's rendering of the request (:class:`ChatRenderer`) is the prompt;
- **append**: the request is the previous one, then the assistant message the endpoint answered (one of its
  ``n`` choices: the one the agent kept), then new messages (tool results, a user turn), with the same tools,
  and the template renders the previous prompt unchanged at the start of this one. The prompt is then the
  tokens held (the previous prompt and the generated tokens, *as generated*), the end-of-turn token if
  generation stopped without it, and the template's text for the new messages after the kept reply's
  end-of-turn: what a stock server would have sent, but with the model's own tokens where it would have
  re-tokenized the reply's text;
- **extend**: anything else whose full rendering still begins with the tokens held: the rest is appended;
- **branch**: anything else (the agent dropped, edited or summarized history, changed the tools, or the template
  rewrites history, as Qwen3's does): the current sample ends and a new one starts whose prompt is the full
  rendering, as ``episode.py`` branches for such templates.

A call's choices wait (``pending``) until the next call shows which one the agent kept; that one becomes the
turn, the others are counted (``unadopted_choices``) and dropped. When no choice was kept (a branch), or when
the session ends, the first choice is the turn. So each call is exactly one turn of the episode.

A session's state changes only after its call's generation succeeded (:meth:`plan` is pure, :meth:`record`
applies), and calls of one session are serialized by its lock: a refused or failed call leaves the episode as
it was. Each session owns its ``Episode``; nothing in it is shared with another session.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from horizonrl.actors.episode import Episode
from horizonrl.actors.openai_endpoint.rendering import ChatRenderer
from horizonrl.actors.openai_endpoint.tool_calls import ToolCall
from horizonrl.actors.openai_endpoint.wire import ChatMessage, ChatRequest, RequestError
from horizonrl.protocol import FAILURE_ENVIRONMENT, STOP_CONTEXT, STOP_DONE, STOP_FAILURE, STOP_MAX_TURNS

PLAN_FIRST, PLAN_APPEND, PLAN_EXTEND, PLAN_BRANCH = "first", "append", "extend", "branch"


@dataclass
class Choice:
    """One completion of a call, as generated (``ids`` cut after a stop string) and as the agent was shown it."""

    ids: list[int]
    logprobs: list[float]
    version_spans: list[tuple[int, int, int]]
    weights: tuple[int, int]
    finish_reason: str  # stop | length | tool_calls
    text: str  # the decoded reply (tool-call markup included)
    message: ChatMessage  # what the agent was answered
    tool_call_ids: tuple[str, ...] = ()
    parse_error: str = ""


@dataclass(frozen=True)
class PromptPlan:
    """How a call's prompt is made from the session's tokens (see the module docstring)."""

    kind: str
    prompt_ids: list[int]  # the whole prompt the engine is given (the current sample once recorded)
    new_ids: list[int]  # what recording appends after the kept choice (the whole prompt on first and branch)
    adopted: int | None  # the index of the previous call's choice the agent kept (None: first call, or none kept)
    text: str  # the rendering of the request (the next call compares against it)


@dataclass
class AgentSession:
    """State of one episode played by an agent through the endpoint."""

    session_id: str
    renderer: ChatRenderer
    max_turns: int
    max_context_tokens: int
    env_name: str = "agent"
    task_id: int = 0
    group_id: str = ""
    group_size: int = 1
    env: Any = None  # a project environment that verifies the outcome (reset by the opener), or None
    episode: Episode = field(default_factory=Episode)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    pending: list[Choice] = field(default_factory=list)
    previous: ChatRequest | None = None
    previous_text: str = ""
    call_rewards: list[float] = field(default_factory=list)
    early_reward: float = 0.0  # environment rewards before the first model call (they go to the first turn)
    agent_reward: float | None = None  # POST .../reward (sessions without an environment)
    env_done: bool = False
    last_env_observation: str | None = None
    calls: int = 0
    branches: int = 0
    unadopted_choices: int = 0
    tool_parse_failures: int = 0
    finished: bool = False  # finish() ran: the episode is handed over, no more calls
    failure: str = ""  # not the agent's fault (its environment failed, the agent program crashed or hung)
    failure_message: str = ""
    last_used: float = field(default_factory=time.monotonic)
    closed: asyncio.Future | None = None  # set to the Episode when the session ends (its opener may wait on it)

    # ----------------------------------------------------------------- calls

    def check_open_for_call(self) -> None:
        """RequestError unless one more model call may be made (turn budget, environment still going)."""
        if self.finished:
            raise RequestError(404, f"session {self.session_id} is closed", "unknown_session")
        if self.env_done:
            raise RequestError(400, "the episode is over: its environment said done; close the session",
                               "episode_over")
        if self.calls >= self.max_turns:
            self.episode.stop_reason = STOP_MAX_TURNS
            raise RequestError(400, f"the turn budget of this episode is spent: {self.max_turns} model calls; close "
                                    "the session", "turn_budget_exhausted")

    def plan(self, request: ChatRequest) -> PromptPlan:
        """The prompt of ``request`` (pure: nothing changes until :meth:`record`). RequestError when the template
        cannot render it, or it does not fit in the context."""
        text = self.renderer.render(request.messages, request.tools, add_generation_prompt=True)
        plan = self._plan(request, text)
        if len(plan.prompt_ids) >= self.max_context_tokens:
            if self.calls:
                self.episode.stop_reason = STOP_CONTEXT
            raise RequestError(400, f"the prompt has {len(plan.prompt_ids)} tokens; this model's context holds "
                                    f"{self.max_context_tokens} (close the session, or shorten the history)",
                               "context_length_exceeded", "messages")
        return plan

    def _plan(self, request: ChatRequest, text: str) -> PromptPlan:
        if self.previous is None:
            ids = self.renderer.encode(text)
            return PromptPlan(PLAN_FIRST, ids, ids, None, text)
        adopted = self._adopted(request.messages)
        kept = self.pending[adopted if adopted is not None else 0]
        held = self.episode.sample_ids + kept.ids
        eot_token, eot_id = self.renderer.chat.end_of_turn_token, self.renderer.chat.end_of_turn_id
        if adopted is not None and request.tools == self.previous.tools and text.startswith(self.previous_text):
            end = text.find(eot_token, len(self.previous_text))
            if end >= 0:  # the kept reply's end of turn in the rendering; what follows is new
                new = ([] if kept.ids[-1:] == [eot_id] else [eot_id]) + self.renderer.encode(
                    text[end + len(eot_token):])
                return PromptPlan(PLAN_APPEND, held + new, new, adopted, text)
        full = self.renderer.encode(text)
        if len(full) > len(held) and full[:len(held)] == held:
            return PromptPlan(PLAN_EXTEND, full, full[len(held):], adopted, text)
        return PromptPlan(PLAN_BRANCH, full, full, adopted, text)

    def _adopted(self, messages: tuple[ChatMessage, ...]) -> int | None:
        """Which pending choice the request carries right after the previous request's messages (None: none)."""
        before = self.previous.messages
        if len(messages) <= len(before) or messages[:len(before)] != before:
            return None
        sent = messages[len(before)]
        return next((i for i, choice in enumerate(self.pending) if choice.message == sent), None)

    def record(self, request: ChatRequest, plan: PromptPlan, choices: list[Choice]) -> None:
        """Apply a call whose generation succeeded: the kept choice of the previous call becomes its turn, the
        prompt's new tokens are appended (a new sample on a branch), and ``choices`` wait for the next call."""
        ep = self.episode
        if plan.kind == PLAN_FIRST:
            ep.append_context(plan.new_ids)
            ep.prompt_length = len(ep.token_ids)
            if not ep.observations:  # a session with an environment has its first observation already
                ep.observations.append(request.messages[-1].content)
        else:
            self._commit_pending(plan.adopted)
            new_messages = request.messages[len(self.previous.messages) + 1:] if plan.adopted is not None \
                else request.messages
            ep.observations.append("\n".join(m.content for m in new_messages))
            if plan.kind == PLAN_BRANCH:
                ep.sample_starts.append(len(ep.token_ids))
                self.branches += 1
            ep.append_context(plan.new_ids)
        self.pending, self.previous, self.previous_text = choices, request, plan.text
        if ep.stop_reason == STOP_CONTEXT:  # an earlier call did not fit; the agent shortened its history
            ep.stop_reason = ""
        self.calls += 1
        self.call_rewards.append(0.0)
        self.tool_parse_failures += sum(bool(c.parse_error) for c in choices)
        self.last_used = time.monotonic()

    def _commit_pending(self, adopted: int | None) -> None:
        if not self.pending:
            return
        kept = self.pending[adopted if adopted is not None else 0]
        self.unadopted_choices += len(self.pending) - 1
        ep = self.episode
        ep.append_generated(kept.ids, kept.logprobs, kept.weights, kept.version_spans)
        ep.replies.append(kept.text)
        ep.actions.append("; ".join(_call_text(c) for c in kept.message.tool_calls))
        ep.invalid_actions += bool(kept.parse_error)
        self.pending = []

    # ----------------------------------------------------------------- outcome

    def add_env_reward(self, reward: float, done: bool, success: bool, score: float,
                       invalid_action: bool = False) -> None:
        """An environment step's result: its reward goes to the latest model call's turn; an action the
        environment could not read counts as the agent's invalid action (as in ``episode.py``)."""
        self.episode.invalid_actions += bool(invalid_action)
        if self.call_rewards:
            self.call_rewards[-1] += reward
        else:
            self.early_reward += reward
        self.episode.success, self.episode.score = success, score
        if done:
            self.env_done = True
            self.episode.stop_reason = STOP_DONE

    def set_agent_reward(self, reward: float, success: bool | None, score: float | None) -> None:
        """The agent's verdict on its episode (``POST .../reward``): the outcome reward, on the last turn."""
        self.agent_reward = reward
        self.episode.success = reward > 0 if success is None else success
        self.episode.score = reward if score is None else score

    def finish(self) -> Episode:
        """End the episode: the last call's choice becomes its last turn, the rewards go on the turns."""
        self.finished = True
        self._commit_pending(None)
        ep = self.episode
        ep.turn_rewards = list(self.call_rewards[:ep.num_turns])
        if ep.turn_rewards:
            ep.turn_rewards[0] += self.early_reward
            if self.agent_reward is not None:
                ep.turn_rewards[-1] += self.agent_reward
        if self.failure:
            ep.failure, ep.stop_reason, ep.failure_message = self.failure, STOP_FAILURE, self.failure_message[:500]
        elif not ep.num_turns:
            ep.failure, ep.stop_reason = FAILURE_ENVIRONMENT, STOP_FAILURE
            ep.failure_message = "the agent ended its session without a model call"
        elif not ep.stop_reason:
            ep.stop_reason = STOP_DONE  # the agent ended it
        return ep


def _call_text(call: ToolCall) -> str:
    return f"{call.name}({call.arguments_json()})"
