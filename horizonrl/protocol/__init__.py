"""Messages, their msgpack codec and the socket conventions: the bottom layer."""

from horizonrl.protocol.codec import ProtocolError, decode, decode_as, encode
from horizonrl.protocol.messages import (
    FAILURE_ENGINE,
    FAILURE_ENVIRONMENT,
    FAILURE_NONE,
    SCHEMA_VERSION,
    STOP_CONTEXT,
    STOP_DONE,
    STOP_FAILURE,
    STOP_MAX_TURNS,
    Batch,
    BatchRequest,
    Control,
    Heartbeat,
    LearnerReport,
    Message,
    Trajectory,
    WeightLayout,
)

__all__ = [
    "FAILURE_ENGINE",
    "FAILURE_ENVIRONMENT",
    "FAILURE_NONE",
    "SCHEMA_VERSION",
    "STOP_CONTEXT",
    "STOP_DONE",
    "STOP_FAILURE",
    "STOP_MAX_TURNS",
    "Batch",
    "BatchRequest",
    "Control",
    "Heartbeat",
    "LearnerReport",
    "Message",
    "ProtocolError",
    "Trajectory",
    "WeightLayout",
    "decode",
    "decode_as",
    "encode",
]
