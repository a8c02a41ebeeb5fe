"""The weight hub's door (``weight_broadcast.WeightHub``): who may join, and the link each newcomer gets.

A join takes two steps on the hub's store (``protocol/weights.py``): a number from the join counter, then the
join record under that number. :class:`JoinDesk` polls the counter, waits for each record (a joiner that dies
between the steps is forgotten after the timeout, counted ``failed_joins``), refuses a record of another run
(``bad_joins``) or one without the run's key (``unauthenticated_joins``: nothing spent on it, no group, no
version), and forms the newcomer's link — a two-rank group on the store, or a CUDA-IPC socket for the engine on
the learner's GPU — each in a thread of its own with its own bound, so a joiner that never completes costs the
others nothing. The hub takes it from there (``admit``: the first version, then membership).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
import zmq

from horizonrl.learner.weight_ipc import IpcSender
from horizonrl.learner.weight_links import GroupLink, WeightLink, gloo_options
from horizonrl.protocol import ProtocolError, WeightJoin, decode_as, signed_by
from horizonrl.protocol.weights import JOIN_COUNTER, WeightSyncError, join_key, member_prefix

log = logging.getLogger("horizonrl.learner.weights")

ADMIT_POLL_S = 0.2

Admit = Callable[[int, WeightJoin, int, WeightLink], None]  # (join number, join, engine worker, its link)


class JoinDesk:
    """Polls the hub's store for joins and hands each authenticated newcomer's link to ``admit``, in a thread of
    its own. ``counters`` and ``closed`` are the hub's: the desk counts its refusals there and stops with it."""

    def __init__(self, joins: dist.Store, *, run_id: str, run_key: str, host: str, address: str, backend: str,
                 device: torch.device, timeout_s: float, counters: Counter, closed: threading.Event,
                 admit: Admit) -> None:
        self.joins = joins  # the store under the hub's join prefix
        self.run_id, self.run_key = run_id, run_key
        self.host, self.address = host, address  # gloo's pair sockets listen on host; address: the hub's store
        self.backend, self.device, self.timeout_s = backend, device, timeout_s
        self.counters, self.closed, self.admit = counters, closed, admit
        self._seen = 0  # join numbers up to this one are handled
        self._waiting: dict[int, float] = {}  # join numbers whose record has not appeared yet -> since
        self._poller = threading.Thread(target=self._poll_forever, name="weight-hub", daemon=True)
        self._zmq: zmq.Context | None = zmq.Context()  # the sockets of CUDA-IPC members (colocated engine)
        self._zmq_lock = threading.Lock()

    def start(self) -> None:
        self._poller.start()

    def close(self) -> None:
        """Admit no one more (``closed`` is set by the hub first) and close the IPC sockets' context, a socket an
        admission thread is still connecting included."""
        with self._zmq_lock:
            if self._zmq is not None:
                self._zmq.destroy(linger=0)
                self._zmq = None

    def _poll_forever(self) -> None:
        while not self.closed.wait(ADMIT_POLL_S):
            try:
                count = self.joins.add(JOIN_COUNTER, 0)
            except RuntimeError as exc:
                log.warning("weight hub: reading the join counter failed: %s", exc)
                continue
            now = time.monotonic()
            for number in range(self._seen + 1, count + 1):
                self._waiting.setdefault(number, now)
            self._seen = max(self._seen, count)
            for number, since in list(self._waiting.items()):
                if self.joins.check([join_key(number)]):
                    del self._waiting[number]
                    threading.Thread(target=self._take, args=(number,), name=f"weight-join-{number}",
                                     daemon=True).start()
                elif now - since > self.timeout_s:  # the joiner died between its two steps
                    del self._waiting[number]
                    self.counters["failed_joins"] += 1
                    log.warning("weight hub: join %d never said who it is; forgotten", number)

    def _take(self, number: int) -> None:
        """Join ``number``: checked, its link formed, handed to the hub; or refused and counted."""
        try:
            join = decode_as(self.joins.get(join_key(number)), WeightJoin, run_id=self.run_id)
        except (ProtocolError, RuntimeError) as exc:  # another run's engine, or not a join at all
            self.counters["bad_joins"] += 1
            log.warning("weight hub: refused join %d: %s", number, exc)
            return
        if not signed_by(join, self.run_key):
            self.counters["unauthenticated_joins"] += 1  # nothing spent on it: no group, no version
            log.warning("weight hub: refused join %d (actor %d, pid %d): without the run's key", number, join.actor,
                        join.pid)
            return
        worker = int(getattr(join, "worker", 0))
        try:
            link = self._connect_ipc(join) if join.ipc_address else GroupLink(
                self._form_group(number), self.device, group_timeout_s=self.timeout_s)
        except WeightSyncError as exc:
            self.counters["failed_joins"] += 1
            log.warning("weight hub: actor %d worker %d (pid %d) did not complete its join %d: %s", join.actor, worker,
                        join.pid, number, exc)
            return
        self.admit(number, join, worker, link)

    def _connect_ipc(self, join: WeightJoin) -> WeightLink:
        """The link of an engine on this GPU (colocated): a PAIR socket to the address it listens on."""
        if self.device.type != "cuda":
            raise WeightSyncError(f"actor {join.actor} asked for CUDA IPC, but this hub runs on the CPU "
                                  f"({self.backend}): only an engine on the learner's GPU can take weights that way")
        if not join.ipc_address.startswith("tcp://"):
            raise WeightSyncError(f"actor {join.actor}'s CUDA-IPC address {join.ipc_address!r} is not tcp://HOST:PORT")
        with self._zmq_lock:
            if self._zmq is None:
                raise WeightSyncError("weight hub: closed")
            sock = self._zmq.socket(zmq.PAIR)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(join.ipc_address)
        return IpcSender(sock, self.device, self.timeout_s)

    def _form_group(self, number: int) -> dist.ProcessGroup:
        timeout = timedelta(seconds=self.timeout_s)
        store = dist.PrefixStore(member_prefix(number), self.joins)
        try:
            if self.backend == "nccl":
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = timeout
                return dist.ProcessGroupNCCL(store, 0, 2, options)
            return dist.ProcessGroupGloo(store, 0, 2, gloo_options(self.host, timeout))
        except RuntimeError as exc:  # DistStoreError / DistNetworkError / DistBackendError
            raise WeightSyncError(f"group of join {number} at {self.address} ({self.backend}) not formed within "
                                  f"{self.timeout_s:.0f} s: {exc}") from exc
