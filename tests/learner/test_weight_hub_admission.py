"""The weight hub's door (learner/weight_admission.py JoinDesk, in front of learner/weight_broadcast.py): a join
without the run's key costs nothing and is counted; a joiner that never receives holds no publish (its first
version goes outside the hub's lock, from a copy no publish rewrites meanwhile); the hub's store listens on the
run's bind address only; a join with the key (the engine worker reads it from its actor's environment) is
admitted with real gloo groups."""

from __future__ import annotations

import threading
import time

import psutil
import pytest
import torch

import horizonrl.learner.weight_admission as weight_admission
from horizonrl.actors.weight_join import announce_join
from horizonrl.actors.weight_receiver import join_weight_hub, receive_weights
from horizonrl.learner.weight_broadcast import WeightHub
from horizonrl.learner.weight_links import Member
from horizonrl.protocol import WeightJoin
from horizonrl.protocol.weights import RUN_KEY_ENV

RUN_ID = "door"
KEY = "0123456789abcdef0123456789abcdef"
THAW = threading.Event()


class Link:
    """Takes everything; ``frozen``: never returns from ``begin`` until the test ends (a joiner that never
    receives, whatever its bound)."""

    def __init__(self, frozen: bool = False) -> None:
        self.frozen, self.buckets = frozen, []

    def begin(self, layout_bytes, bucket_bytes, what, timeout_s) -> None:
        if self.frozen:
            THAW.wait(120)

    def send_bucket(self, index, data, what, timeout_s) -> None:
        self.buckets.append(data.clone())

    def finish(self, what, timeout_s) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.fixture
def hub():
    THAW.clear()
    hub = WeightHub("127.0.0.1", 0, backend="gloo", timeout_s=300, run_id=RUN_ID, run_key=KEY)
    hub.pack(0, [("w", torch.zeros(64, 64))])
    yield hub
    THAW.set()
    hub.close()


def in_thread(target, *args) -> threading.Thread:
    thread = threading.Thread(target=target, args=args, daemon=True)
    thread.start()
    return thread


def test_a_join_without_the_runs_key_is_refused_before_anything_is_spent_on_it(hub, monkeypatch):
    formed = []
    monkeypatch.setattr(hub.desk, "_form_group", lambda number: formed.append(number))
    for key in ("", "not-the-key"):
        _, _, number = announce_join("127.0.0.1", hub.port, 10, WeightJoin(run_id=RUN_ID, actor=0, pid=7, key=key))
        hub.desk._take(number)
    assert hub.counters["unauthenticated_joins"] == 2 and not formed and not hub.members


def test_a_joiner_that_never_receives_holds_no_publish_and_its_copy_is_not_rewritten(hub, monkeypatch):
    monkeypatch.setattr(weight_admission, "GroupLink", lambda group, device, **_: Link(frozen=True))
    monkeypatch.setattr(hub.desk, "_form_group", lambda number: object())
    healthy = Link()
    hub.members[(1, 0)] = Member(1, 1, 0, 101, healthy)
    first_copy = hub.latest.buckets[0]
    _, _, number = announce_join("127.0.0.1", hub.port, 10, WeightJoin(run_id=RUN_ID, actor=0, pid=7, key=KEY))
    admission = in_thread(hub.desk._take, number)
    deadline = time.monotonic() + 10
    while hub.latest.readers == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert hub.latest.readers == 1  # the joiner is reading version 0, stuck in its first collective
    start = time.monotonic()
    stats = hub.send(hub.pack(1, [("w", torch.ones(64, 64))]))  # a frozen joiner's bound is 20 s + 5 s
    assert time.monotonic() - start < 5 and stats["dropped"] == 0 and admission.is_alive()
    assert hub.members[(1, 0)].has == (0, 1) and torch.equal(healthy.buckets[-1], hub.latest.buckets[0])
    assert hub.latest.buckets[0].data_ptr() != first_copy.data_ptr() and not first_copy.any()  # version 0 intact
    THAW.set()
    admission.join(30)
    assert (0, 0) in hub.members and hub.members[(0, 0)].has == (0, 0)  # the next publish brings it up to date


def test_the_weight_store_listens_on_the_hubs_address_only(hub):
    listening = [c.laddr for c in psutil.Process().net_connections("inet")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == hub.port]
    assert [address.ip for address in listening] == ["127.0.0.1"], listening


def test_a_worker_whose_actor_holds_the_key_is_admitted_over_real_gloo_groups(hub, monkeypatch):
    monkeypatch.setenv(RUN_KEY_ENV, KEY)  # what the actor process sets for its engine's workers
    hub.start()
    got = {}

    def engine_worker() -> None:
        receiver = join_weight_hub("127.0.0.1", hub.port, actor=3, run_id=RUN_ID, timeout_s=60)
        got["version"] = receive_weights(receiver)[0].version

    worker = in_thread(engine_worker)
    worker.join(60)
    assert got == {"version": 0} and (3, 0) in hub.members and hub.counters["unauthenticated_joins"] == 0
    listening = [c.laddr for c in psutil.Process().net_connections("inet") if c.status == psutil.CONN_LISTEN]
    assert listening and all(address.ip == "127.0.0.1" for address in listening), listening  # gloo's sockets too
