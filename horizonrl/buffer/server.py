"""The buffer process: trajectories in (ROUTER, acknowledged), whole batches of groups out (ROUTER).

Every trajectory is checked at the door — it must decode, belong to this run, be consistent
(``protocol/validation.py``), be no longer than the run's context (``rollout.max_context_tokens``) and
of no bigger group than the run's (``rollout.n``), fit its group, and not come from weights nobody has
announced yet nor ever will — and the actor gets one acknowledgement per trajectory: *accepted* once it is in the
write-ahead log (durable per ``buffer.wal_fsync``), *duplicate* for a resend of an accepted one,
*rejected* with the reason. The actor keeps a trajectory until it is acknowledged and resends it
after ``rollout.ack_timeout_s``, so nothing is lost between the two processes.

Each change of the buffer's state is a log record (``records.py``) written before anything that
depends on it leaves the process; a restarted buffer replays its log and is where it was.
Batches go to the learner's BatchRequests; a request for a step already served rolls that
batch back (see ``BatchRequest``), so a lost reply or a learner resumed from an older checkpoint
never loses or doubles data.

Backpressure: while ``capacity_groups`` complete groups wait for the learner, the buffer stops
reading trajectories; they queue in ZMQ and the actors' unacknowledged counts grow until they
stop starting groups. Malformed, oversized, foreign-run or wrong-version messages are counted
(``bad_messages_*``) and logged, never fatal.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter, defaultdict, deque
from dataclasses import dataclass

import zmq

from horizonrl.buffer.groups import GroupBuffer
from horizonrl.buffer.records import (
    Committed,
    Expired,
    Lineage,
    RejectedCounts,
    RolledBack,
    Served,
    Settings,
    accepted_parts,
    apply,
    compacted,
    content_digest,
    decode_record,
    encode_record,
    settings_of,
)
from horizonrl.buffer.wal import WriteAheadLog
from horizonrl.core.config import TrainConfig
from horizonrl.core.episode_records import EpisodeRecordWriter, episode_record, trained_record
from horizonrl.core.run_dirs import read_run_key
from horizonrl.core.run_events import EventLog, RunEvent
from horizonrl.core.schedule import TurnBudgetSchedule
from horizonrl.core.runtime import RateLimitedLog, StopFlag
from horizonrl.protocol import (
    ACK_ACCEPTED,
    ACK_DUPLICATE,
    ACK_REJECTED,
    ENDPOINT_BATCHES,
    ENDPOINT_TRAJECTORIES,
    MAX_CONTROL_BYTES,
    Batch,
    BatchRequest,
    Control,
    ForeignRunError,
    Heartbeat,
    ProtocolError,
    Trajectory,
    TrajectoryAck,
    decode_as,
    encode,
    signed_by,
)
from horizonrl.protocol.registry import registration
from horizonrl.protocol.transport import bind_endpoint, make_socket, wire_security
from horizonrl.protocol.names import MAX_ID_CHARS, shown
from horizonrl.protocol.validation import trajectory_problem, trajectory_size_problem

log = logging.getLogger("horizonrl.buffer")

MAX_TRAJECTORY_BYTES = 64 * 1024 * 1024
MAX_REQUEST_BYTES = 64 * 1024
DRAIN_PER_POLL = 256
HEARTBEAT_PERIOD_S = 0.25  # also the latency of the coordinator's rollout pause
REJECT_FUTURE = "future_version"
REJECT_ID_TAKEN = "id_taken"  # an accepted id, other content: not a resend
COMPACT_MIN_INTERVAL_S = 30.0


@dataclass
class _Early:
    """A trajectory whose weights (epoch, version) the buffer has not heard of yet."""

    since: float
    identity: bytes
    trajectory: Trajectory
    message: bytes


class BufferServer:
    def __init__(self, config: TrainConfig, stop: StopFlag) -> None:
        net, cfg = config.network, config.buffer
        self.config = config
        self.stop = stop
        self.run_id = config.run.run_id
        self.run_key = read_run_key(config.output_dir)
        self.env_names = frozenset(env.name for env in config.envs)
        self.events = EventLog(config.output_dir, "buffer")
        # Replay starts from the log's own settings (its Settings records), then this start's apply.
        self.groups = GroupBuffer(capacity_groups=cfg.capacity_groups, max_staleness=cfg.max_staleness,
                                  skip_equal_reward_groups=cfg.skip_equal_reward_groups,
                                  group_timeout_s=cfg.group_timeout_s)
        budget = TurnBudgetSchedule.from_config(config.algorithm.rounds_ctrl)
        # no trajectory has more turns than the largest budget (coordinator's RunShape.max_turns), and its summaries
        self.max_turns = max(*budget.rounds, budget.final_max_turns) + config.rollout.context.max_summaries
        self.wal = (WriteAheadLog(config.run_dir.buffer_wal, fsync=cfg.wal_fsync,
                                  segment_bytes=int(cfg.wal_segment_mb * 2**20)) if cfg.wal else None)
        self.recovered_records = self._recover()
        settings = Settings(cfg.capacity_groups, cfg.max_staleness, cfg.skip_equal_reward_groups, cfg.staleness_rule,
                            cfg.max_start_staleness, cfg.on_budget_change, budget.kind, list(budget.rounds),
                            budget.steps_per_stage)
        if self.recovered_records == 0 or settings_of(self.groups) != settings:
            self._log(settings)
        self.bad_messages: Counter[str] = Counter()
        self.messages_read: Counter[str] = Counter()  # per socket: every message is read once and counted
        self.acks: Counter[str] = Counter()
        self._bad_log = RateLimitedLog(log)
        self._known: dict[int, int] = {}  # weight epoch -> newest version announced in it
        self._early: deque[_Early] = deque()
        self._early_ids: set[str] = set()
        self._outbox: defaultdict[bytes, list[tuple[str, str, str]]] = defaultdict(list)  # acks, once durable
        self._reply: tuple[bytes, bytes] | None = None  # a batch, once durable
        # (log ticket, acks, batch reply): what may leave the process once the log is durable up to the ticket
        self._undurable: deque[tuple[int, dict[bytes, list[tuple[str, str, str]]], tuple[bytes, bytes] | None]] = (
            deque())
        self._pending: tuple[bytes, BatchRequest] | None = None
        self._pending_since = 0.0
        self._equal_seen_at_request = 0
        self._last_compaction = 0.0
        self._wal_outage: tuple[float, int] | None = None  # (since, the log's retries then) while its disk refuses
        self._recorder_failing = False
        self._rejected_since_flush: Counter[str] = Counter()
        self._compacted_size = 0
        # Episodes the actors sent with their text, for people (docs/episodes.md): written on acceptance.
        self.recorder = EpisodeRecordWriter(config.run_dir.episode_records,
                                            max_bytes=config.monitor.record_max_mb * 1e6)

        self.ctx = zmq.Context()
        self.security = wire_security(self.ctx, net.host, net.curve_keys_dir)
        self.intake = make_socket(self.ctx, zmq.ROUTER, hwm=cfg.capacity_groups * config.rollout.n,
                                  max_message_bytes=MAX_TRAJECTORY_BYTES, security=self.security, server=True)
        # Bound at the configured ports, or at free ones (port 0) registered with the coordinator, which
        # tells actors and learner where this incarnation is (a restarted buffer may be somewhere new).
        bind, advertised = net.bind_address(), net.advertised_host()
        self.endpoints = {
            ENDPOINT_TRAJECTORIES: bind_endpoint(self.intake, bind, net.trajectory_port, advertised)}
        self.router = make_socket(self.ctx, zmq.ROUTER, max_message_bytes=MAX_REQUEST_BYTES, security=self.security,
                                  server=True)
        self.endpoints[ENDPOINT_BATCHES] = bind_endpoint(self.router, bind, net.batch_port, advertised)
        self.control = make_socket(self.ctx, zmq.SUB, max_message_bytes=MAX_CONTROL_BYTES, security=self.security)
        self.control.connect(net.endpoint(net.control_port))
        self.reports = make_socket(self.ctx, zmq.PUSH, security=self.security)
        self.reports.connect(net.endpoint(net.report_port))
        self._register()
        log.info("trajectories in on %s, batches out on %s; write-ahead log %s", self.endpoints[ENDPOINT_TRAJECTORIES],
                 self.endpoints[ENDPOINT_BATCHES], self.wal.directory if self.wal else "off")

    # ------------------------------------------------------------------ recovery

    def _recover(self) -> int:
        """Rebuild the state from the write-ahead log (a restarted buffer continues where it was)."""
        if self.wal is None or not self.wal.segments():
            return 0
        start, count = time.perf_counter(), 0
        for payload in self.wal.replay():
            apply(self.groups, decode_record(payload))
            count += 1
        g = self.groups
        log.info("recovered %d log records in %.1f s: %d accepted, %d trained, %d in flight, %d held, %d dropped%s",
                 count, time.perf_counter() - start, g.received, g.trained_trajectories, g.in_flight_trajectories(),
                 g.held_trajectories(), sum(g.dropped.values()),
                 f"; cut a torn record of {self.wal.torn_tail_bytes} bytes" if self.wal.torn_tail_bytes else "")
        self.events.emit(RunEvent.BUFFER_RECOVERED, records=count, accepted=g.received,
                         trained=g.trained_trajectories, held=g.held_trajectories())
        return count

    def _log(self, record):
        """Append a state change to the log (durable at the next sync) and apply it; returns what applying returns."""
        if self.wal is not None:
            self.wal.append(encode_record(record))
        return apply(self.groups, record)

    # ------------------------------------------------------------------ main loop

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.control, zmq.POLLIN)
        if self.wal is not None:
            poller.register(self.wal.wakeup_fd, zmq.POLLIN)  # the log's writer made more records durable
        reading = False
        paused = False  # intake paused by backpressure at least once: say when it resumes
        last_beat = 0.0
        while not self.stop:
            # Backpressure: read trajectories only while there is room for them. Both transitions are logged, so
            # the log's last such line says whether the buffer is full now.
            if self.groups.full == reading:
                if reading:
                    poller.unregister(self.intake)
                    log.info("buffer full (%d groups); pausing intake", self.groups.ready_groups)
                    self.events.emit(RunEvent.BUFFER_FULL, ready_groups=self.groups.ready_groups)
                    paused = True
                else:
                    poller.register(self.intake, zmq.POLLIN)
                    if paused:
                        log.info("buffer has room (%d groups); resuming intake", self.groups.ready_groups)
                        self.events.emit(RunEvent.BUFFER_HAS_ROOM, ready_groups=self.groups.ready_groups)
                reading = not reading
            events = dict(poller.poll(200))
            if events.get(self.control):
                self._read_control()
            if events.get(self.intake):
                self._drain_trajectories()
            if events.get(self.router):
                self._read_request()
            self._release_early()
            expired = self.groups.expired_groups()
            if expired:
                self._log(Expired(expired))
            self._serve()
            self._flush()
            if time.monotonic() - last_beat > HEARTBEAT_PERIOD_S:
                self._heartbeat()
                self._watch_the_disk()
                last_beat = time.monotonic()
            self._maybe_compact()

    def _watch_the_disk(self) -> None:
        """An outage of the write-ahead log's disk (its writer retries) begins or ends: an event each, written
        (with the events the disk refused meanwhile) once the disk takes them."""
        failing = self.wal is not None and self.wal.failing_since is not None
        if failing and self._wal_outage is None:
            self._wal_outage = (time.monotonic(), self.wal.write_retries)
            self.events.emit(RunEvent.WRITE_FAILED, path=str(self.wal.directory), error=self.wal.last_error,
                             critical=True)
        elif not failing and self._wal_outage is not None:
            since, retries = self._wal_outage
            self._wal_outage = None
            self.events.emit(RunEvent.WRITE_RECOVERED, path=str(self.wal.directory),
                             retries=self.wal.write_retries - retries, outage_s=round(time.monotonic() - since, 3))
        if self.recorder.failing != self._recorder_failing:
            self._recorder_failing = self.recorder.failing
            if self._recorder_failing:
                self.events.emit(RunEvent.WRITE_FAILED, path=str(self.recorder.directory), critical=False,
                                 error="episode records refused (see the buffer's log)")
            else:
                self.events.emit(RunEvent.WRITE_RECOVERED, path=str(self.recorder.directory),
                                 retries=self.recorder.write_failures, outage_s=None)
        self.events.retry()

    def _flush(self) -> None:
        """Hand the logged records to the log's writer; their consequences (acks, a batch) leave the
        process once they are durable — meanwhile this loop goes on reading (group commit)."""
        self._log_rejections()
        if self._outbox or self._reply is not None:
            ticket = self.wal.submit() if self.wal is not None else 0
            self._undurable.append((ticket, dict(self._outbox), self._reply))
            self._outbox, self._reply = defaultdict(list), None
        elif self.wal is not None:
            self.wal.submit()  # records with no consequence of their own (an expiry, a lineage)
        self._release_durable()

    def _log_rejections(self) -> None:
        """The refusals since the last call as one record (counted already by ``_reject``), ahead of their acks."""
        if self._rejected_since_flush:
            if self.wal is not None:
                self.wal.append(encode_record(RejectedCounts(dict(self._rejected_since_flush))))
            self._rejected_since_flush.clear()

    def _release_durable(self) -> None:
        durable = self.wal.durable if self.wal is not None else 0
        if self.wal is not None:
            self.wal.check()  # the log cannot be written: crash loudly, acknowledge nothing more
            self.wal.clear_wakeup()
        while self._undurable and self._undurable[0][0] <= durable:
            _, acks, reply = self._undurable.popleft()
            for identity, entries in acks.items():
                ids, statuses, reasons = (list(x) for x in zip(*entries))
                self._send(self.intake, identity, TrajectoryAck(run_id=self.run_id, trajectory_ids=ids,
                                                                  statuses=statuses, reasons=reasons))
            if reply is not None:
                self._send_bytes(self.router, *reply)

    # ------------------------------------------------------------------ trajectories in

    def _drain_trajectories(self) -> None:
        for _ in range(DRAIN_PER_POLL):
            try:
                frames = self.intake.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.messages_read["intake"] += 1
            if len(frames) == 2 and len(frames[1]) <= MAX_TRAJECTORY_BYTES:
                # the cheap limits first, from the msgpack headers: no in-limit message costs many times its size
                refused = trajectory_size_problem(frames[1], max_tokens=self.config.rollout.max_context_tokens,
                                                  max_turns=self.max_turns)
                if refused is not None:
                    self._reject(frames[0], *refused)
                    continue
            received = self._decoded(frames, Trajectory, MAX_TRAJECTORY_BYTES, "intake", "trajectory")
            if received is None:
                continue
            identity, trajectory = received
            self._admit(identity, trajectory, frames[1])
            if self.groups.full:
                return

    def _admit(self, identity: bytes, t: Trajectory, message: bytes) -> None:
        tid = t.trajectory_id
        digest = content_digest(message)
        if tid in self.groups.seen:
            if self.groups.is_resend(tid, digest):
                self._ack(identity, tid, ACK_DUPLICATE)
            else:  # someone else's episode under an accepted id: refused (and counted), never taken for a resend
                self._reject(identity, tid, REJECT_ID_TAKEN, "an accepted trajectory has this id and other content")
            return
        if tid in self._early_ids:
            return  # a resend of one still waiting for its weights to be announced
        rollout = self.config.rollout
        problem = (trajectory_problem(t, self.config.model.vocab_size, max_tokens=rollout.max_context_tokens,
                                      max_group_size=rollout.n, env_names=self.env_names)
                   or self._future_problem(t) or self.groups.admission_problem(t))
        if problem is not None:
            self._reject(identity, tid, *problem)
            return
        if not self._weights_known(t):
            self._early.append(_Early(time.monotonic(), identity, t, message))
            self._early_ids.add(tid)
            return
        if self.wal is not None:
            self.wal.append(accepted_parts(message))  # encode_record(Accepted(message)), without copying it
        self.groups.accept(t, digest)  # what applying the record does, without decoding the message again
        self._ack(identity, tid, ACK_ACCEPTED)
        if t.text is not None:
            self.recorder.write(episode_record(t))

    def _weights_known(self, t: Trajectory) -> bool:
        """Whether every turn's weights were announced. Turns of an epoch older than the newest known
        are let in (the learner's lineage decides their fate when a batch is made)."""
        newest = max(self._known, default=0)
        for epoch, version in t.weight_keys():
            if version == 0 or epoch < newest:
                continue
            if epoch > newest or version > self._known.get(epoch, 0):
                return False
        return True

    def _release_early(self) -> None:
        now = time.monotonic()
        for _ in range(len(self._early)):
            early = self._early.popleft()
            tid = early.trajectory.trajectory_id
            if self._weights_known(early.trajectory):
                self._early_ids.discard(tid)
                self._admit(early.identity, early.trajectory, early.message)
            elif now - early.since > self.config.buffer.future_hold_s:
                self._early_ids.discard(tid)
                self._reject(early.identity, tid, REJECT_FUTURE, f"its weights (epoch {early.trajectory.turn_epochs}, "
                             f"version {early.trajectory.turn_versions}) were never announced")
            else:
                self._early.append(early)

    def _reject(self, identity: bytes, trajectory_id: str, reason: str, detail: str) -> None:
        """Refuse a trajectory: counted by reason (and logged, so that the accounting lists it), acknowledged as
        rejected so that its actor forgets it."""
        self.groups.reject(reason)
        self._rejected_since_flush[reason] += 1  # logged as one RejectedCounts at the next _flush
        self._bad_log.warning("rejected trajectory %s: %s (%s)", shown(trajectory_id, MAX_ID_CHARS), reason, detail)
        self._ack(identity, trajectory_id, ACK_REJECTED, reason)

    def _future_problem(self, t: Trajectory) -> tuple[str, str] | None:
        """Weights nobody announced and nobody will: a version past the run's last step, or, in a weight epoch that
        has ended (a newer one is known), past both the newest version it announced and the step the next epoch
        resumed from. (Versions of the newest epoch not announced yet wait in ``_early`` for a while.)"""
        newest = max(self._known, default=0)
        for epoch, version in t.weight_keys():
            if version > self.config.learner.total_steps:
                return REJECT_FUTURE, f"weights (epoch {epoch}, version {version}) past the run's last step"
            bound = max(self._known.get(epoch, -1), self._resumed_after(epoch)) if epoch < newest else -1
            if 0 <= bound < version:
                return REJECT_FUTURE, (f"weights (epoch {epoch}, version {version}): epoch {epoch} ended, having "
                                       f"announced up to version {bound}")
        return None

    def _resumed_after(self, epoch: int) -> int:
        """The step the weight epoch after ``epoch`` in the learner's lineage resumed from (-1: not known)."""
        lineage = self.groups.lineage
        for (e, _), (_, start) in zip(lineage, lineage[1:]):
            if e == epoch:
                return start
        return -1

    def _ack(self, identity: bytes, trajectory_id: str, status: str, reason: str = "") -> None:
        self._outbox[identity].append((trajectory_id, status, reason))
        self.acks[status] += 1

    def _hear_weights(self, epoch: int, version: int) -> None:
        self._known[epoch] = max(self._known.get(epoch, 0), version)

    def _read_control(self) -> None:
        while True:
            try:
                data = self.control.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.messages_read["control"] += 1
            try:
                control = decode_as(data, Control, MAX_CONTROL_BYTES, self.run_id)
            except ProtocolError as exc:
                self._count_bad("control", str(exc))
                continue
            if not signed_by(control, self.run_key):  # not the coordinator's: it could claim any version
                self._count_bad("control_unauthenticated", "a Control not signed with the run's key")
                continue
            self._hear_weights(control.weight_epoch, control.weight_version)

    # ------------------------------------------------------------------ batches out

    def _read_request(self) -> None:
        frames = self.router.recv_multipart()
        self.messages_read["requests"] += 1
        received = self._decoded(frames, BatchRequest, MAX_REQUEST_BYTES, "request", "batch request")
        if received is None:
            return
        identity, request = received
        if not signed_by(request, self.run_key):
            # only the learner may roll batches back or commit them (a forged request could have them trained twice)
            self._count_bad("request_unauthenticated", "batch request without the run's key (<output_dir>/run_key)")
            return
        problem = self._request_problem(request)
        if problem is not None:
            self._count_bad("request_malformed", f"batch request: {problem}")
            return
        lineage = [(int(e), int(b)) for e, b in request.lineage]
        if lineage != self.groups.lineage:
            self._log(Lineage(lineage))
        if request.committed_step > self.groups.committed_step:
            self._log(Committed(request.committed_step))
        stale_batches = self.groups.batches_to_roll_back(request.learner_version)
        if stale_batches:
            log.info("rolling back batches %s: the learner asks for step %d again (a lost reply, or it resumed)",
                     stale_batches, request.learner_version + 1)
            self._log(RolledBack(stale_batches))
        self._hear_weights(lineage[-1][0], request.learner_version)
        self._pending = (identity, request)  # a newer request replaces an older one
        self._pending_since = time.monotonic()
        self._equal_seen_at_request = self.groups.equal_groups_seen

    def _request_problem(self, request: BatchRequest) -> str | None:
        """What a request from the run's learner cannot be (its numbers bound what the buffer does for it)."""
        learner = self.config.learner
        if not 1 <= request.num_groups <= learner.groups_per_step:
            return f"{request.num_groups} groups (a step takes {learner.groups_per_step})"
        if not 0 <= request.committed_step <= request.learner_version <= learner.total_steps:
            return f"committed step {request.committed_step}, learner version {request.learner_version}"
        if not request.lineage or any(min(e, b) < 0 for e, b in request.lineage):
            return f"lineage {request.lineage[:8]}"
        return None

    def _serve(self) -> None:
        if self._pending is None:
            return
        identity, request = self._pending
        cfg = self.config.buffer
        # Starved: the actors keep finishing groups with no signal (the policy solves, or
        # fails, everything), or the request has simply waited too long.
        starved = (self.groups.equal_groups_seen - self._equal_seen_at_request >= cfg.equal_reward_fallback_groups
                   or time.monotonic() - self._pending_since >= cfg.equal_reward_fallback_s)
        group_ids = self.groups.choose(request.num_groups, request.learner_version, allow_equal=starved)
        if group_ids is None:
            return
        groups = self._log(Served(self.groups.next_batch, request.request_id, request.learner_version, group_ids))
        self.recorder.write(trained_record(request.learner_version + 1, group_ids))
        batch = Batch(run_id=self.run_id, request_id=request.request_id, groups=groups, buffer_stats=self.stats())
        self._reply = (identity, encode(batch))
        self._pending = None

    # ------------------------------------------------------------------ upkeep

    def _maybe_compact(self) -> None:
        """Past ``wal_compact_mb``, replace the payloads of resolved trajectories with their stubs."""
        if self.wal is None:
            return
        limit = self.config.buffer.wal_compact_mb * 2**20
        size = self.wal.size_bytes() if time.monotonic() - self._last_compaction > COMPACT_MIN_INTERVAL_S else 0
        if size < max(limit, self._compacted_size + limit / 2):
            return
        if self.wal.failing_since is not None:
            return  # the disk refuses the log's own writes: no room for a rewrite either
        start = time.perf_counter()
        try:
            before, after = self.wal.rewrite_closed(lambda record: compacted(record, self.groups))
            self.wal.merge_closed()
        except OSError as exc:  # a full disk has no room for the rewritten copy: the log stays as it was
            self._last_compaction = time.monotonic()
            log.warning("cannot compact the write-ahead log %s now (%s: %s); trying again in %.0f s",
                        self.wal.directory, type(exc).__name__, exc, COMPACT_MIN_INTERVAL_S)
            return
        self._last_compaction, self._compacted_size = time.monotonic(), self.wal.size_bytes()
        log.info("compacted the write-ahead log: %.1f MB of closed segments -> %.1f MB in %.1f s", before / 2**20,
                 after / 2**20, time.perf_counter() - start)

    def _decoded(self, frames: list[bytes], kind: type, limit: int, socket: str, what: str):
        """(identity, message) of one ROUTER message of ``kind``; None when it is not one, counted as
        ``<socket>_frames``, ``<socket>_other_run`` or ``<socket>_malformed``."""
        if len(frames) != 2:
            self._count_bad(f"{socket}_frames", f"{what} message with {len(frames) - 1} frames")
            return None
        identity, data = frames
        try:
            return identity, decode_as(data, kind, limit, self.run_id)
        except ForeignRunError as exc:
            self._count_bad(f"{socket}_other_run", str(exc))
        except ProtocolError as exc:
            self._count_bad(f"{socket}_malformed", f"{what}: {exc}")
        return None

    def _count_bad(self, kind: str, what: str) -> None:
        self.bad_messages[kind] += 1
        self._bad_log.warning("rejected malformed message #%d (%s): %s", sum(self.bad_messages.values()), kind, what)

    def stats(self) -> dict[str, float]:
        out = {**self.groups.stats(), "bad_messages": float(sum(self.bad_messages.values())),
               "early_held": float(len(self._early)), "recovered_records": float(self.recovered_records),
               "episode_record_write_failures": float(self.recorder.write_failures)}
        out.update({f"bad_messages_{k}": float(v) for k, v in self.bad_messages.items()})
        out.update({f"acks_{k}": float(v) for k, v in self.acks.items()})
        out.update({f"messages_read_{k}": float(v) for k, v in self.messages_read.items()})
        if self.wal is not None:
            out["wal_bytes_written"] = float(self.wal.bytes_written)
            out["wal_write_retries"] = float(self.wal.write_retries)  # a disk fault, not a restart
        return out

    def _heartbeat(self) -> None:
        beat = Heartbeat(run_id=self.run_id, role="buffer", index=0, pid=os.getpid(), counters=self.stats(),
                         key=self.run_key)
        try:
            self.reports.send(encode(beat), zmq.NOBLOCK)
        except zmq.Again:
            pass  # the coordinator is not reading; liveness is also watched by the launcher
        self._register()  # again with every beat: the coordinator publishes only changes, so a lost one heals

    def _register(self) -> None:
        try:
            self.reports.send(registration(self.run_id, "buffer", self.endpoints, self.run_key), zmq.NOBLOCK)
        except zmq.Again:
            pass  # the next heartbeat sends it again

    def _send(self, sock: zmq.Socket, identity: bytes, message) -> None:
        self._send_bytes(sock, identity, encode(message))

    @staticmethod
    def _send_bytes(sock: zmq.Socket, identity: bytes, data: bytes) -> None:
        try:
            sock.send_multipart([identity, data], zmq.NOBLOCK)
        except zmq.Again:
            pass  # the peer is gone or not reading: it resends (actor) or asks again (learner)

    def close(self) -> None:
        self.recorder.close()
        self._log_rejections()
        if self.wal is not None:
            self.wal.sync()
            self._release_durable()  # acknowledge what is durable before going
            self.wal.close()
        else:
            self._release_durable()
        for sock in (self.intake, self.router, self.control, self.reports):
            sock.close(linger=0)
        if self.security is not None:
            self.security.stop()
        self.ctx.term()


def main(config: TrainConfig) -> int:
    return run_buffer(config, StopFlag().install())


def run_buffer(config: TrainConfig, stop: StopFlag) -> int:
    """The buffer until ``stop``."""
    server = BufferServer(config, stop)
    try:
        server.run()
    finally:
        log.info("stopping (%s); final counters %s", stop.signal_name or "stop", server.stats())
        server.close()
    return 0
