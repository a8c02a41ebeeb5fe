"""The buffer's state machine: groups, batches, rollbacks, commits, lineage — and its log replay."""

from helpers import make_trajectory

from horizonrl.buffer.groups import FATE_TRAINED, GroupBuffer
from horizonrl.protocol import encode
from horizonrl.buffer.records import Accepted, Committed, Expired, Lineage, RolledBack, Served, apply, compacted, \
    decode_record, encode_record


def make_buffer(**kw):
    args = dict(capacity_groups=4, max_staleness=1, skip_equal_reward_groups=True, group_timeout_s=10.0)
    args.update(kw)
    return GroupBuffer(**args)


def add_group(buf, gid, rewards, version=0, failures=(), epoch=0):
    for i, r in enumerate(rewards):
        buf.accept(make_trajectory(gid, i, reward=r, group_size=len(rewards), version=version, epoch=epoch,
                                   failure="environment" if i in failures else ""))


def take(buf, num_groups, learner_version, allow_equal=False, request_id=1):
    chosen = buf.choose(num_groups, learner_version, allow_equal)
    if chosen is None:
        return None
    return buf.serve(buf.next_batch, request_id, learner_version, chosen)


def account(buf) -> int:
    """accepted = trained + in flight + held + dropped (the invariant of groups.py)."""
    return buf.trained_trajectories + buf.in_flight_trajectories() + buf.held_trajectories() + sum(buf.dropped.values())


def test_groups_complete_then_serve_oldest_first():
    buf = make_buffer()
    add_group(buf, "a", [0, 1, 0, 1])
    add_group(buf, "b", [1, 0, 0, 0])
    assert take(buf, 3, learner_version=0) is None  # not enough yet, nothing lost
    batch = take(buf, 2, learner_version=0)
    assert [g[0].group_id for g in batch] == ["a", "b"]
    assert buf.in_flight_trajectories() == 8 and account(buf) == buf.received == 8


def test_every_trajectory_is_accounted_for():
    buf = make_buffer()
    add_group(buf, "equal", [0, 0, 0, 0])
    add_group(buf, "failed", [1, 1, 0, 0], version=2, failures=(0, 2))
    add_group(buf, "stale", [1, 0, 0, 0], version=0)
    add_group(buf, "fresh", [1, 0, 0, 0], version=3)
    buf.accept(make_trajectory("partial", 0, reward=1.0, group_size=4))
    batch = take(buf, 2, learner_version=3)  # "stale" has staleness 3 > 1
    assert [g[0].group_id for g in batch] == ["failed", "fresh"]
    assert all(not t.failure for g in batch for t in g)
    assert len(batch[0]) == 2  # the two healthy members of the group with failures
    assert account(buf) == buf.received == 17
    stats = buf.stats()
    assert (stats["in_flight_trajectories"], stats["dropped_total"], stats["held_trajectories"]) == (6, 10, 1)
    assert buf.dropped == {"equal_rewards": 4, "failure_environment": 2, "stale": 4}  # kept aside, then too stale


def test_backpressure_flag_and_group_timeout():
    now = [0.0]
    buf = make_buffer(capacity_groups=2, clock=lambda: now[0])
    add_group(buf, "a", [0, 1])
    assert not buf.full
    add_group(buf, "b", [0, 1])
    assert buf.full
    buf.accept(make_trajectory("lost", 0, reward=1.0, group_size=2))
    assert buf.expired_groups() == []
    now[0] = 11.0
    assert buf.expired_groups() == ["lost"]
    buf.expire(["lost"])
    assert buf.dropped["group_timeout"] == 1 and buf.pending_groups == 0


def test_group_with_one_survivor_is_dropped():
    buf = make_buffer()
    add_group(buf, "g", [1, 0, 0], failures=(1, 2))
    assert buf.ready_groups == 0 and buf.dropped["group_too_small"] == 1


def test_equal_reward_groups_fill_a_starved_request_only_when_allowed():
    buf = make_buffer(capacity_groups=2)
    add_group(buf, "all-solved-1", [1, 1])
    add_group(buf, "all-solved-2", [1, 1])
    add_group(buf, "all-solved-3", [1, 1])  # evicts the oldest kept-aside group
    add_group(buf, "useful", [1, 0])
    assert take(buf, 2, learner_version=0) is None
    batch = take(buf, 2, learner_version=0, allow_equal=True)
    assert [g[0].group_id for g in batch] == ["useful", "all-solved-3"]
    assert buf.dropped["equal_rewards"] == 2 and buf.served_equal_groups == 1 and buf.equal_groups_seen == 3
    assert account(buf) == buf.received


def test_a_member_that_does_not_fit_its_group_is_refused():
    buf = make_buffer()
    buf.accept(make_trajectory("g", 0, reward=1.0, group_size=2, task_id=5))
    assert buf.admission_problem(make_trajectory("g", 1, group_size=2, task_id=6))[0] == "group_mismatch"
    assert buf.admission_problem(make_trajectory("g", 1, group_size=3, task_id=5))[0] == "group_mismatch"
    assert buf.admission_problem(make_trajectory("g", 1, group_size=2, task_id=5)) is None
    buf.accept(make_trajectory("g", 1, group_size=2, task_id=5))
    assert buf.admission_problem(make_trajectory("g", 2, group_size=2, task_id=5))[0] == "group_mismatch"  # complete


