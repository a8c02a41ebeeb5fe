"""The learner's sockets: batches from the buffer (rank 0), reports and heartbeats to the coordinator,
the coordinator's request to end training early (rank 0), and the raw batch bytes shared from rank 0
with the other ranks.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import msgspec
import torch
import torch.distributed as dist
import zmq

from horizonrl.protocol import (ENDPOINT_BATCHES, MAX_CONTROL_BYTES, Batch, BatchRequest, Control, Heartbeat,
                                LearnerReport, ProtocolError, decode_as, encode, signed_by)
from horizonrl.protocol.counters import LearnerCounters, heartbeat_counters
from horizonrl.protocol.registry import FollowedEndpoint, registration
from horizonrl.protocol.transport import make_socket
from horizonrl.protocol.validation import trajectory_problem

log = logging.getLogger(__name__)

POLL_SLICE_S = 0.2
WAITING_LOG_EVERY_S = 10.0
HEARTBEAT_INTERVAL_S = 1.0
REPORT_SEND_TIMEOUT_S = 30.0
# A report the coordinator's Control (every 0.5 s, and at once on a report) does not show this long after it was
# sent is sent again: the coordinator restarted behind the learner, or its port was held by someone else.
REPORT_ACK_WAIT_S = 3.0
MAX_BATCH_BYTES = 1 << 30
MAX_BAD_BATCHES = 5


class BatchTimeoutError(TimeoutError):
    """The buffer sent no batch within ``learner.batch_timeout_s``."""


@dataclass(frozen=True)
class BatchLimits:
    """What a batch the learner accepts may hold: its tokens bound the step's time and memory."""

    max_groups: int  # learner.groups_per_step
    max_group_size: int  # rollout.n
    max_trajectory_tokens: int  # rollout.max_context_tokens
    max_tokens: int  # TrainConfig.step_token_budget

    @classmethod
    def for_run(cls, config) -> "BatchLimits":
        return cls(config.learner.groups_per_step, config.rollout.n, config.rollout.max_context_tokens,
                   config.step_token_budget)


