"""The learner's sockets: batches from the buffer (rank 0), reports and heartbeats to the coordinator,
and the raw batch bytes shared from rank 0 with the other ranks.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import zmq

from horizonrl.protocol import Batch, BatchRequest, Heartbeat, LearnerReport, ProtocolError, decode_as, encode
from horizonrl.protocol.transport import make_socket

log = logging.getLogger(__name__)

POLL_SLICE_S = 0.2
WAITING_LOG_EVERY_S = 10.0
HEARTBEAT_INTERVAL_S = 1.0
REPORT_SEND_TIMEOUT_S = 30.0


class BatchTimeoutError(TimeoutError):
    """The buffer sent no batch within ``learner.batch_timeout_s``."""


class BatchClient:
    """Rank 0's DEALER to the buffer's ROUTER: one outstanding BatchRequest at a time.

    A request is never re-sent: the buffer answers each request exactly once, and a second
    request would make it hand out groups that are then thrown away. Replies to an older
    request id (e.g. one that arrived after we gave up on it) are ignored and logged.
    """

    def __init__(self, context: zmq.Context, endpoint: str) -> None:
        self.endpoint = endpoint
        self.socket = make_socket(context, zmq.DEALER)
        self.socket.connect(endpoint)
        self.next_request_id = 1

    def request(
        self, learner_version: int, num_groups: int, timeout_s: float, should_stop: Callable[[], bool]
    ) -> bytes | None:
        """The raw msgpack bytes of the Batch answering a new request; None if asked to stop meanwhile."""
        request_id = self.next_request_id
        self.next_request_id += 1
        self.socket.send(encode(BatchRequest(request_id=request_id, learner_version=learner_version, num_groups=num_groups)))
        start = last_log = time.monotonic()
        while not should_stop():
            now = time.monotonic()
            if now - start > timeout_s:
                raise BatchTimeoutError(
                    f"no batch from the buffer at {self.endpoint} within {timeout_s:.0f} s "
                    f"(request {request_id} for {num_groups} groups; learner.batch_timeout_s)"
                )
            if now - last_log >= WAITING_LOG_EVERY_S:
                log.info("waiting for batch %d from %s (%.0f s)", request_id, self.endpoint, now - start)
                last_log = now
            if not self.socket.poll(int(POLL_SLICE_S * 1000)):
                continue
            payload = self.socket.recv(copy=False).bytes
            try:
                batch = decode_as(payload, Batch)
            except ProtocolError as exc:
                raise ProtocolError(f"malformed reply from the buffer at {self.endpoint}: {exc}") from exc
            if batch.request_id != request_id:
                log.warning("ignoring a stale batch reply (request %d; waiting for %d)", batch.request_id, request_id)
                continue
            return payload
        return None

    def close(self) -> None:
        self.socket.close(linger=0)


def share_bytes(payload: bytes | None, rank: int) -> bytes | None:
    """Rank 0's bytes to every rank over the learner's own group: length, then a uint8 tensor.

    A length of -1 means "no batch: stop". No pickle, no broadcast_object_list.
    """
    length = torch.tensor([-1 if payload is None else len(payload)], dtype=torch.int64)
    dist.broadcast(length, src=0)
    if length.item() < 0:
        return None
    buffer = (
        torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        if rank == 0
        else torch.empty(int(length.item()), dtype=torch.uint8)
    )
    dist.broadcast(buffer, src=0)
    return payload if rank == 0 else buffer.numpy().tobytes()


class ReportSender:
    """PUSH to the coordinator's PULL. A report that cannot be queued within the timeout is an error."""

    def __init__(self, context: zmq.Context, endpoint: str) -> None:
        self.endpoint = endpoint
        self.socket = make_socket(context, zmq.PUSH)
        self.socket.setsockopt(zmq.SNDTIMEO, int(REPORT_SEND_TIMEOUT_S * 1000))
        self.socket.connect(endpoint)

    def send(self, report: LearnerReport) -> None:
        try:
            self.socket.send(encode(report))
        except zmq.Again:
            raise TimeoutError(
                f"could not send the report of step {report.step} to the coordinator at {self.endpoint} "
                f"within {REPORT_SEND_TIMEOUT_S:.0f} s"
            ) from None

    def close(self) -> None:
        self.socket.close(linger=0)


class HeartbeatThread(threading.Thread):
    """Pushes Heartbeat(role="learner") about once a second from its own socket.

    Heartbeats are disposable: when the coordinator is not reading, they are dropped
    (non-blocking send), never queued behind each other.
    """

    def __init__(self, context: zmq.Context, endpoint: str, counters: dict[str, float]) -> None:
        super().__init__(name="learner-heartbeat", daemon=True)
        self.context = context
        self.endpoint = endpoint
        self.counters = counters
        self.stopped = threading.Event()

    def run(self) -> None:
        socket = make_socket(self.context, zmq.PUSH, hwm=4)
        socket.connect(self.endpoint)
        try:
            while not self.stopped.is_set():
                beat = Heartbeat(role="learner", index=0, pid=os.getpid(), counters=dict(self.counters))
                try:
                    socket.send(encode(beat), zmq.NOBLOCK)
                except zmq.Again:
                    pass
                self.stopped.wait(HEARTBEAT_INTERVAL_S)
        finally:
            socket.close(linger=0)

    def stop(self) -> None:
        self.stopped.set()
        self.join(timeout=5)
