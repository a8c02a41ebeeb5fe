"""Steps 1 and 2 of joining the learner's weight hub (``protocol/weights.py``), shared by both kinds of member:
reach the hub's store (bounded, :func:`connect_store`), take a join number and say who joins
(:func:`announce_join`). The two-rank group (``weight_receiver.py``) or the CUDA-IPC link (``weight_ipc.py``) is
formed after it."""

from __future__ import annotations

import os
import threading
from datetime import timedelta

import msgspec
import torch.distributed as dist

from horizonrl.protocol import WeightJoin, encode
from horizonrl.protocol.weights import JOIN_COUNTER, RUN_KEY_ENV, STORE_PREFIX, join_key


def announce_join(host: str, port: int, timeout_s: float, join: WeightJoin,
                  connect_timeout_s: float | None = None) -> tuple[dist.Store, dist.Store, int]:
    """Steps 1 and 2 of a join (``protocol/weights.py``): take a join number and say who joins.
    Returns (the store, its join prefix, the number); RuntimeError if the store is not reachable within
    ``connect_timeout_s`` (default ``timeout_s``), the store's timeout for everything after."""
    store = connect_store(host, port, timeout_s if connect_timeout_s is None else connect_timeout_s)
    store.set_timeout(timedelta(seconds=timeout_s))
    joins = dist.PrefixStore(STORE_PREFIX, store)
    number = joins.add(JOIN_COUNTER, 1)
    if not join.key:  # the run's key, from the actor process that started this engine (protocol/weights.py)
        join = msgspec.structs.replace(join, key=os.environ.get(RUN_KEY_ENV, ""))
    joins.set(join_key(number), encode(join))
    return store, joins, number


STORE_ANSWER_MARGIN_S = 5.0  # past the connect timeout, for the store's first answer


def connect_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A client of the TCPStore at ``host:port``; RuntimeError if it is not there and answering within
    ``timeout_s`` (+ a margin).

    Why a thread: the client's constructor bounds only each connect (a refused port is retried for about twice
    its timeout), and its first question (a ping) waits without a bound, so a port that takes the connection
    but never answers — a dead learner's hub port, taken meanwhile by another process's listener — held a
    rejoining engine until the actor's own timeout failed it (the Ray launcher test, once). The constructor
    releases the GIL; a thread given up on stays blocked only until that listener closes the connection."""
    made: list = []

    def connect() -> None:
        try:
            made.append(dist.TCPStore(host, port, None, False, timedelta(seconds=timeout_s)))
        except Exception as error:  # noqa: BLE001 - handed to the caller below
            made.append(error)

    thread = threading.Thread(target=connect, name="connect-weight-hub-store", daemon=True)
    thread.start()
    thread.join(timeout_s + STORE_ANSWER_MARGIN_S)
    if not made:
        raise RuntimeError(f"the store at {host}:{port} did not answer within {timeout_s + STORE_ANSWER_MARGIN_S:.0f} "
                           "s: not up, or the port is not the hub's (a dead learner's, taken by another listener)")
    if isinstance(made[0], Exception):
        raise RuntimeError(str(made[0]).splitlines()[0] if str(made[0]) else type(made[0]).__name__) from made[0]
    return made[0]
