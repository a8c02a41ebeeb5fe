"""What each process reports in its ``Heartbeat``: one struct per role and kind, so that the process that
counts and the coordinator that decides and charts name the same field, and a renamed counter fails
both at once instead of reading 0 forever.

Two kinds, because the coordinator adds them up differently across a process's incarnations (a
restarted process counts from 0 again):
- *counters* are cumulative over one incarnation: the coordinator adds every incarnation's last value
  (episodes played, seconds stalled);
- *gauges* are levels of the current incarnation: a dead one's last value is nobody's state any more
  (episodes in progress, groups ready in the buffer).

On the wire the heartbeat keeps its flat ``{name: number}`` map (:func:`heartbeat_counters`), so a
process also sends diagnostics no other process reads (by-reason counts, say) beside the typed fields;
:func:`read_counters` is the typed view of such a map. A field whose metadata names a TensorBoard
scalar (:func:`scalar`) is charted by the coordinator under that name (:func:`charted`): a loop over
the struct, not a list of names kept by hand.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Mapping, TypeVar

import msgspec

from horizonrl.protocol.messages import (
    ACK_ACCEPTED,
    ACK_DUPLICATE,
    ACK_REJECTED,
    FAILURE_ENGINE,
    FAILURE_ENVIRONMENT,
    FAILURE_PROMPT_TOO_LONG,
    FAILURE_TIMEOUT,
    STOP_CONTEXT,
    STOP_DONE,
    STOP_MAX_TURNS,
)

T = TypeVar("T", bound=msgspec.Struct)


def scalar(name: str) -> msgspec.Meta:
    """The field is charted in TensorBoard (and W&B) as ``name``, at every learner step."""
    return msgspec.Meta(extra={"scalar": name})


class ActorCounters(msgspec.Struct, kw_only=True):
    """Cumulative over one actor incarnation."""

    role: ClassVar[str] = "actor"

    # episodes played for training (held-out evaluations are counted under eval_*)
    episodes: Annotated[float, scalar("rollout/episodes_total")] = 0.0
    generated_tokens: Annotated[float, scalar("rollout/generated_tokens_total")] = 0.0
    turns: float = 0.0
    abandoned_episodes: float = 0.0  # in progress when the actor stopped: never produced, never sent
    # of those, the ones that failed for a reason not the agent's, by kind (never trained on)
    failures_environment: Annotated[float, scalar("rollout/failures/environment")] = 0.0
    failures_engine: Annotated[float, scalar("rollout/failures/engine")] = 0.0
    failures_prompt_too_long: Annotated[float, scalar("rollout/failures/prompt_too_long")] = 0.0
    failures_timeout: Annotated[float, scalar("rollout/failures/timeout")] = 0.0
    # the rest, the agent's own: how they ended, how they did
    completed: float = 0.0
    successes: float = 0.0
    reward_sum: float = 0.0
    completed_turns: float = 0.0
    stop_done: Annotated[float, scalar("rollout/stop/done")] = 0.0
    stop_max_turns: Annotated[float, scalar("rollout/stop/max_turns")] = 0.0
    stop_context_limit: Annotated[float, scalar("rollout/stop/context_limit")] = 0.0
    invalid_actions: Annotated[float, scalar("rollout/agent/invalid_actions")] = 0.0  # replies naming no valid action
    # segments the context manager started (rollout.context: a window or a summary): episodes went on past the context
    context_windows: Annotated[float, scalar("rollout/context_windows")] = 0.0
    # weights: joins of the hub, updates, and the engine's time spent on them
    weight_joins: float = 0.0
    weight_updates: Annotated[float, scalar("rollout/weight_updates")] = 0.0
    weight_versions_skipped: Annotated[float, scalar("rollout/weight_versions_skipped")] = 0.0
    weight_receive_failures: float = 0.0
    weight_stall_s: Annotated[float, scalar("rollout/weight_stall_s")] = 0.0  # the engine generated nothing
    weight_transfer_s: Annotated[float, scalar("rollout/weight_transfer_s")] = 0.0
    weight_load_s: Annotated[float, scalar("rollout/weight_load_s")] = 0.0
    weight_pause_wait_s: Annotated[float, scalar("rollout/weight_pause_wait_s")] = 0.0  # ending a step: not stall
    weights_wait_s: float = 0.0  # waiting for the weights a held-out evaluation asked for
    continued_requests: Annotated[float, scalar("rollout/continued_requests")] = 0.0
    kept_requests: Annotated[float, scalar("rollout/kept_requests")] = 0.0
    lost_stage_messages: Annotated[float, scalar("rollout/lost_stage_messages")] = 0.0
    # the engine's clock: what `horizonrl bench` and idle-share plots read
    engine_idle_s: Annotated[float, scalar("rollout/engine_idle_s_total")] = 0.0
    engine_wall_s: Annotated[float, scalar("rollout/engine_wall_s_total")] = 0.0
    engine_request_s: Annotated[float, scalar("rollout/engine_request_s_total")] = 0.0
    paused_s: Annotated[float, scalar("rollout/paused_s")] = 0.0  # the coordinator paused the rollout
    # the engine's KV cache (rollout.concurrency, actors/concurrency.py): requests it preempted (dropped their KV
    # blocks to recompute them later), and how often the adaptive number of groups in flight changed
    engine_preemptions: Annotated[float, scalar("rollout/engine_preemptions")] = 0.0
    in_flight_changes: Annotated[float, scalar("rollout/in_flight_changes")] = 0.0
    # held-out evaluations during training (eval.every)
    eval_runs: float = 0.0
    eval_episodes: float = 0.0
    eval_s: float = 0.0

    def count_failure(self, kind: str) -> None:
        """One episode that failed with ``kind`` (protocol/messages.py's FAILURE_*)."""
        field = _FAILURE_FIELDS[kind]
        setattr(self, field, getattr(self, field) + 1)

    def count_stop(self, reason: str) -> None:
        """One of the agent's episodes that ended for ``reason`` (STOP_DONE, STOP_MAX_TURNS, STOP_CONTEXT)."""
        field = _STOP_FIELDS[reason]
        setattr(self, field, getattr(self, field) + 1)


_FAILURE_FIELDS = {FAILURE_ENVIRONMENT: "failures_environment", FAILURE_ENGINE: "failures_engine",
                   FAILURE_PROMPT_TOO_LONG: "failures_prompt_too_long", FAILURE_TIMEOUT: "failures_timeout"}
_STOP_FIELDS = {STOP_DONE: "stop_done", STOP_MAX_TURNS: "stop_max_turns", STOP_CONTEXT: "stop_context_limit"}


class DeliveryCounters(msgspec.Struct, kw_only=True):
    """Cumulative over one actor incarnation: its deliveries to the buffer (actors/delivery.py)."""

    role: ClassVar[str] = "actor"

    sent: float = 0.0
    send_wait_s: Annotated[float, scalar("rollout/send_wait_s")] = 0.0  # waiting for room among the unacknowledged
    resent: float = 0.0
    outbox_recovered: float = 0.0  # unacknowledged at a restart, sent again
    acked_accepted: float = 0.0
    acked_duplicate: float = 0.0
    acked_rejected: float = 0.0
    bad_acks: float = 0.0

    def count_ack(self, status: str) -> None:
        """One acknowledgement with ``status`` (protocol/messages.py's ACK_*; another is a bad one)."""
        field = _ACK_FIELDS.get(status, "bad_acks")
        setattr(self, field, getattr(self, field) + 1)


_ACK_FIELDS = {ACK_ACCEPTED: "acked_accepted", ACK_DUPLICATE: "acked_duplicate", ACK_REJECTED: "acked_rejected"}


class ActorGauges(msgspec.Struct, kw_only=True):
    """Levels of the current actor incarnation."""

    role: ClassVar[str] = "actor"

    episodes_in_progress: float = 0.0  # lost if this incarnation dies now
    unacknowledged: float = 0.0  # trajectories sent that the buffer has not acknowledged
    weight_epoch: float = 0.0  # the weights its engine holds
    weight_version: float = 0.0
    groups_in_flight: float = 0.0  # group slots running (rollout.concurrency)
    groups_running: float = 0.0  # groups being played now (their trajectories not yet sent): the rollout's admission
    kv_cache_usage: float = 0.0  # the engine's share of KV blocks in use, 0-1 (0 where it does not report it)


class BufferGauges(msgspec.Struct, kw_only=True):
    """Levels of the current buffer incarnation (the rest of its numbers are diagnostics: buffer/groups.py)."""

    role: ClassVar[str] = "buffer"

    ready_groups: float = 0.0  # whole groups waiting for the learner: the coordinator pauses the rollout at capacity
    pending_groups: float = 0.0  # groups still missing members
    in_flight_trajectories: float = 0.0  # handed to a learner step that is not yet committed
    held_trajectories: float = 0.0
    committed_step: float = 0.0


class LearnerCounters(msgspec.Struct, kw_only=True):
    """What learner rank 0 has done in this incarnation (learner/loop.py)."""

    role: ClassVar[str] = "learner"

    step: float = 0.0  # a level: the newest step
    weight_version: float = 0.0  # a level: the newest version published
    trajectories_trained: float = 0.0
    tokens_trained: float = 0.0
    failed_skipped: float = 0.0  # failed trajectories in the batches, left out
    # a checkpoint the disk refused, written again (a fault of the machine, not a restart: learner/services.py)
    checkpoint_write_retries: Annotated[float, scalar("faults/checkpoint_write_retries")] = 0.0


def heartbeat_counters(*parts: msgspec.Struct, extra: Mapping[str, float] | None = None) -> dict[str, float]:
    """The wire form of a heartbeat's counters: the diagnostics in ``extra``, then every field of ``parts``."""
    out = {str(k): float(v) for k, v in (extra or {}).items()}
    for part in parts:
        out.update({name: float(value) for name, value in msgspec.structs.asdict(part).items()})
    return out


def read_counters(kind: type[T], counters: Mapping[str, Any]) -> T:
    """``kind``'s fields out of a heartbeat's counters: names it does not have are left out, missing ones are 0
    (a process of another version, or one that has not counted anything yet)."""
    fields = set(kind.__struct_fields__)
    return msgspec.convert({k: v for k, v in counters.items() if k in fields}, kind)


def added(kind: type[T], many: list[T]) -> T:
    """Field by field, the sum of ``many`` (every incarnation's last counters, or every process's gauges)."""
    return kind(**{name: float(sum(getattr(one, name) for one in many)) for name in kind.__struct_fields__})


def charted(counts: msgspec.Struct) -> dict[str, float]:
    """The fields of ``counts`` that are charted, by their TensorBoard name."""
    info = msgspec.inspect.type_info(type(counts))
    out = {}
    for field in info.fields:
        name = _scalar_name(field.type)
        if name is not None:
            out[name] = float(getattr(counts, field.name))
    return out


def _scalar_name(field_type: msgspec.inspect.Type) -> str | None:
    extra = getattr(field_type, "extra", None) or {}
    return extra.get("scalar")