class BatchClient:
    """Rank 0's DEALER to the buffer's ROUTER: one outstanding BatchRequest at a time.

    A request unanswered for ``resend_s`` is sent again under a new id: the buffer may have been
    restarted and lost it, and asking again is safe — a request for a step the buffer already
    served makes it take that batch back. A reply that is malformed, of another run, or holds an
    inconsistent trajectory is counted and the batch asked for again; replies to an older request
    id (one that arrived after we asked again) are ignored. After ``MAX_BAD_BATCHES`` bad replies
    in a row something is wrong beyond chance: an error.
    """

    def __init__(self, context: zmq.Context, endpoint: str | None, run_id: str, vocab_size: int | None = None,
                 security=None, registry: Callable[[], Mapping[str, str]] | None = None,
                 limits: BatchLimits | None = None, key: str = "") -> None:
        """``endpoint``: the buffer's configured address; None: wherever it registered, as ``registry()``
        (the coordinator's newest ``Control.endpoints``) says — followed when a restarted buffer moves.
        ``limits``: a batch beyond them is a bad batch (None: only the message size limit). ``key``: the run's,
        which the buffer asks of every request (protocol/messages.py)."""
        self.run_id = run_id
        self.key = key
        self.vocab_size = vocab_size
        self.limits = limits
        self.socket = make_socket(context, zmq.DEALER, max_message_bytes=MAX_BATCH_BYTES, security=security)
        self.buffer = FollowedEndpoint(self.socket, ENDPOINT_BATCHES, endpoint)
        self.registry = registry or (lambda: {})
        self.next_request_id = 1
        self.counters: Counter[str] = Counter()

    @property
    def endpoint(self) -> str:
        return self.buffer.current or "(not registered yet)"

    def _buffer_moved(self) -> bool:
        """The buffer registered somewhere new (it restarted): reconnected, and the request must go again."""
        return self.buffer.update(self.registry())

    def request(self, learner_version: int, num_groups: int, timeout_s: float, should_stop: Callable[[], bool], *,
                lineage: list[tuple[int, int]], committed_step: int, resend_s: float) -> bytes | None:
        """The raw msgpack bytes of a valid Batch answering a new request; None if asked to stop meanwhile."""
        start = last_log = time.monotonic()
        bad_in_a_row = 0
        while not should_stop():
            self._buffer_moved()
            request_id = self.next_request_id
            self.next_request_id += 1
            self.socket.send(encode(BatchRequest(run_id=self.run_id, request_id=request_id,
                                                 learner_version=learner_version, num_groups=num_groups,
                                                 lineage=lineage, committed_step=committed_step, key=self.key)))
            sent = time.monotonic()
            while not should_stop() and time.monotonic() - sent < resend_s:
                now = time.monotonic()
                if now - start > timeout_s:
                    raise BatchTimeoutError(
                        f"no batch from the buffer at {self.endpoint} within {timeout_s:.0f} s "
                        f"(request {request_id} for {num_groups} groups; learner.batch_timeout_s)"
                    )
                if now - last_log >= WAITING_LOG_EVERY_S:
                    log.info("waiting for batch %d from %s (%.0f s)", request_id, self.endpoint, now - start)
                    last_log = now
                if self._buffer_moved():
                    break  # a restarted buffer never saw the request: ask it again at once
                if not self.socket.poll(int(POLL_SLICE_S * 1000)):
                    continue
                payload = self.socket.recv(copy=False).bytes
                problem, reply_id = self._check(payload)
                if reply_id is not None and reply_id != request_id:
                    log.warning("ignoring a reply to request %d (waiting for %d)", reply_id, request_id)
                    continue
                if problem is None:
                    return payload
                bad_in_a_row += 1
                self.counters["bad_batches"] += 1
                log.error("bad batch from the buffer (%s); asking again", problem)
                if bad_in_a_row >= MAX_BAD_BATCHES:
                    raise ProtocolError(f"{bad_in_a_row} bad batches in a row from the buffer at {self.endpoint}; "
                                        f"the last: {problem}")
                break  # ask again at once
            else:
                if not should_stop():
                    self.counters["requests_resent"] += 1
                    log.warning("no answer to batch request %d for %.0f s; asking again (the buffer may have "
                                "restarted)", request_id, resend_s)
        return None

    def _check(self, payload: bytes) -> tuple[str | None, int | None]:
        """(what is wrong with this reply or None, its request id when it decodes)."""
        try:
            batch = decode_as(payload, Batch, MAX_BATCH_BYTES, self.run_id)
        except ProtocolError as exc:
            return f"malformed: {exc}", None
        limits = self.limits
        for group in batch.groups:
            for trajectory in group:
                problem = trajectory_problem(
                    trajectory, self.vocab_size, max_tokens=limits.max_trajectory_tokens if limits else None,
                    max_group_size=limits.max_group_size if limits else None)
                if problem is not None:
                    return f"trajectory {trajectory.trajectory_id}: {problem[0]} ({problem[1]})", batch.request_id
        if limits is not None:
            tokens = sum(t.num_tokens for group in batch.groups for t in group)
            if len(batch.groups) > limits.max_groups or tokens > limits.max_tokens:
                return (f"{len(batch.groups)} groups of {tokens} tokens; a step takes at most {limits.max_groups} "
                        f"groups of {limits.max_tokens} tokens"), batch.request_id
        return None, batch.request_id

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
    """PUSH to the coordinator's PULL. A report that cannot be queued within the timeout is an error. Reports
    and registrations go with the run's key (``key``; protocol/messages.py): the coordinator takes them only so.

    The newest report is kept until the coordinator's Control shows it (:meth:`unacknowledged`): a coordinator
    restarted from a state older than the learner's — or one whose reports a squatter of its port swallowed —
    is sent it again (by the heartbeat thread), so engines and buffer hear of the learner's version."""

    def __init__(self, context: zmq.Context, endpoint: str, security=None, key: str = "") -> None:
        self.endpoint = endpoint
        self.key = key
        self.socket = make_socket(context, zmq.PUSH, security=security)
        self.socket.setsockopt(zmq.SNDTIMEO, int(REPORT_SEND_TIMEOUT_S * 1000))
        self.socket.connect(endpoint)
        self.newest: tuple[tuple[int, int], bytes, float] | None = None  # ((epoch, step), signed bytes, sent at)
        self.resent = 0

    def unacknowledged(self, control: Control | None) -> bytes | None:
        """The newest report, when the coordinator's newest Control (None: none heard yet) still does not show its
        (epoch, step) ``REPORT_ACK_WAIT_S`` after it was sent; else None."""
        newest = self.newest
        if newest is None or time.monotonic() - newest[2] < REPORT_ACK_WAIT_S:
            return None
        if control is not None and (control.weight_epoch, control.learner_step) >= newest[0]:
            return None
        self.resent += 1
        return newest[1]

    def send(self, report: LearnerReport) -> None:
        data = encode(msgspec.structs.replace(report, key=self.key))
        self.newest = ((report.weight_epoch, report.step), data, time.monotonic())
        try:
            self.socket.send(data)
        except zmq.Again:
            raise TimeoutError(
                f"could not send the report of step {report.step} to the coordinator at {self.endpoint} "
                f"within {REPORT_SEND_TIMEOUT_S:.0f} s"
            ) from None

    def register(self, run_id: str, name: str, endpoints: Mapping[str, str]) -> None:
        """Register endpoints with the coordinator, in order with the reports (a weight hub is registered
        before the startup report that announces its epoch)."""
        try:
            self.socket.send(registration(run_id, name, endpoints, self.key))
        except zmq.Again:
            raise TimeoutError(f"could not register {sorted(endpoints)} with the coordinator at {self.endpoint} "
                               f"within {REPORT_SEND_TIMEOUT_S:.0f} s") from None

    def close(self) -> None:
        self.socket.close(linger=0)


