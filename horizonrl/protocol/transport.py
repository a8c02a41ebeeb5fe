"""ZeroMQ sockets with the project's conventions, for every process boundary.

Semantics (the same everywhere):
- PUSH/PULL for trajectories and reports. A PUSH socket queues at most ``hwm``
  messages per peer; beyond that ``send`` blocks (or, with a send timeout, raises
  ``zmq.Again``), which is how backpressure reaches the producer. Nothing is dropped
  by the transport itself: a message is either delivered, still queued, or the send
  call told the caller it failed.
- PUB/SUB for control. SUB is lossy by design (a slow or late subscriber misses
  messages), so the publisher republishes the whole current state periodically and
  every control message is self-contained.
- ROUTER/DEALER for request/reply (learner <-> buffer), so a timed-out request never
  wedges a REQ state machine.
Sockets close with ``linger=0``: shutting down never waits for unsent messages.
Endpoints are ``tcp://127.0.0.1:PORT`` unless configured otherwise.
"""

from __future__ import annotations

import socket

import zmq

DEFAULT_HWM = 64


def make_socket(context: zmq.Context, kind: int, *, hwm: int = DEFAULT_HWM) -> zmq.Socket:
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    return sock



def tcp_endpoint(host: str, port: int) -> str:
    return f"tcp://{host}:{port}"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
