"""The buffer's door, in-process: a trajectory longer than the run's context, of a bigger group than the
run's, or from weights nobody has announced or ever will is refused with its reason; every refusal is a
record of the write-ahead log, so ``horizonrl accounting`` lists them as the buffer counted them, and a
restarted buffer counts on from there."""

from __future__ import annotations

import msgspec
import pytest

from horizonrl.buffer.accounting import account
from horizonrl.buffer.server import BufferServer
from horizonrl.core.config import TrainConfig
from horizonrl.core.runtime import StopFlag
from horizonrl.apps.hostile import trajectory
from horizonrl.launcher import resolve_ports
from horizonrl.protocol import ACK_ACCEPTED, ACK_REJECTED, encode

RUN_ID = "door"
CONTEXT = 64
ACTOR = b"actor-0"


@pytest.fixture
def config(tmp_path) -> TrainConfig:
    return resolve_ports(TrainConfig.model_validate({
        "run": {"output_dir": str(tmp_path), "run_id": RUN_ID}, "model": {"path": "unused", "vocab_size": 128},
        "envs": [{"name": "signpost"}], "network": {"host": "127.0.0.1"},
        "rollout": {"n": 2, "max_context_tokens": CONTEXT, "max_tokens_per_turn": 8},
        "learner": {"total_steps": 10, "groups_per_step": 1}, "buffer": {"capacity_groups": 4}}))


@pytest.fixture
def server(config):
    s = BufferServer(config, StopFlag())
    yield s
    s.close()


def offer(server: BufferServer, t) -> tuple[str, str]:
    """Hand ``t`` to the door; its acknowledgement's (status, reason)."""
    server._admit(ACTOR, t, encode(t))
    [(tid, status, reason)] = [entry for entry in server._outbox[ACTOR] if entry[0] == t.trajectory_id]
    return status, reason


def test_a_trajectory_longer_than_the_context_or_of_a_bigger_group_is_refused(server):
    assert offer(server, trajectory(RUN_ID, "fits-0", tokens=CONTEXT)) == (ACK_ACCEPTED, "")
    assert offer(server, trajectory(RUN_ID, "long-0", tokens=CONTEXT + 1)) == (ACK_REJECTED, "too_long")
    assert offer(server, trajectory(RUN_ID, "huge-0", tokens=10**6)) == (ACK_REJECTED, "too_long")  # 9 MB
    assert offer(server, trajectory(RUN_ID, "big-0", group_size=3)) == (ACK_REJECTED, "fields")
    assert dict(server.groups.rejected) == {"too_long": 2, "fields": 1}
    assert server.stats()["rejected_too_long"] == 2


def test_weights_from_the_future_are_refused_and_an_ended_epochs_are_judged_by_what_it_announced(server):
    server._hear_weights(0, 5)  # epoch 0 announced up to version 5 ...
    server._hear_weights(1, 3)  # ... then its learner died and the next one resumed from step 3
    server.groups.set_lineage([(0, 0), (1, 3)])
    assert offer(server, trajectory(RUN_ID, "past-run-0", version=11)) == (ACK_REJECTED, "future_version")
    assert offer(server, trajectory(RUN_ID, "epoch0-future-0", version=9, epoch=0)) == (ACK_REJECTED, "future_version")
    # announced in epoch 0, but not an ancestor of epoch 1: let in, and dropped as a discarded branch when batched
    assert offer(server, trajectory(RUN_ID, "epoch0-branch-0", version=5, epoch=0)) == (ACK_ACCEPTED, "")
    assert offer(server, trajectory(RUN_ID, "epoch1-0", version=3, epoch=1)) == (ACK_ACCEPTED, "")
    # the newest epoch's next version may simply not be announced yet: it waits (buffer.future_hold_s)
    t = trajectory(RUN_ID, "epoch1-next-0", version=4, epoch=1)
    server._admit(ACTOR, t, encode(t))
    assert "epoch1-next-0" in server._early_ids
    assert dict(server.groups.rejected) == {"future_version": 2}


def test_the_accounting_lists_the_rejections_at_the_door_as_the_buffer_counted_them(config):
    server = BufferServer(config, StopFlag())
    try:
        offer(server, trajectory(RUN_ID, "ok-0", tokens=CONTEXT))
        for n in range(3):
            offer(server, trajectory(RUN_ID, f"long{n}-0", tokens=CONTEXT * 2))
        bad = trajectory(RUN_ID, "nan-0")
        offer(server, msgspec.structs.replace(bad, reward=float("nan")))
        offer(server, trajectory(RUN_ID, "past-0", version=99))
        counted = dict(server.groups.rejected)
        server._flush()
    finally:
        server.close()
    assert counted == {"too_long": 3, "non_finite_number": 1, "future_version": 1}
    ledger = account(config.output_dir)
    assert ledger["rejected_at_the_door"] == counted and ledger["accepted"] == 1 and ledger["lost"] == []
    restarted = BufferServer(config, StopFlag())  # replays its log: counts on from the same numbers
    try:
        assert dict(restarted.groups.rejected) == counted
        offer(restarted, trajectory(RUN_ID, "long9-0", tokens=CONTEXT + 5))
        restarted._flush()
    finally:
        restarted.close()
    assert account(config.output_dir)["rejected_at_the_door"] == {**counted, "too_long": 4}


