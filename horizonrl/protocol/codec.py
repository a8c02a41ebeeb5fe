"""msgpack encoding of the messages in ``messages.py`` (msgspec's codec, no pickle).

``decode`` raises :class:`ProtocolError` — and only that — for anything that is not a
well-formed message of this schema version within the size limits, whatever the bytes are
(truncated, invalid UTF-8 in any string, nested past any depth), so a receiving process can
count it, log it and carry on. Two limits apply: the receiver's (``max_bytes``: its socket's) and
the message kind's (:data:`KIND_MAX_BYTES`), so a heartbeat cannot be as big as a batch.

The run's key never leaves a process. A message of a :data:`KEYED_KINDS` kind is built with ``key`` = the run's
key (messages.py), and :func:`encode` sends in its place the message's MAC, ``"mac:" + HMAC-SHA256(run key,
the message encoded with key="")``; a receiver holding the key checks it with :func:`signed_by`. So whoever
reads a keyed message — a subscriber of the coordinator's Control, or a process that took a port a dead
coordinator left — learns nothing it could sign another message with, and no field of a signed message can be
changed without the key.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import TypeVar

import msgspec

from horizonrl.protocol.messages import (MAX_CONTROL_BYTES, SCHEMA_VERSION, Batch, BatchRequest, Control, EpisodeSample,
                                         Heartbeat, HeldOutEval, IpcBucketAck, IpcBucketReady, IpcWeights,
                                         LearnerReport, Message, ProcessEvent, Registration, Trajectory, TrajectoryAck,
                                         WeightJoin, WeightLayout)

DEFAULT_MAX_BYTES = 256 * 1024 * 1024

M = TypeVar("M")


class ProtocolError(ValueError):
    """Malformed, oversized, wrong-version or unexpected message."""


class ForeignRunError(ProtocolError):
    """A well-formed message of another run (a stale process, or a second run on the same ports)."""


class OversizedMessage(ProtocolError):
    """A well-formed message bigger than its kind may be (KIND_MAX_BYTES)."""


_KIB, _MIB = 1024, 1024 * 1024
# The largest encoded message of each kind any receiver accepts. Generous for every legitimate sender
# (an actor's heartbeat holds ~100 counters; an episode sample up to 2 x 30 turns of MAX_SAMPLE_TEXT
# characters); what is far beyond them is an attack or a bug, and is counted as such.
KIND_MAX_BYTES: dict[type, int] = {
    Heartbeat: 256 * _KIB,
    Registration: 64 * _KIB,
    ProcessEvent: 4 * _KIB,
    LearnerReport: 4 * _MIB,
    EpisodeSample: 4 * _MIB,
    HeldOutEval: 1 * _MIB,
    Control: MAX_CONTROL_BYTES,
    BatchRequest: 64 * _KIB,
    WeightJoin: 4 * _KIB,
    IpcBucketReady: 4 * _KIB,
    IpcBucketAck: 4 * _KIB,
    TrajectoryAck: 16 * _MIB,
    WeightLayout: 256 * _MIB,
    IpcWeights: 256 * _MIB,
    Trajectory: DEFAULT_MAX_BYTES,
    Batch: 1 << 30,
}
# What msgspec (or Python under it) raises for bytes that are not a message: besides its own errors,
# UnicodeDecodeError (a ValueError) for invalid UTF-8 in a string, OverflowError, RecursionError.
_UNDECODABLE = (msgspec.MsgspecError, ValueError, OverflowError, RecursionError)


class _Header(msgspec.Struct):
    # Decoded only to explain a failure: unknown fields are ignored, so this reads
    # the type tag and version of messages from other schema versions too.
    type: str = "?"
    v: int = -1


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)
_header_decoder = msgspec.msgpack.Decoder(_Header)

# The kinds that change the run's state: signed with the run's key (see the module docstring).
KEYED_KINDS = (LearnerReport, ProcessEvent, Registration, HeldOutEval, Heartbeat, BatchRequest, WeightJoin, Control)
MAC_PREFIX = "mac:"


def encode(message: Message) -> bytes:
    """The message's bytes; a keyed kind's ``key`` (the run's key) goes as the message's MAC."""
    key = getattr(message, "key", "")
    if key and not key.startswith(MAC_PREFIX) and isinstance(message, KEYED_KINDS):
        # signed as the receiver will see it: a struct built with an int where a float is typed encodes otherwise
        # than it decodes, and the receiver's MAC is of what it decoded
        message = msgspec.msgpack.decode(_encoder.encode(message), type=type(message))
        message = msgspec.structs.replace(message, key=message_mac(message, key))
    return _encoder.encode(message)


def message_mac(message: Message, run_key: str) -> str:
    """``"mac:" + HMAC-SHA256(run_key, message encoded with key="")``, hex."""
    body = _encoder.encode(msgspec.structs.replace(message, key=""))
    return MAC_PREFIX + hmac.new(run_key.encode(), body, hashlib.sha256).hexdigest()


def signed_by(message: Message, run_key: str) -> bool:
    """Whether ``message`` (decoded) was signed with ``run_key`` — always True for a run without a key ("")."""
    if not run_key:
        return True
    return hmac.compare_digest(getattr(message, "key", "").encode(), message_mac(message, run_key).encode())


def decode(data: bytes | memoryview, max_bytes: int = DEFAULT_MAX_BYTES, run_id: str | None = None) -> Message:
    """Decode one message; ProtocolError if it is oversized, malformed or of another version, and
    ForeignRunError if ``run_id`` is given and the message belongs to another run."""
    if len(data) > max_bytes:
        raise ProtocolError(f"message of {len(data)} bytes exceeds the limit of {max_bytes} bytes")
    try:
        message = _decoder.decode(data)
    except _UNDECODABLE as exc:
        raise ProtocolError(_explain(data, exc)) from None
    limit = KIND_MAX_BYTES.get(type(message))
    if limit is not None and len(data) > limit:
        raise OversizedMessage(f"{type(message).__name__} of {len(data)} bytes exceeds its kind's limit of {limit} "
                               "bytes")
    if message.v != SCHEMA_VERSION:
        raise ProtocolError(
            f"{type(message).__name__} has schema version {message.v}; this process speaks {SCHEMA_VERSION}"
        )
    if run_id is not None and message.run_id != run_id:
        raise ForeignRunError(f"{type(message).__name__} of run {message.run_id!r}; this process is in run {run_id!r}")
    return message


def decode_as(data: bytes | memoryview, expected: type[M], max_bytes: int = DEFAULT_MAX_BYTES,
              run_id: str | None = None) -> M:
    """Decode and check the message type (and run); ProtocolError if it is another kind of message."""
    message = decode(data, max_bytes, run_id)
    if not isinstance(message, expected):
        raise ProtocolError(f"expected {expected.__name__}, got {type(message).__name__}")
    return message


def _explain(data: bytes | memoryview, exc: Exception) -> str:
    try:
        header = _header_decoder.decode(data)
    except _UNDECODABLE:
        return f"malformed message ({len(data)} bytes): {exc}"
    if header.v != SCHEMA_VERSION:
        return f"message {header.type!r} has schema version {header.v}; this process speaks {SCHEMA_VERSION}"
    return f"invalid {header.type!r} message: {exc}"[:1000]
