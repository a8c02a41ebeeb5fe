"""What a vLLM engine worker tells the actor's engine client about a weight update (actors/vllm_worker.py ->
actors/engine.py): the envelope of every reply, its reply to each weight RPC, and how a staged receive ended.

They cross two boundaries that are not ours to type: vLLM's ``collective_rpc``, which hands a worker's return
value back as whatever its own serializer makes of it, and a small msgpack message on a ZMQ socket of the
actor's. Both carry the plain array form (:meth:`wire`); each side converts through these structs, so the
fields are named in one place instead of indexed by position on both sides.
"""

from __future__ import annotations

from typing import Any

import msgspec


class RpcReply(msgspec.Struct, array_like=True, frozen=True):
    """The envelope of every answer of a worker to the engine (``vllm_worker.WeightReceiverExtension.horizonrl_call``):
    the number of the call it answers, what the method returned, and ``error`` (never raised through vLLM).

    Why a number: vLLM's multi-process executor (tensor parallelism) gives up on an RPC at its ``timeout`` and
    leaves the workers' late answers in their queues, where the next RPC reads them as its own (0.33
    ``v1/executor/multiproc_executor.py``: the dequeue at its timeout raises, nothing drains). The engine numbers its
    calls, drops an answer to an older one, and reads on (``RolloutEngine._rpc``)."""

    call: int
    payload: Any
    error: str = ""

    def wire(self) -> list:
        return msgspec.to_builtins(self)

    @classmethod
    def from_wire(cls, value: Any) -> "RpcReply":
        return msgspec.convert(value, cls)


class WorkerReply(msgspec.Struct, array_like=True, frozen=True):
    """A worker's answer to a weight RPC. A worker never raises in one (with several workers, vLLM's executor
    answers an RPC with the first worker's exception and leaves the others' replies queued, so the next RPC
    would read a stale failure): ``error`` is "" on success, else what went wrong, and version -1."""

    version: int
    epoch: int
    receive_s: float  # the broadcast, waiting for the sender included
    load_s: float  # loading into the model
    worker: int  # the worker's rank in the engine
    error: str = ""
    # To a stage request: whether this worker stages (False: a tensor-parallel rank > 0, which takes the version
    # from TP rank 0 when it is loaded, actors/tp_relay.py).
    stages: bool = True

    def wire(self) -> list:
        return msgspec.to_builtins(self)

    @classmethod
    def from_wire(cls, value: Any) -> "WorkerReply":
        return msgspec.convert(value, cls)


class StageOutcome(msgspec.Struct, array_like=True, frozen=True):
    """How staged receive ``stage_id`` ended on one worker: the version it holds (-1 unless it all arrived),
    or the error that ended it. Sent by the receiving thread as soon as it ends, and answered when asked."""

    stage_id: int
    version: int
    epoch: int
    receive_s: float
    load_s: float
    worker: int
    error: str = ""

    @property
    def reply(self) -> WorkerReply:
        return WorkerReply(self.version, self.epoch, self.receive_s, self.load_s, self.worker, self.error)

    def wire(self) -> list:
        return msgspec.to_builtins(self)

    @classmethod
    def from_wire(cls, value: Any) -> "StageOutcome":
        return msgspec.convert(value, cls)

    @classmethod
    def decode(cls, data: bytes) -> "StageOutcome":
        return msgspec.msgpack.decode(data, type=cls)
