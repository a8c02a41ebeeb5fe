"""What an episode does when its next turn would not fit in the context (``rollout.context``; docs/horizon.md).

Both policies that go on carry the episode into a new *segment*: a sample of its own (``Episode.sample_starts``),
trained with the episode's advantage, token-exact, exactly like the samples of a chat template that rewrites
history. They differ in what the new segment's prompt holds:

- **window**: the system prompt, one user message with the task, a note ``[k earlier turns not shown]`` and the
  observation the first kept turn answered, then the newest turns as they were — as many as fit in
  ``window_fill`` of the context;
- **summarize**: the model is first asked, in the segment that is full, to summarize the episode so far; its
  summary is a turn of its own (trained as an action, reward 0, no environment step, not counted against the turn
  budget: ``Episode.summary_turns``). The new segment's prompt is one user message: the task, the summary and the
  latest observation. So the model learns what to keep: a summary that keeps what the rest of the episode needs
  shares in the return that follows.

A segment starts as soon as a whole turn (``max_tokens_per_turn``, and for summarize the request and the summary
too) would no longer fit, so no reply is cut short by the context; past ``max_segments`` segments the episode
ends at the context as with ``cut``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the episode's state; this module only reads and extends it
    from horizonrl.actors.episode import Episode

CONTEXT_CUT = "cut"  # the episode ends where its next turn would not fit
CONTEXT_WINDOW = "window"  # it goes on in a new segment whose prompt drops the oldest turns
CONTEXT_SUMMARIZE = "summarize"  # the model summarizes the episode; the summary replaces the history

SUMMARY_REQUEST = ("[The context is full. Before you act, write a summary of this episode so far: the task, what "
                   "you did and what you learned. It will replace the history. Reply with the summary only.]")


@dataclass(frozen=True)
class ContextPolicy:
    """``rollout.context``, as the episode loop uses it."""

    policy: str = CONTEXT_CUT
    window_fill: float = 0.5  # window: a new segment's prompt holds at most this share of the context
    max_segments: int = 4  # the episode ends at the context rather than start a segment past this many
    summary_tokens: int = 128  # summarize: the longest summary

    @classmethod
    def from_config(cls, context) -> "ContextPolicy":
        return cls(context.policy, context.window_fill, context.max_segments, context.summary_tokens)

    def reserve(self, chat) -> int:
        """Tokens to keep free after a turn so that the policy can still act: the request and the summary."""
        if self.policy != CONTEXT_SUMMARIZE:
            return 0
        return self.summary_tokens + summary_request_tokens(chat) + 8  # 8: the template's markers (an estimate:
        # Episode._ask_for_summary checks the real length, so a wrong one moves the fallback to a window, never
        # past the context)


@functools.lru_cache(maxsize=8)
def summary_request_tokens(chat) -> int:
    """The summary request's length in ``chat``'s tokens: encoded once per tokenizer, not after every turn."""
    return len(chat.encode(f"\n\n{SUMMARY_REQUEST}"))


def shown_conversation(ep: Episode, first: int, turns: int | None = None) -> tuple[list[str], list[str]]:
    """(observations, replies) of a prompt that shows the turns from ``first`` on, of the first ``turns`` turns
    (default: all played so far). ``first`` 0: the whole conversation. A summary's segment starts with its own
    message (the task, the summary, the latest observation); a window's with the task, a note of how many turns
    are not shown and the observation the turn ``first`` answered, as one user message."""
    turns = len(ep.replies) if turns is None else turns
    observations, replies = ep.observations[:turns + 1], ep.replies[:turns]
    if first == 0:
        return observations, replies
    if first in ep.summary_heads:
        return observations[first:], replies[first:]
    # A window after a summary keeps the summary's message (the task and the summary) in the task's place.
    summary = max((head for head in ep.summary_heads if head < first), default=0)
    dropped = first - summary
    turns_text = f"{dropped} {'earlier ' if not summary else ''}turn{'' if dropped == 1 else 's'}"
    note = f"[{turns_text}{' since the summary' if summary else ''} not shown]"
    head = f"{observations[summary]}\n\n{note}\n\n{observations[first]}"
    return [head, *observations[first + 1:]], replies[first:]


def windowed_prompt(ep: Episode, chat, fill: float, max_context_tokens: int) -> tuple[list[int], int] | None:
    """The next segment's prompt and the first turn it shows: as many of the newest turns as fit in ``fill`` of
    the context, else only the task and the latest observation. None: that leaves no room for a turn either."""
    budget = int(fill * max_context_tokens)
    newest = len(ep.replies)
    for first in range(ep.shown_from + 1, newest + 1):  # the fewest turns dropped first
        ids = chat.conversation_ids(*shown_conversation(ep, first), ep.system_prompt)
        if len(ids) <= budget or (first == newest and len(ids) < max_context_tokens):
            return ids, first
    return None


def summary_head(ep: Episode, summary: str, latest_observation: str) -> str:
    """The one user message a summary's segment starts with."""
    done = ep.env_turns  # the environment turns the summary covers (it is recorded as a turn already)
    return (f"{ep.observations[0]}\n\n[Your summary of the {done} turn{'' if done == 1 else 's'} so far]\n"
            f"{summary.strip()}\n\n{latest_observation}")