def test_a_batch_asked_for_again_is_rolled_back_and_served_once():
    buf = make_buffer()
    add_group(buf, "a", [0, 1])
    add_group(buf, "b", [1, 0])
    first = take(buf, 1, learner_version=0)
    assert [g[0].group_id for g in first] == ["a"]
    # the learner asks for step 1 again (its reply was lost): batch 1 goes back, oldest first
    assert buf.batches_to_roll_back(0) == [1]
    buf.roll_back([1])
    again = take(buf, 2, learner_version=0, request_id=2)
    assert [g[0].group_id for g in again] == ["a", "b"] and buf.rolled_back_batches == 1
    assert account(buf) == buf.received == 4


def test_commit_makes_batches_trained_and_a_resumed_learner_gets_the_rest_back():
    buf = make_buffer(max_staleness=5)
    for step in range(4):  # steps 1..4, one group each, generated by the weights of the step before
        add_group(buf, f"g{step}", [0, 1], version=step)
        take(buf, 1, learner_version=step, request_id=step + 1)
    buf.commit(2)  # a checkpoint of step 2 exists
    assert buf.trained_trajectories == 4 and buf.in_flight_trajectories() == 4
    assert all(buf.fates[f"g{k}-{i}"] == FATE_TRAINED for k in (0, 1) for i in (0, 1))
    # the learner crashed after step 4 and resumed from the checkpoint of step 2 (a new weight
    # epoch): it asks for step 3
    assert buf.batches_to_roll_back(2) == [3, 4]
    buf.roll_back([3, 4])
    buf.set_lineage([(0, 0), (1, 2)])
    assert buf.held_trajectories() == 4 and buf.in_flight_trajectories() == 0
    # g2 came from the checkpoint's own weights (epoch 0, version 2): trained again; g3 from version 3
    # of epoch 0, which the resumed learner never had: dropped
    assert [g[0].group_id for g in take(buf, 1, learner_version=2)] == ["g2"]
    assert buf.dropped == {"discarded_branch": 2}
    assert account(buf) == buf.received == 8


def test_weights_of_a_discarded_branch_are_dropped_and_ancestors_kept():
    """Epoch 0 reached version 6; the learner restarted from the checkpoint of step 4 as epoch 1."""
    buf = make_buffer(max_staleness=10)
    buf.set_lineage([(0, 0), (1, 4)])
    add_group(buf, "ancestor", [0, 1], version=4, epoch=0)  # the checkpoint's own weights
    add_group(buf, "discarded", [0, 1], version=6, epoch=0)  # weights that no longer exist
    add_group(buf, "starting-model", [0, 1], version=0, epoch=0)  # version 0 is the same in every epoch
    add_group(buf, "new", [0, 1], version=5, epoch=1)
    add_group(buf, "future", [0, 1], version=9, epoch=1)  # the learner is at version 5
    batch = take(buf, 3, learner_version=5)
    assert [g[0].group_id for g in batch] == ["ancestor", "starting-model", "new"]
    assert buf.dropped == {"discarded_branch": 2, "future_version": 2}


def _records(buf, log):
    """Apply records to ``buf`` as the server does, keeping them as the log would."""
    def record(r):
        log.append(encode_record(r))
        return apply(buf, r)
    return record


def test_replaying_the_log_rebuilds_the_state_and_compaction_keeps_it():
    now = [0.0]
    live = make_buffer(capacity_groups=2, max_staleness=2, clock=lambda: now[0])
    log: list[bytes] = []
    record = _records(live, log)
    for k, rewards in enumerate([[0, 1], [1, 1], [1, 0], [1, 1], [1, 1], [0, 1], [0, 0]]):
        for i, r in enumerate(rewards):
            record(Accepted(encode(make_trajectory(f"g{k}", i, reward=r, group_size=2, version=k // 3))))
    record(Accepted(encode(make_trajectory("lost", 0, reward=1.0, group_size=2))))
    now[0] = 11.0
    record(Expired(live.expired_groups()))
    record(Lineage([(0, 0)]))
    first, second = live.choose(2, 2), None
    record(Served(live.next_batch, 1, 2, first))
    second = live.choose(2, 3, allow_equal=True)
    record(Served(live.next_batch, 2, 3, second))
    assert (first, second) == (["g0", "g2"], ["g5", "g6"])  # the second topped up from the equal-reward reserve
    record(Committed(3))  # the batch of step 3 (learner version 2) is in a checkpoint
    record(RolledBack(live.batches_to_roll_back(3)))  # the learner asks for step 4 again

    def state(buf):
        return (buf.held_ids(), buf.in_flight_ids(), dict(buf.dropped), buf.trained_trajectories, buf.received,
                {k: v for k, v in buf.fates.items()}, buf.committed_step)

    replayed = make_buffer(capacity_groups=2, max_staleness=2)
    for data in log:
        apply(replayed, decode_record(data))
    assert state(replayed) == state(live)
    assert account(live) == live.received == 15 and live.trained_trajectories == 4

    # compaction: resolved trajectories lose their payload, the state does not change
    stubbed = [compacted(data, live) for data in log]
    assert sum(map(len, stubbed)) < sum(map(len, log))
    rebuilt = make_buffer(capacity_groups=2, max_staleness=2)
    for data in stubbed:
        apply(rebuilt, decode_record(data))
    assert state(rebuilt) == state(live)