class HeartbeatThread(threading.Thread):
    """Pushes Heartbeat(role="learner") about once a second from its own socket.

    Heartbeats are disposable: when the coordinator is not reading, they are dropped
    (non-blocking send), never queued behind each other.
    """

    def __init__(self, context: zmq.Context, endpoint: str, counters: LearnerCounters, run_id: str,
                 security=None, key: str = "", unacknowledged: Callable[[], bytes | None] = lambda: None) -> None:
        super().__init__(name="learner-heartbeat", daemon=True)
        self.key = key  # the run's: the coordinator takes heartbeats only with it
        self.unacknowledged = unacknowledged  # the newest report, while the coordinator does not show it
        self.context = context
        self.endpoint = endpoint
        self.counters = counters
        self.run_id = run_id
        self.security = security
        self.stopped = threading.Event()

    def run(self) -> None:
        socket = make_socket(self.context, zmq.PUSH, hwm=4, security=self.security)
        socket.connect(self.endpoint)
        try:
            while not self.stopped.is_set():
                beat = Heartbeat(run_id=self.run_id, role="learner", index=0, pid=os.getpid(),
                                 counters=heartbeat_counters(self.counters), key=self.key)
                try:
                    socket.send(encode(beat), zmq.NOBLOCK)
                    report = self.unacknowledged()
                    if report is not None:  # a coordinator that restarted behind the learner: it catches up
                        socket.send(report, zmq.NOBLOCK)
                except zmq.Again:
                    pass
                self.stopped.wait(HEARTBEAT_INTERVAL_S)
        finally:
            socket.close(linger=0)

    def stop(self) -> None:
        self.stopped.set()
        self.join(timeout=5)


class ControlWatch(threading.Thread):
    """Rank 0 subscribes to the coordinator's ``Control`` for two things. When it says ``end_training``
    (held-out success has plateaued: ``eval.stop_after_plateau``) it sets ``end_training``, which the
    training loop checks at each step boundary as it checks a stop signal: all ranks stop there, save,
    and send the final report. And it keeps the newest registered endpoints (``endpoints``, replaced
    whole, so a reader on another thread sees one consistent map): where the buffer is. Other Control
    fields are not the learner's business; malformed or foreign messages are ignored (the coordinator
    counts its own)."""

    def __init__(self, context: zmq.Context, endpoint: str, run_id: str, end_training: threading.Event,
                 security=None, key: str = "") -> None:
        super().__init__(name="learner-control-watch", daemon=True)
        self.key = key  # the run's: only a Control signed with it is the coordinator's
        self.context = context
        self.endpoint = endpoint
        self.run_id = run_id
        self.end_training = end_training
        self.security = security
        self.stopped = threading.Event()
        self.endpoints: Mapping[str, str] = {}
        self.control: Control | None = None  # the newest signed Control: what the coordinator knows

    def run(self) -> None:
        socket = make_socket(self.context, zmq.SUB, max_message_bytes=MAX_CONTROL_BYTES, security=self.security)
        socket.connect(self.endpoint)
        try:
            while not self.stopped.is_set():
                if not socket.poll(int(POLL_SLICE_S * 1000)):
                    continue
                try:
                    control = decode_as(socket.recv(), Control, MAX_CONTROL_BYTES, self.run_id)
                except ProtocolError:
                    continue
                if not signed_by(control, self.key):
                    continue  # not the coordinator's: it could end training or re-wire the buffer
                self.control = control
                self.endpoints = control.endpoints
                if control.end_training and not self.end_training.is_set():
                    log.info("the coordinator ends training at step %d (held-out success has plateaued): "
                             "stopping after this step", control.learner_step)
                    self.end_training.set()
        finally:
            socket.close(linger=0)

    def stop(self) -> None:
        self.stopped.set()
        self.join(timeout=5)


EndTrainingWatch = ControlWatch  # its first name, when ending training early was all it watched for
