"""msgpack encoding of the messages in ``messages.py`` (msgspec's codec, no pickle).

``decode`` raises :class:`ProtocolError` — and only that — for anything that is not a
well-formed message of this schema version within the size limit, so a receiving
process can count it, log it and carry on.
"""

from __future__ import annotations

from typing import TypeVar

import msgspec

from horizonrl.protocol.messages import SCHEMA_VERSION, Message

DEFAULT_MAX_BYTES = 256 * 1024 * 1024

M = TypeVar("M")


class ProtocolError(ValueError):
    """Malformed, oversized, wrong-version or unexpected message."""


class ForeignRunError(ProtocolError):
    """A well-formed message of another run (a stale process, or a second run on the same ports)."""


class _Header(msgspec.Struct):
    # Decoded only to explain a failure: unknown fields are ignored, so this reads
    # the type tag and version of messages from other schema versions too.
    type: str = "?"
    v: int = -1


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)
_header_decoder = msgspec.msgpack.Decoder(_Header)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes | memoryview, max_bytes: int = DEFAULT_MAX_BYTES, run_id: str | None = None) -> Message:
    """Decode one message; ProtocolError if it is oversized, malformed or of another version, and
    ForeignRunError if ``run_id`` is given and the message belongs to another run."""
    if len(data) > max_bytes:
        raise ProtocolError(f"message of {len(data)} bytes exceeds the limit of {max_bytes} bytes")
    try:
        message = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(_explain(data, exc)) from None
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
    except (msgspec.DecodeError, msgspec.ValidationError):
        return f"malformed message ({len(data)} bytes): {exc}"
    if header.v != SCHEMA_VERSION:
        return f"message {header.type!r} has schema version {header.v}; this process speaks {SCHEMA_VERSION}"
    return f"invalid {header.type!r} message: {exc}"
