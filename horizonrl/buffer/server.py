"""The buffer process: trajectories in (PULL), whole batches of groups out (ROUTER).

Backpressure: while ``capacity_groups`` complete groups wait for the learner, the
buffer stops reading its PULL socket. Messages then queue in ZMQ (bounded by the
high-water marks) and the actors' sends block, so actors slow down; nothing is lost.
Malformed, oversized or wrong-version messages are counted and logged, never fatal.
"""

from __future__ import annotations

import logging
import os
import time

import zmq

from horizonrl.buffer.groups import GroupBuffer
from horizonrl.config import TrainConfig
from horizonrl.protocol import Batch, BatchRequest, Heartbeat, ProtocolError, Trajectory, decode_as, encode
from horizonrl.protocol.transport import make_socket
from horizonrl.runtime import RateLimitedLog, StopFlag

log = logging.getLogger("horizonrl.buffer")

MAX_TRAJECTORY_BYTES = 64 * 1024 * 1024
MAX_REQUEST_BYTES = 64 * 1024
DRAIN_PER_POLL = 256
HEARTBEAT_PERIOD_S = 0.25  # also the latency of the coordinator's rollout pause


class BufferServer:
    def __init__(self, config: TrainConfig, stop: StopFlag) -> None:
        net, cfg = config.network, config.buffer
        self.stop = stop
        self.groups = GroupBuffer(
            capacity_groups=cfg.capacity_groups,
            max_staleness=cfg.max_staleness,
            skip_equal_reward_groups=cfg.skip_equal_reward_groups,
            group_timeout_s=cfg.group_timeout_s,
        )
        self.bad_messages = 0
        self._bad_log = RateLimitedLog(log)
        self.ctx = zmq.Context()
        self.pull = make_socket(self.ctx, zmq.PULL, hwm=cfg.capacity_groups * config.rollout.n)
        self.pull.bind(net.endpoint(net.trajectory_port))
        self.router = make_socket(self.ctx, zmq.ROUTER)
        self.router.bind(net.endpoint(net.batch_port))
        self.reports = make_socket(self.ctx, zmq.PUSH)
        self.reports.connect(net.endpoint(net.report_port))
        self._pending: tuple[bytes, BatchRequest] | None = None
        self._pending_since = 0.0
        self._equal_seen_at_request = 0
        self._equal_fallback_s = cfg.equal_reward_fallback_s
        self._equal_fallback_groups = cfg.equal_reward_fallback_groups
        log.info("trajectories in on %s, batches out on %s", net.endpoint(net.trajectory_port), net.endpoint(net.batch_port))

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        reading = False
        last_beat = 0.0
        while not self.stop:
            # Backpressure: read trajectories only while there is room for them.
            if self.groups.full == reading:
                if reading:
                    poller.unregister(self.pull)
                    log.info("buffer full (%d groups); pausing intake", self.groups.ready_groups)
                else:
                    poller.register(self.pull, zmq.POLLIN)
                reading = not reading
            events = dict(poller.poll(200))
            if events.get(self.pull):
                self._drain_trajectories()
            if events.get(self.router):
                self._read_request()
            self.groups.expire()
            self._serve()
            if time.monotonic() - last_beat > HEARTBEAT_PERIOD_S:
                self._heartbeat()
                last_beat = time.monotonic()

    def _drain_trajectories(self) -> None:
        for _ in range(DRAIN_PER_POLL):
            try:
                data = self.pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self.groups.add(decode_as(data, Trajectory, MAX_TRAJECTORY_BYTES))
            except ProtocolError as exc:
                self._count_bad(f"trajectory: {exc}")
            if self.groups.full:
                return

    def _read_request(self) -> None:
        frames = self.router.recv_multipart()
        if len(frames) != 2:
            self._count_bad(f"batch request with {len(frames)} frames")
            return
        identity, data = frames
        try:
            request = decode_as(data, BatchRequest, MAX_REQUEST_BYTES)
        except ProtocolError as exc:
            self._count_bad(f"batch request: {exc}")
            return
        if request.num_groups < 1:
            self._count_bad(f"batch request for {request.num_groups} groups")
            return
        self._pending = (identity, request)  # a newer request replaces an older one
        self._pending_since = time.monotonic()
        self._equal_seen_at_request = self.groups.equal_groups_seen

    def _serve(self) -> None:
        if self._pending is None:
            return
        identity, request = self._pending
        # Starved: the actors keep finishing groups with no signal (the policy solves, or
        # fails, everything), or the request has simply waited too long.
        starved = (self.groups.equal_groups_seen - self._equal_seen_at_request >= self._equal_fallback_groups
                   or time.monotonic() - self._pending_since >= self._equal_fallback_s)
        groups = self.groups.take(request.num_groups, request.learner_version, allow_equal=starved)
        if groups is None:
            return
        stats = self.stats()
        self.router.send_multipart([identity, encode(Batch(request_id=request.request_id, groups=groups, buffer_stats=stats))])
        self._pending = None

    def _count_bad(self, what: str) -> None:
        self.bad_messages += 1
        self._bad_log.warning("rejected malformed message #%d: %s", self.bad_messages, what)

    def stats(self) -> dict[str, float]:
        return {**self.groups.stats(), "bad_messages": float(self.bad_messages)}

    def _heartbeat(self) -> None:
        beat = Heartbeat(role="buffer", index=0, pid=os.getpid(), counters=self.stats())
        try:
            self.reports.send(encode(beat), zmq.NOBLOCK)
        except zmq.Again:
            pass  # the coordinator is not reading; liveness is also watched by the launcher

    def close(self) -> None:
        for sock in (self.pull, self.router, self.reports):
            sock.close(linger=0)
        self.ctx.term()


def main(config: TrainConfig) -> int:
    stop = StopFlag().install()
    server = BufferServer(config, stop)
    try:
        server.run()
    finally:
        log.info("stopping (%s); final counters %s", stop.signal_name or "stop", server.stats())
        server.close()
    return 0
