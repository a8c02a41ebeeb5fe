"""The actor's acknowledged delivery (real ZMQ sockets; the test plays the buffer) and its task sequence."""

import asyncio
import contextlib
import time

import pytest
import zmq
import zmq.asyncio
from helpers import RUN_ID, make_trajectory

from horizonrl.actors.delivery import TrajectoryDelivery
from horizonrl.actors.task_sequence import TaskSequence
from horizonrl.core.config import EnvSpec
from horizonrl.protocol import ACK_ACCEPTED, ACK_DUPLICATE, Trajectory, TrajectoryAck, decode_as, encode
from horizonrl.protocol.transport import make_socket


class Buffer:
    """A ROUTER that records what arrives and acknowledges on request."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.socket = make_socket(ctx, zmq.ROUTER)
        self.port = self.socket.bind_to_random_port("tcp://127.0.0.1")

    async def receive(self, count: int, timeout_s: float = 10.0) -> list[tuple[bytes, Trajectory]]:
        got = []
        while len(got) < count:
            assert await self.socket.poll(int(timeout_s * 1000)), f"only {len(got)} of {count} arrived"
            identity, data = await self.socket.recv_multipart()
            got.append((identity, decode_as(data, Trajectory)))
        return got

    async def ack(self, identity: bytes, ids: list[str], status: str = ACK_ACCEPTED) -> None:
        ack = TrajectoryAck(run_id=RUN_ID, trajectory_ids=ids, statuses=[status] * len(ids), reasons=[""] * len(ids))
        await self.socket.send_multipart([identity, encode(ack)])


def _delivery(ctx, port, outbox, **kw):
    socket = make_socket(ctx, zmq.DEALER)
    socket.connect(f"tcp://127.0.0.1:{port}")
    args = dict(ack_timeout_s=30.0, max_unacked=8)
    args.update(kw)
    return TrajectoryDelivery(socket, outbox, RUN_ID, **args), socket


@contextlib.asynccontextmanager
async def delivering(tmp_path, **kw):
    """The test's buffer and a running delivery to it; every socket closed afterwards."""
    ctx = zmq.asyncio.Context()
    buffer = Buffer(ctx)
    delivery, socket = _delivery(ctx, buffer.port, tmp_path, **kw)
    runner = asyncio.create_task(delivery.run())
    try:
        yield buffer, delivery
    finally:
        runner.cancel()
        delivery.close()
        socket.close(linger=0)
        buffer.socket.close(linger=0)
        ctx.term()


async def test_acknowledged_trajectories_leave_the_outbox_and_unacknowledged_survive_a_restart(tmp_path):
    ctx = zmq.asyncio.Context()
    buffer = Buffer(ctx)
    delivery, socket = _delivery(ctx, buffer.port, tmp_path)
    runner = asyncio.create_task(delivery.run())
    try:
        for i in range(3):
            await delivery.send(make_trajectory("g", i, group_size=3))
        arrived = await buffer.receive(3)
        await buffer.ack(arrived[0][0], ["g-0"])
        await buffer.ack(arrived[0][0], ["g-1", "g-0"], ACK_DUPLICATE)  # an ack of a resend is harmless
        await asyncio.wait_for(_until(lambda: len(delivery.unacked) == 1), 10)
        assert delivery.counters.acked_accepted == 1 and delivery.counters.acked_duplicate == 1
    finally:
        runner.cancel()
        delivery.close()
        socket.close(linger=0)
    # the actor restarts: what was never acknowledged is sent again, from the outbox on disk
    again, socket = _delivery(ctx, buffer.port, tmp_path)
    runner = asyncio.create_task(again.run())
    try:
        assert list(again.unacked) == ["g-2"] and again.counters.outbox_recovered == 1
        (identity, resent), = await buffer.receive(1)
        assert resent.trajectory_id == "g-2"
        await buffer.ack(identity, ["g-2"])
        await asyncio.wait_for(_until(lambda: not again.unacked), 10)
    finally:
        runner.cancel()
        again.close()
        socket.close(linger=0)
    assert not list(tmp_path.glob("outbox_*.bin"))  # all acknowledged: nothing left on disk
    buffer.socket.close(linger=0)
    ctx.term()