def test_an_accepted_id_with_other_content_is_refused_as_taken_and_a_true_resend_is_a_duplicate(config):
    real = trajectory(RUN_ID, "a0-g0-0")
    forged = msgspec.structs.replace(real, reward=1.0, success=True)  # sent first, under the id the actor will use
    server = BufferServer(config, StopFlag())
    try:
        assert offer(server, forged) == (ACK_ACCEPTED, "")
        server._outbox.clear()
        assert offer(server, real) == (ACK_REJECTED, "id_taken")  # the actor hears its episode was refused
        server._outbox.clear()
        assert offer(server, forged) == ("duplicate", "")  # the same bytes again: a resend
        server._flush()
    finally:
        server.close()
    ledger = account(config.output_dir)
    assert ledger["rejected_at_the_door"] == {"id_taken": 1} and ledger["accepted"] == 1
    restarted = BufferServer(config, StopFlag())  # the digests come back from the log
    try:
        assert offer(restarted, real) == (ACK_REJECTED, "id_taken")
        restarted._outbox.clear()
        assert offer(restarted, forged) == ("duplicate", "")
    finally:
        restarted.close()


def test_a_compacted_log_still_knows_what_each_resolved_id_held(config):
    from horizonrl.buffer.records import Accepted, Resolved, compacted, content_digest, decode_record, encode_record
    from horizonrl.buffer.groups import FATE_TRAINED, GroupBuffer

    t = trajectory(RUN_ID, "a0-g0-0")
    message = encode(t)
    state = GroupBuffer(capacity_groups=1, max_staleness=0, skip_equal_reward_groups=False, group_timeout_s=1e9)
    state.fates[t.trajectory_id] = FATE_TRAINED
    stub = decode_record(compacted(encode_record(Accepted(message)), state))
    assert isinstance(stub, Resolved) and stub.digest == content_digest(message)
    replayed = GroupBuffer(capacity_groups=1, max_staleness=0, skip_equal_reward_groups=False, group_timeout_s=1e9)
    replayed.resolved_stub(stub.trajectory_id, stub.group_id, stub.fate, stub.digest)
    assert replayed.is_resend(t.trajectory_id, content_digest(message))
    assert not replayed.is_resend(t.trajectory_id, content_digest(encode(msgspec.structs.replace(t, reward=1.0))))


def test_an_actors_group_ids_are_unguessable_from_its_group_number():
    from horizonrl.actors.actor import group_id_of, new_incarnation
    from horizonrl.protocol.names import is_id

    first, second = new_incarnation(), new_incarnation()
    assert first != second and len(first) == 16  # 64 random bits per actor process
    ids = {group_id_of(0, first, 5), group_id_of(0, second, 5), group_id_of(1, first, 5)}
    assert len(ids) == 3 and all(is_id(f"{g}-7") and g.endswith("-g5") for g in ids)


def test_a_flood_of_refusals_grows_the_log_by_one_small_record_per_turn_not_one_per_trajectory(config):
    server = BufferServer(config, StopFlag())
    try:
        before = server.wal.size_bytes() if server.wal.segments() else 0
        for turn in range(10):
            for n in range(300):
                offer(server, trajectory(RUN_ID, f"long{turn}x{n}-0", tokens=CONTEXT + 1))
            server._outbox.clear()
            server._flush()
        server.wal.sync()
        grown = server.wal.size_bytes() - before
    finally:
        server.close()
    assert grown < 1000, grown  # 10 records of counts; one per refusal was ~90 bytes each (270 kB here)
    assert account(config.output_dir)["rejected_at_the_door"] == {"too_long": 3000}


def test_an_in_limit_message_of_millions_of_turn_spans_is_refused_before_it_is_built(config):
    import tracemalloc

    import zmq

    t = trajectory(RUN_ID, "spans-0")
    message = encode(msgspec.structs.replace(t, turn_spans=[(0, 1)] * 2_000_000))  # 6 MB on the wire
    server = BufferServer(config, StopFlag())
    sender = zmq.Context.instance().socket(zmq.DEALER)
    try:
        sender.setsockopt(zmq.IDENTITY, b"mallory")
        sender.connect(server.endpoints["trajectories"])
        sender.send(message)
        assert server.intake.poll(5000)
        tracemalloc.start()
        server._drain_trajectories()
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert server._outbox[b"mallory"] == [("spans-0", ACK_REJECTED, "turns")]
        assert peak < 2 * len(message), (peak, len(message))  # the message itself, not 2M tuples (~140 MB)
    finally:
        sender.close(linger=0)
        server.close()
