"""Every blocking wait between processes ends within its bound with a clear error when the peer is gone:
the learner's own control collectives (main.py) and an engine's weight receive, on gloo, with the peer
killed by pid (its connection breaks) or alive but silent (the timeout itself must fire)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest

from horizonrl.protocol.transport import free_port

pytestmark = pytest.mark.slow

BOUND_S = 5.0  # the timeout given to the waits
ENDS_WITHIN_S = 30.0  # what the test allows under load (2 shared cores)
RUN_ID = "test-run"


def _learner_rank(rank: int, port: int, queue, mode: str) -> None:
    """Rank 1 waits in ``mode``'s control collective for rank 0, which dies or never arrives."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from horizonrl.learner.services import _all_agree_to_stop, from_rank_zero

    # A process-group timeout far beyond the bound: only the bounded wait can end the test in time.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=600))
    if rank == 0:
        queue.put(("pid", os.getpid()))
        time.sleep(600)  # killed by the test, or silent
        return
    queue.put(("ready", None))
    start = time.monotonic()
    try:
        if mode == "stop":
            _all_agree_to_stop((threading.Event(),), BOUND_S)
        else:
            from_rank_zero(0, BOUND_S, "weight epoch")
        queue.put(("returned", time.monotonic() - start))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        queue.put((type(exc).__name__ + ": " + str(exc), time.monotonic() - start))


@pytest.mark.parametrize("mode", ["stop", "epoch"])
@pytest.mark.parametrize("peer", ["killed", "silent"])
def test_a_learner_rank_waiting_for_a_dead_or_silent_peer_fails_within_the_bound(mode, peer):
    ctx = mp.get_context("spawn")
    # One queue per process: a process killed while its queue's feeder holds the shared write lock
    # would block every other writer of that queue.
    queues = [ctx.Queue(), ctx.Queue()]
    port = free_port()
    procs = [ctx.Process(target=_learner_rank, args=(r, port, queues[r], mode), daemon=True) for r in (0, 1)]
    for proc in procs:
        proc.start()
    try:
        _, pid = queues[0].get(timeout=120)
        assert queues[1].get(timeout=120)[0] == "ready"
        if peer == "killed":
            os.kill(pid, signal.SIGKILL)
        message, elapsed = queues[1].get(timeout=ENDS_WITHIN_S + 30)
        assert message != "returned"
        assert message.startswith("LearnerRanksError") and "learner rank 1" in message, message
        assert "did not complete within 5 s" in message, message
        assert elapsed < ENDS_WITHIN_S
        if peer == "silent":
            assert elapsed >= BOUND_S - 0.5  # it was the bound that ended it, not an early failure
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(10)


def _learner_hub(port: int, queue) -> None:
    """A "learner" that hosts the hub, admits the engine with version 0, then goes quiet or is killed."""
    import torch

    from horizonrl.learner.weight_broadcast import WeightHub

    hub = WeightHub("127.0.0.1", port, backend="gloo", timeout_s=60, run_id=RUN_ID)
    hub.pack(0, [("w", torch.ones(4))])
    hub.start()
    while not hub.members:
        time.sleep(0.05)
    queue.put(("pid", os.getpid()))
    time.sleep(600)


def _engine(port: int, queue) -> None:
    from horizonrl.actors.weight_receiver import join_weight_hub, open_weight_stream, receive_weights

    receiver = join_weight_hub("127.0.0.1", port, actor=0, run_id=RUN_ID, timeout_s=BOUND_S)
    receive_weights(receiver)  # the join's version
    queue.put(("joined", None))
    start = time.monotonic()
    try:
        stream = open_weight_stream(receiver)
        stream.finish()
        queue.put(("returned", time.monotonic() - start))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        queue.put((type(exc).__name__ + ": " + str(exc), time.monotonic() - start))


@pytest.mark.parametrize("peer", ["killed", "silent"])
def test_a_weight_receive_from_a_dead_or_silent_learner_fails_within_the_bound(peer):
    ctx = mp.get_context("spawn")
    learner_queue, engine_queue = ctx.Queue(), ctx.Queue()  # one per process (see above)
    port = free_port()
    learner = ctx.Process(target=_learner_hub, args=(port, learner_queue), daemon=True)
    engine = ctx.Process(target=_engine, args=(port, engine_queue), daemon=True)
    learner.start()
    engine.start()
    try:
        _, pid = learner_queue.get(timeout=120)
        assert engine_queue.get(timeout=120)[0] == "joined"
        if peer == "killed":
            os.kill(pid, signal.SIGKILL)
        message, elapsed = engine_queue.get(timeout=ENDS_WITHIN_S + 30)
        assert message.startswith("WeightSyncError"), message
        assert "header of the next version did not complete within 5 s" in message, message
        assert elapsed < ENDS_WITHIN_S
        if peer == "silent":
            assert elapsed >= BOUND_S - 0.5
    finally:
        for proc in (learner, engine):
            if proc.is_alive():
                proc.kill()
            proc.join(10)


def _silent_member(port: int, queue) -> None:
    """Joins and takes its first version, then never receives again (a frozen engine)."""
    from horizonrl.actors.weight_receiver import join_weight_hub, receive_weights

    receiver = join_weight_hub("127.0.0.1", port, actor=0, run_id=RUN_ID, timeout_s=600)
    receive_weights(receiver)
    queue.put("joined")
    time.sleep(600)


def test_a_stop_during_a_publish_abandons_it_after_the_grace_and_the_gathers_still_finish():
    """The learner's stop path (main.publish_weights): the engine does not receive, the hub's own timeout
    is long, and a stop must still end the publish after its grace, with every bucket still gathered
    (the other learner ranks are in those gathers) and the version kept for joiners."""
    import threading

    import torch

    from horizonrl.learner.services import _abandon_after
    from horizonrl.learner.weight_broadcast import WeightHub

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    hub = WeightHub("127.0.0.1", port, backend="gloo", timeout_s=600, run_id=RUN_ID, bucket_bytes=1 << 20)
    named = [(f"w{i}", torch.full((512, 1024), float(i))) for i in range(8)]  # 2 MB each: 8 buckets
    hub.publish(0, 0, named)
    hub.start()
    member = ctx.Process(target=_silent_member, args=(port, queue), daemon=True)
    member.start()
    try:
        assert queue.get(timeout=120) == "joined"
        stop = threading.Event()
        threading.Timer(1.0, stop.set).start()
        start = time.monotonic()
        result = hub.publish(1, 0, [(n, t + 1) for n, t in named], should_abandon=_abandon_after(stop, 2.0))
        elapsed = time.monotonic() - start
        assert result is None  # abandoned, not completed and not failed
        assert 3.0 - 0.5 <= elapsed < ENDS_WITHIN_S  # stop at 1 s + 2 s grace, far below the hub's 600 s
        assert hub.latest.version == 1 and len(hub.latest.buckets) == 8
        assert torch.equal(hub.latest.buckets[7].view(torch.float32), torch.full((512 * 1024,), 8.0))
    finally:
        member.kill()
        member.join(10)
