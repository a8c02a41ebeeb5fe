"""A frozen engine holds the weight hub for a bound scaled with the bytes of a version (seconds for a small model),
never the whole weight_sync_timeout_s (300 s by default): it is dropped after that bound (it rejoins by itself),
the other members get the version, and an engine that joins meanwhile is admitted. The frozen link here blocks
and ignores its time-out, as a SIGSTOPped peer's NCCL communicator creation does (it happens inside the first
collective, before any bounded wait). The real drop of a silent gloo peer is tests/learner/test_learner_weight_sync.py's."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import horizonrl.learner.weight_admission as weight_admission
import horizonrl.learner.weight_links as weight_links
import horizonrl.protocol.weights as weights
from horizonrl.actors.weight_join import announce_join
from horizonrl.learner.weight_broadcast import WeightHub
from horizonrl.learner.weight_links import Member
from horizonrl.protocol import WeightJoin

RUN_ID = "frozen"
THAW = threading.Event()  # set at the end of each test: the stuck threads end


class Link:
    """Takes everything; ``frozen``: blocks in ``stage`` until the test ends, whatever its time-out."""

    def __init__(self, frozen_in: str = "") -> None:
        self.frozen_in = frozen_in
        self.buckets = 0
        self.timeouts: list[float] = []  # the bound each step was given

    def _step(self, stage: str, timeout_s: float) -> None:
        if stage == self.frozen_in:
            THAW.wait(120)
        self.timeouts.append(timeout_s)

    def begin(self, layout_bytes, bucket_bytes, what, timeout_s) -> None:
        self._step("begin", timeout_s)

    def send_bucket(self, index, data, what, timeout_s) -> None:
        self._step("bucket", timeout_s)
        self.buckets += 1

    def finish(self, what, timeout_s) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.fixture
def hub(monkeypatch):
    monkeypatch.setattr(weights, "FROZEN_MEMBER_FLOOR_S", 1.0, raising=False)
    monkeypatch.setattr(weight_links, "STUCK_MARGIN_S", 1.0)
    THAW.clear()
    hub = WeightHub("127.0.0.1", 0, backend="gloo", timeout_s=300, run_id=RUN_ID, bucket_bytes=40 << 10)
    hub.pack(0, [("w", torch.zeros(64, 64))])
    yield hub
    THAW.set()
    hub.close()


def in_thread(target, *args) -> threading.Thread:
    thread = threading.Thread(target=target, args=args, daemon=True)
    thread.start()
    return thread


def test_a_frozen_member_is_dropped_within_the_bound_while_the_others_get_the_version_and_a_joiner_is_admitted(
        hub, monkeypatch):
    healthy, frozen = Link(), Link(frozen_in="bucket")
    hub.members[(0, 0)] = Member(1, 0, 0, 101, healthy)
    hub.members[(1, 0)] = Member(2, 1, 0, 102, frozen)
    monkeypatch.setattr(weight_admission, "GroupLink", lambda group, device, **_: Link())
    monkeypatch.setattr(hub.desk, "_form_group", lambda number: object())
    stats: dict = {}
    start = time.monotonic()
    send = in_thread(lambda: stats.update(hub.send(hub.pack(1, [("w", torch.ones(64, 64))]))))
    time.sleep(0.2)  # the send holds the hub's lock now, stuck on the frozen member
    _, _, number = announce_join("127.0.0.1", hub.port, 10, WeightJoin(run_id=RUN_ID, actor=2, pid=103, worker=0))
    admission = in_thread(hub.desk._take, number)
    send.join(30)
    admission.join(30)
    elapsed = time.monotonic() - start
    assert not send.is_alive() and not admission.is_alive(), "the frozen member held the hub"
    assert elapsed < 15  # bound 1 s + margin 1 s per step; the hub's timeout is 300 s
    assert stats["dropped"] == 1 and hub.counters["dropped"] == 1 and (1, 0) not in hub.members
    assert healthy.buckets == 1 and hub.members[(0, 0)].has == (0, 1)
    assert max(healthy.timeouts) <= 5  # the bound of a small version, not the hub's 300 s
    assert hub.members[(2, 0)].has == (0, 1) and hub.counters["admitted"] == 1  # the joiner, at the new version


def test_a_joiner_whose_first_collective_never_returns_is_given_up_within_the_bound(hub, monkeypatch):
    """NCCL forms a communicator inside the first collective and waits for the peer there without a time-out:
    an engine frozen between its join and that collective must not hold the admission (and the hub's lock)."""
    monkeypatch.setattr(weight_admission, "GroupLink", lambda group, device, **_: Link(frozen_in="begin"))
    monkeypatch.setattr(hub.desk, "_form_group", lambda number: object())
    _, _, number = announce_join("127.0.0.1", hub.port, 10, WeightJoin(run_id=RUN_ID, actor=0, pid=101, worker=0))
    admission = in_thread(hub.desk._take, number)
    admission.join(30)
    assert not admission.is_alive() and hub.counters["failed_joins"] == 1 and not hub.members
    sent = in_thread(lambda: hub.send(hub.pack(1, [("w", torch.ones(64, 64))])))  # the hub is free again
    sent.join(10)
    assert not sent.is_alive()


def test_an_engine_whose_learner_never_forms_the_nccl_group_gives_up_within_the_groups_timeout(monkeypatch):
    """The engine's side of the same: its first collective on a new NCCL group (the join's header) forms the
    communicator and would wait for a frozen learner with no time-out; it gives up after the group's timeout, so
    the worker's join returns an error and the actor joins again."""
    import horizonrl.actors.weight_receiver as weight_receiver
    from horizonrl.actors.weight_receiver import WeightReceiver, open_weight_stream
    from horizonrl.protocol.weights import WeightSyncError

    class Hanging:
        def broadcast(self, tensors, options):
            THAW.wait(120)  # inside the call, before any wait(timeout): where NCCL forms its communicator

    class NcclReceiver(WeightReceiver):
        device = torch.device("cpu")  # NCCL's bookkeeping, without a GPU

    monkeypatch.setattr(weight_receiver, "FORMING_MARGIN_S", 0.5, raising=False)
    THAW.clear()
    try:
        receiver = NcclReceiver(1, "nccl", 1.0, Hanging(), store=None)
        start = time.monotonic()
        with pytest.raises(WeightSyncError, match="header of the next version did not complete"):
            open_weight_stream(receiver)
        assert time.monotonic() - start < 10
    finally:
        THAW.set()
