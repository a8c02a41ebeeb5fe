"""The records of the buffer's write-ahead log, and how each one changes the buffer's state.

Every change of the buffer's state is one of these records, appended (and durable, per the fsync
policy) before anything depending on it leaves the process — an acknowledgement to an actor, a
batch to the learner. Replaying the records in order through :func:`apply` rebuilds the state
(``groups.GroupBuffer`` is deterministic given it). Compaction replaces the payload of a resolved
trajectory (trained into a checkpoint, or dropped) with a ``Resolved`` stub, which keeps its id
and fate for de-duplication and accounting.
"""

from __future__ import annotations

import hashlib

import msgspec

from horizonrl.buffer.groups import GroupBuffer
from horizonrl.core.schedule import TurnBudgetSchedule
from horizonrl.protocol import Trajectory


class Accepted(msgspec.Struct, tag="accepted"):
    """An accepted trajectory: its message exactly as it arrived (no re-encoding on the hot path)."""

    message: bytes

    @property
    def trajectory(self) -> Trajectory:
        return msgspec.msgpack.decode(self.message, type=Trajectory)


class Expired(msgspec.Struct, tag="expired"):
    group_ids: list[str]


class Served(msgspec.Struct, tag="served"):
    batch: int
    request_id: int
    learner_version: int
    group_ids: list[str]


class RolledBack(msgspec.Struct, tag="rolled_back"):
    batches: list[int]


class Committed(msgspec.Struct, tag="committed"):
    step: int


class Lineage(msgspec.Struct, tag="lineage"):
    lineage: list[tuple[int, int]]


class Settings(msgspec.Struct, tag="settings"):
    """The buffer's decision settings from here on (written at start when they differ from the log's),
    so a replay decides as the live buffer did even if the run was resumed with other settings."""

    capacity_groups: int
    max_staleness: int
    skip_equal_reward_groups: bool
    # Settings a log written before they existed lacks: their defaults are what such a log decided by.
    staleness_rule: str = "oldest_token"
    max_start_staleness: int | None = None
    on_budget_change: str = "keep"
    budget_kind: str = ""  # the turn-budget schedule (core/schedule.py); "" none
    budget_rounds: list[int] = []
    budget_steps_per_stage: int = 1


def settings_of(buffer: GroupBuffer) -> Settings:
    """The decision settings ``buffer`` holds now, as a record (to compare with a start's)."""
    budget = buffer.budget
    return Settings(buffer.capacity_groups, buffer.max_staleness, buffer.skip_equal_reward_groups,
                    buffer.staleness_rule, buffer.max_start_staleness, buffer.on_budget_change,
                    budget.kind if budget else "", list(budget.rounds) if budget else [],
                    budget.steps_per_stage if budget else 1)


class Resolved(msgspec.Struct, tag="resolved"):
    trajectory_id: str
    group_id: str
    fate: str
    digest: bytes = b""  # content_digest of the message it replaces (b"" in logs written before digests)


class Rejected(msgspec.Struct, tag="rejected"):
    """A trajectory refused at the door, with the reason: never accepted (a resend is judged again, and counted
    again), but in the log so that ``horizonrl accounting`` lists the rejections as the buffer counted them."""

    trajectory_id: str  # cut to validation.MAX_ID_CHARS: an id may be what was wrong
    reason: str


class RejectedCounts(msgspec.Struct, tag="rejected_counts"):
    """The trajectories refused at the door since the record before, counted by reason: one small record per
    turn of the buffer's loop however many were refused in it, so a flood of invalid trajectories does not
    grow the log by a record each (``Rejected``, one per trajectory, is what logs before this one hold)."""

    counts: dict[str, int]


Record = (Accepted | Expired | Served | RolledBack | Committed | Lineage | Settings | Resolved | Rejected
          | RejectedCounts)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Record)


def encode_record(record: Record) -> bytes:
    return _encoder.encode(record)


_ACCEPTED_PREFIX = encode_record(Accepted(b""))[:-2]  # the map up to the message's msgpack bin header


def accepted_parts(message: bytes) -> tuple[bytes, bytes]:
    """``encode_record(Accepted(message))`` as (head, message): the hot path hands the message to the
    log without copying it (the log writes the parts with one writev)."""
    n = len(message)
    if n < 1 << 8:
        header = b"\xc4" + n.to_bytes(1, "big")
    elif n < 1 << 16:
        header = b"\xc5" + n.to_bytes(2, "big")
    else:
        header = b"\xc6" + n.to_bytes(4, "big")
    return _ACCEPTED_PREFIX + header, message


def content_digest(message: bytes) -> bytes:
    """What a trajectory's message holds, in 16 bytes: a resend is the same bytes (the actor keeps the encoded
    message in its outbox and sends it again), another episode under the same id is not."""
    return hashlib.blake2b(message, digest_size=16).digest()


def decode_record(data: bytes) -> Record:
    return _decoder.decode(data)


def apply(buffer: GroupBuffer, record: Record):
    """Change ``buffer`` as the record says (the same call the live server made); returns that call's
    result (a Served record: the groups of the batch)."""
    if isinstance(record, Accepted):
        buffer.accept(record.trajectory, content_digest(record.message))
    elif isinstance(record, Expired):
        buffer.expire(record.group_ids)
    elif isinstance(record, Served):
        return buffer.serve(record.batch, record.request_id, record.learner_version, record.group_ids)
    elif isinstance(record, RolledBack):
        buffer.roll_back(record.batches)
    elif isinstance(record, Committed):
        buffer.commit(record.step)
    elif isinstance(record, Lineage):
        buffer.set_lineage(record.lineage)
    elif isinstance(record, Settings):
        buffer.capacity_groups = record.capacity_groups
        buffer.max_staleness = record.max_staleness
        buffer.skip_equal_reward_groups = record.skip_equal_reward_groups
        buffer.staleness_rule, buffer.max_start_staleness = record.staleness_rule, record.max_start_staleness
        buffer.on_budget_change = record.on_budget_change
        buffer.budget = (TurnBudgetSchedule(record.budget_kind, tuple(record.budget_rounds),
                                            record.budget_steps_per_stage) if record.budget_kind else None)
    elif isinstance(record, Resolved):
        buffer.resolved_stub(record.trajectory_id, record.group_id, record.fate, record.digest)
    elif isinstance(record, Rejected):
        buffer.reject(record.reason)
    elif isinstance(record, RejectedCounts):
        for reason, count in record.counts.items():
            buffer.reject(reason, count)
    else:  # pragma: no cover - the decoder admits only the types above
        raise TypeError(f"unknown record {record!r}")
    return None


def compacted(record_bytes: bytes, buffer: GroupBuffer) -> bytes:
    """A record as compaction keeps it: a resolved trajectory's payload becomes its stub."""
    record = decode_record(record_bytes)
    if isinstance(record, Accepted):
        fate = buffer.fates.get(record.trajectory.trajectory_id)
        if fate is not None:
            return encode_record(Resolved(record.trajectory.trajectory_id, record.trajectory.group_id, fate,
                                          content_digest(record.message)))
    return record_bytes
