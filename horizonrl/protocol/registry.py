"""Addresses by registration: the coordinator is the registry.

Bottom layer (no torch, no vllm). The coordinator's address (``network.host``, ``control_port``,
``report_port``) is the one every process is given. A process that serves something binds it on its
own host — at the configured port, or at any free one when that port is 0 — and sends a
:class:`~horizonrl.protocol.messages.Registration` on its report socket; the coordinator publishes
every registered endpoint in each ``Control`` (republished every half second). A client of a
registered endpoint takes it from ``Control`` and follows it: when the server restarts elsewhere (a
new port, another node) and registers again, the client disconnects from the old endpoint and
connects to the new one (:class:`FollowedEndpoint`).

With every port configured (``launcher.type=local`` resolves them all before it starts anything)
clients connect to the configured ports at once, exactly as before registration existed; servers
still register, which changes nothing for them.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping

import zmq

from horizonrl.protocol.codec import ProtocolError, decode_as, encode, signed_by
from horizonrl.protocol.messages import MAX_CONTROL_BYTES, Control, Registration
from horizonrl.protocol.transport import make_socket

log = logging.getLogger(__name__)

POLL_SLICE_S = 0.2
# One learner incarnation's id, set by its launcher for every rank: the rank-0 rendezvous it registers is named
# after it (messages.learner_rendezvous_name), so a restarted learner's ranks never meet at the old address.
LEARNER_GANG_ENV = "HORIZONRL_LEARNER_GANG"


def registration(run_id: str, name: str, endpoints: Mapping[str, str], key: str = "") -> bytes:
    """The encoded Registration of this process's ``endpoints``; ``key``: the run's (messages.py)."""
    return encode(Registration(run_id=run_id, name=name, pid=os.getpid(), endpoints=dict(endpoints), key=key))


class FollowedEndpoint:
    """A client socket kept connected to the newest endpoint registered under ``name``.

    ``fixed``: a configured endpoint; the socket connects to it at once and never follows the
    registry. Otherwise it connects on the first :meth:`update` that names ``name``. ZMQ queues
    what is sent meanwhile up to the socket's high-water mark (DEALER/PUSH: a send with no peer
    waits), and nothing sent to a dead endpoint is lost here: the protocols above resend what was
    never acknowledged (trajectories, batch requests)."""

    def __init__(self, sock: zmq.Socket, name: str, fixed: str | None = None) -> None:
        self.sock = sock
        self.name = name
        self.fixed = fixed is not None
        self.current: str | None = None
        if fixed is not None:
            sock.connect(fixed)
            self.current = fixed

    @property
    def connected(self) -> bool:
        return self.current is not None

    def update(self, endpoints: Mapping[str, str]) -> bool:
        """Follow ``endpoints[name]`` when it is new; True when the socket was (re)connected."""
        new = endpoints.get(self.name)
        if self.fixed or not new or new == self.current:
            return False
        if self.current is not None:
            try:
                self.sock.disconnect(self.current)
            except zmq.ZMQError:  # never connected (it was unreachable): nothing to undo
                pass
            log.info("%s moved from %s to %s: reconnecting", self.name, self.current, new)
        self.sock.connect(new)
        self.current = new
        return True


def wait_for_endpoints(context: zmq.Context, control_endpoint: str, run_id: str,
                       ready: Callable[[Mapping[str, str]], bool], timeout_s: float, *, security=None,
                       should_stop: Callable[[], bool] = lambda: False, key: str = "") -> dict[str, str] | None:
    """Subscribe to the coordinator's Control (signed with ``key``, the run's) until its endpoints satisfy
    ``ready``; returns them, or None when ``should_stop()`` says so first. TimeoutError after ``timeout_s``."""
    sock = make_socket(context, zmq.SUB, max_message_bytes=MAX_CONTROL_BYTES, security=security)
    sock.connect(control_endpoint)
    deadline = time.monotonic() + timeout_s
    seen: dict[str, str] = {}
    try:
        while not should_stop():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the coordinator at {control_endpoint} published no usable endpoints within "
                                   f"{timeout_s:.0f} s (registered so far: {sorted(seen) or 'none'})")
            if not sock.poll(int(POLL_SLICE_S * 1000)):
                continue
            try:
                control = decode_as(sock.recv(), Control, MAX_CONTROL_BYTES, run_id)
            except ProtocolError:
                continue
            if not signed_by(control, key):
                continue  # not the coordinator's
            seen = dict(control.endpoints)
            if ready(seen):
                return seen
        return None
    finally:
        sock.close(linger=0)