async def test_an_unacknowledged_trajectory_is_resent_and_too_many_hold_the_sender_back(tmp_path):
    async with delivering(tmp_path, ack_timeout_s=0.5, max_unacked=2) as (buffer, delivery):
        await delivery.send(make_trajectory("g", 0))
        await delivery.send(make_trajectory("g", 1))
        third = asyncio.create_task(delivery.send(make_trajectory("g", 2)))
        await asyncio.sleep(0.3)
        assert not third.done()  # two unacknowledged: the third waits
        arrived = await buffer.receive(4)  # the first two, then both again after the ack timeout
        assert sorted(t.trajectory_id for _, t in arrived) == ["g-0", "g-0", "g-1", "g-1"]
        assert delivery.counters.resent >= 2
        fourth = asyncio.create_task(delivery.send(make_trajectory("g", 3)))
        await buffer.ack(arrived[0][0], ["g-0"])
        # room for one: exactly one of the two waiting senders goes on, the other waits again
        done, _ = await asyncio.wait([third, fourth], timeout=10, return_when=asyncio.FIRST_COMPLETED)
        await asyncio.sleep(0.3)
        assert len(done) == 1 and not (third.done() and fourth.done())
        assert len(delivery.unacked) == 2
        await buffer.ack(arrived[0][0], ["g-1"])
        await asyncio.wait_for(asyncio.gather(third, fourth), 10)


@pytest.mark.parametrize("paused", ["never", "before", "now", "lately"])
async def test_a_resend_under_backpressure_is_not_a_warning(tmp_path, caplog, paused):
    """While the coordinator pauses the rollout the buffer reads nothing, so late acknowledgements are the
    design at work: the resend is logged at INFO (off the console), otherwise it is a WARNING. A pause that
    came and went while the trajectory waited counts (it comes and goes with each batch the learner takes); one
    over before it was sent does not."""
    backpressure = paused in ("now", "lately")
    async with delivering(tmp_path, ack_timeout_s=0.3) as (buffer, delivery):
        delivery.backpressure = paused in ("before", "now")
        if paused == "before":
            delivery.backpressure = False
        with caplog.at_level("INFO", logger="horizonrl.actors"):
            await delivery.send(make_trajectory("g", 0))
            if paused == "lately":  # paused and resumed while the trajectory waited for its acknowledgement
                delivery.backpressure = True
                delivery.backpressure = False
            await buffer.receive(2)  # sent, then sent again after the ack timeout
            await asyncio.wait_for(_until(lambda: delivery.counters.resent >= 1), 10)
        [record] = [r for r in caplog.records if "unacknowledged" in r.getMessage()]
        assert record.levelname == ("INFO" if backpressure else "WARNING")
        assert ("the buffer is full" in record.getMessage()) == backpressure


async def _until(predicate):
    while not predicate():
        await asyncio.sleep(0.02)


def test_the_task_sequence_continues_where_it_left_off(tmp_path):
    envs = [EnvSpec(name="a", weight=1.0), EnvSpec(name="b", weight=3.0)]
    ids = {"a": list(range(100)), "b": list(range(1000, 1100))}
    state = tmp_path / "actor_0.json"
    first = TaskSequence(state, seed=7, actor=0, envs=envs, train_ids=ids)
    played = [first.next() for _ in range(5)]
    assert [t.number for t in played] == [0, 1, 2, 3, 4]
    restarted = TaskSequence(state, seed=7, actor=0, envs=envs, train_ids=ids)
    assert restarted.next().number == 5  # not 0: no task is replayed after a restart
    # the sequence is a pure function of (seed, actor, number)
    assert [restarted.task_of(n) for n in range(5)] == played
    other_actor = TaskSequence(tmp_path / "actor_1.json", seed=7, actor=1, envs=envs, train_ids=ids)
    assert [other_actor.task_of(n) for n in range(5)] != played
    names = [restarted.task_of(n).env.name for n in range(400)]
    assert 0.65 < names.count("b") / 400 < 0.85  # drawn by the environments' weights (3:1)


async def test_a_stop_waits_for_acknowledgements_while_they_come_and_not_for_a_silent_buffer(tmp_path):
    async with delivering(tmp_path) as (buffer, delivery):
        for i in range(5):
            await delivery.send(make_trajectory("g", i, group_size=5))
        arrived = await buffer.receive(5)

        async def acknowledge_one_a_second():
            for identity, trajectory in arrived[:4]:
                await asyncio.sleep(1.0)
                await buffer.ack(identity, [trajectory.trajectory_id])

        # Acknowledgements keep coming, each within quiet_s of the last, for longer than quiet_s in all: the
        # drain waits for all four...
        acker = asyncio.create_task(acknowledge_one_a_second())
        start = time.monotonic()
        left = await delivery.drain(timeout_s=120.0, quiet_s=3.0)
        took = time.monotonic() - start
        await acker
        assert delivery.counters.acked_accepted == 4, took
        # ...then the buffer says nothing more (full, or gone): the drain ends quiet_s after the last one, far
        # before its timeout, and the unacknowledged trajectory stays in the outbox for the next start.
        assert left == 1 and list(delivery.unacked) == ["g-4"]
        assert 4.0 <= took < 60.0, took
