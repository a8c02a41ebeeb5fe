"""Acknowledged delivery of trajectories to the buffer, with an on-disk outbox.

A trajectory leaves the actor's care only when the buffer acknowledges it (``TrajectoryAck``:
accepted and durable in its log, a duplicate of an accepted one, or rejected as invalid). Until
then it is *unacknowledged*: it is resent every ``ack_timeout_s`` (the buffer de-duplicates by
trajectory id), and it is in the outbox on disk — appended as it is produced, before it is sent —
so a crashed or restarted actor sends it again. The outbox's format is core/outbox.py's: segments of
encoded trajectories, each with the ids acknowledged so far (skipped at a restart); a segment is deleted
once all of its trajectories are acknowledged. Appends are not fsync'ed: they survive the actor's crash
(the OS holds them), not the machine's — and what was acknowledged but not yet marked is merely sent again
(the buffer answers "duplicate").

Backpressure: at most ``max_unacked`` trajectories are unacknowledged; :meth:`send` waits
for room, so a buffer that stops reading slows the actor's groups down.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.asyncio

from horizonrl.core.outbox import acked_path, framed, read_outbox, segment_path
from horizonrl.core.runtime import RateLimitedLog
from horizonrl.protocol import ACK_REJECTED, ProtocolError, Trajectory, TrajectoryAck, decode_as, encode
from horizonrl.protocol.counters import DeliveryCounters

log = logging.getLogger("horizonrl.actors.delivery")

MAX_ACK_BYTES = 4 * 1024 * 1024
SEGMENT_ENTRIES = 256


@dataclass
class _Unacked:
    data: bytes
    segment: int
    sent_at: float | None = None  # None: not yet sent (or the send queue was full)


class TrajectoryDelivery:
    def __init__(self, socket: zmq.asyncio.Socket, outbox_dir: Path, run_id: str, *, ack_timeout_s: float,
                 max_unacked: int) -> None:
        self.socket = socket
        self.outbox_dir = Path(outbox_dir)
        self.outbox_dir.mkdir(parents=True, exist_ok=True)
        self.run_id = run_id
        self.ack_timeout_s = ack_timeout_s
        self.max_unacked = max_unacked
        self.unacked: dict[str, _Unacked] = {}
        self.counters = DeliveryCounters()
        self._segment_ids: dict[int, set[str]] = {}  # outbox segment -> its unacknowledged ids
        self._segment = 0
        self._segment_entries = 0
        self._file = None
        self._room = asyncio.Event()
        self._room.set()
        # Set by the actor while the coordinator pauses the rollout: the buffer holds a full load and reads
        # nothing until the learner takes a batch, so sends wait for their acknowledgement as designed.
        self._backpressure = False
        self._paused_at: float | None = None  # time.monotonic() the rollout was last seen paused
        self._last_ack_at = 0.0  # time.monotonic() of the last acknowledgement read
        self._resend_log = RateLimitedLog(log)
        self._reject_log = RateLimitedLog(log)
        self._load_outbox()

    @property
    def backpressure(self) -> bool:
        return self._backpressure

    @backpressure.setter
    def backpressure(self, paused: bool) -> None:
        self._backpressure = paused
        if paused:
            self._paused_at = time.monotonic()

    def _buffer_was_full(self, since: float | None) -> bool:
        """The rollout is paused, or was at some moment after ``since`` (when the oldest overdue trajectory was
        sent). The pause lifts as soon as the learner takes a batch and comes back when the buffer fills again, so
        a trajectory queued behind a full buffer can be late with the pause off at the moment it is sent again
        (the demo's console once showed a dozen such warnings while the buffer sat at 16 of 16 groups)."""
        return self._backpressure or (self._paused_at is not None and since is not None and self._paused_at >= since)

    # ------------------------------------------------------------------ outbox on disk

    def _load_outbox(self) -> None:
        """What a previous run of this actor produced and never saw acknowledged: sent again."""
        for segment in read_outbox(self.outbox_dir, self.run_id):
            for error in segment.undecodable:
                log.warning("outbox %s: skipping an entry that does not decode (%s)", segment.path.name, error)
            for payload, trajectory in segment.unacked:
                self.unacked[trajectory.trajectory_id] = _Unacked(payload, segment.number)
            self._segment_ids[segment.number] = {trajectory.trajectory_id for _, trajectory in segment.unacked}
            self._segment = max(self._segment, segment.number)
        if self.unacked:
            log.info("outbox: %d unacknowledged trajectories from before the restart; sending them again",
                     len(self.unacked))
            self.counters.outbox_recovered += len(self.unacked)
        self._forget_acknowledged_segments()
        self._update_room()

    def _append(self, trajectory_id: str, data: bytes) -> int:
        if self._file is None or self._segment_entries >= SEGMENT_ENTRIES:
            if self._file is not None:
                self._file.close()
            self._segment += 1
            self._segment_entries = 0
            self._segment_ids[self._segment] = set()
            self._file = open(segment_path(self.outbox_dir, self._segment), "ab")
        self._file.write(framed(data))
        self._file.flush()
        self._segment_entries += 1
        self._segment_ids[self._segment].add(trajectory_id)
        return self._segment

    def _forget_acknowledged_segments(self) -> None:
        for number in [n for n, ids in self._segment_ids.items() if not ids]:
            if number == self._segment and self._file is not None and self._segment_entries < SEGMENT_ENTRIES:
                continue  # still being written
            if number == self._segment and self._file is not None:
                self._file.close()
                self._file = None
            segment_path(self.outbox_dir, number).unlink(missing_ok=True)
            acked_path(self.outbox_dir, number).unlink(missing_ok=True)
            del self._segment_ids[number]

    # ------------------------------------------------------------------ sending

    async def send(self, trajectory: Trajectory) -> None:
        """Hand a trajectory over: outbox first, then the socket. Waits while too many are unacknowledged."""
        start = time.monotonic()
        while len(self.unacked) >= self.max_unacked:  # every waiter wakes when room is made: look again
            await self._room.wait()
        data = encode(trajectory)
        segment = self._append(trajectory.trajectory_id, data)
        self.unacked[trajectory.trajectory_id] = _Unacked(data, segment)
        self._update_room()
        await self._try_send(trajectory.trajectory_id)
        self.counters.sent += 1
        self.counters.send_wait_s += time.monotonic() - start

    async def _try_send(self, trajectory_id: str) -> None:
        entry = self.unacked[trajectory_id]
        try:
            await self.socket.send(entry.data, zmq.NOBLOCK)
            entry.sent_at = time.monotonic()
        except zmq.Again:
            entry.sent_at = None  # the queue to the buffer is full: the resend loop tries again

    async def run(self) -> None:
        """Forever: read acknowledgements; resend what waited too long (or never left)."""
        while True:
            if await self.socket.poll(200):
                while True:
                    try:
                        data = await self.socket.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._on_ack(data)
            await self._resend_overdue()

    def _on_ack(self, data: bytes) -> None:
        self._last_ack_at = time.monotonic()
        try:
            ack = decode_as(data, TrajectoryAck, MAX_ACK_BYTES, self.run_id)
        except ProtocolError as exc:
            self.counters.bad_acks += 1
            log.warning("ignoring a malformed acknowledgement: %s", exc)
            return
        marks: dict[int, list[str]] = {}
        reasons = ack.reasons or [""] * len(ack.statuses)
        for trajectory_id, status, reason in zip(ack.trajectory_ids, ack.statuses, reasons):
            entry = self.unacked.pop(trajectory_id, None)
            if entry is None:
                continue  # acknowledged before (an ack of a resend)
            self._segment_ids.get(entry.segment, set()).discard(trajectory_id)
            marks.setdefault(entry.segment, []).append(trajectory_id)
            self.counters.count_ack(status)
            if status == ACK_REJECTED:
                self._reject_log.warning("the buffer rejected trajectory %s: %s", trajectory_id, reason)
        for segment, ids in marks.items():
            if self._segment_ids.get(segment):  # still holds unacknowledged ones: remember which are done
                with open(acked_path(self.outbox_dir, segment), "a") as f:
                    f.write("".join(i + "\n" for i in ids))
        self._forget_acknowledged_segments()
        self._update_room()

    async def _resend_overdue(self) -> None:
        now = time.monotonic()
        overdue = [tid for tid, e in self.unacked.items() if e.sent_at is None or now - e.sent_at > self.ack_timeout_s]
        # when the oldest of them was sent (before this resend stamps them again)
        oldest = min((self.unacked[tid].sent_at for tid in overdue if self.unacked[tid].sent_at is not None),
                     default=None)
        for trajectory_id in overdue:
            was_sent = self.unacked[trajectory_id].sent_at is not None
            await self._try_send(trajectory_id)
            if was_sent:
                self.counters.resent += 1
        if overdue:
            # Under backpressure a late acknowledgement is the design at work, not a fault: INFO, off the console.
            full = self._buffer_was_full(oldest)
            self._resend_log.log(logging.INFO if full else logging.WARNING,
                                 "%d trajectories unacknowledged for over %.0f s (or not yet sent): sending again%s",
                                 len(overdue), self.ack_timeout_s,
                                 " (the buffer is full: it reads again once the learner takes a batch)"
                                 if full else "")

    def _update_room(self) -> None:
        if len(self.unacked) < self.max_unacked:
            self._room.set()
        else:
            self._room.clear()

    async def drain(self, timeout_s: float, quiet_s: float = 2.0) -> int:
        """Wait up to ``timeout_s`` for every trajectory to be acknowledged, but no longer than ``quiet_s`` after
        the last acknowledgement: a buffer that acknowledges nothing for that long is full (it reads nothing
        until the learner takes a batch, and at the end of a run it never will) or gone, and what it did not
        acknowledge stays in the outbox for the next start. Returns how many are not acknowledged."""
        start = time.monotonic()
        while self.unacked:
            now = time.monotonic()
            if now - start >= timeout_s or now - max(start, self._last_ack_at) >= quiet_s:
                break
            await asyncio.sleep(0.05)
        return len(self.unacked)

    def close(self) -> None:
        """Unacknowledged trajectories stay in the outbox for the next start."""
        if self._file is not None:
            self._file.close()
            self._file = None
