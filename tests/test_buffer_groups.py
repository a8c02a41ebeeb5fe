from helpers import make_trajectory

from horizonrl.buffer.groups import GroupBuffer


def make_buffer(**kw):
    args = dict(capacity_groups=4, max_staleness=1, skip_equal_reward_groups=True, group_timeout_s=10.0)
    args.update(kw)
    return GroupBuffer(**args)


def add_group(buf, gid, rewards, version=0, failures=()):
    for i, r in enumerate(rewards):
        buf.add(make_trajectory(gid, i, reward=r, group_size=len(rewards), version=version,
                                failure="environment" if i in failures else ""))


def test_groups_complete_then_serve_oldest_first():
    buf = make_buffer()
    add_group(buf, "a", [0, 1, 0, 1])
    add_group(buf, "b", [1, 0, 0, 0])
    assert buf.take(3, learner_version=0) is None  # not enough yet, nothing lost
    batch = buf.take(2, learner_version=0)
    assert [g[0].group_id for g in batch] == ["a", "b"]
    assert buf.served_trajectories == 8


def test_every_trajectory_is_accounted_for():
    buf = make_buffer()
    add_group(buf, "equal", [0, 0, 0, 0])
    add_group(buf, "failed", [1, 1, 0, 0], version=2, failures=(0, 2))
    add_group(buf, "stale", [1, 0, 0, 0], version=0)
    add_group(buf, "fresh", [1, 0, 0, 0], version=3)
    buf.add(make_trajectory("partial", 0, reward=1.0, group_size=4))
    batch = buf.take(2, learner_version=3)  # "stale" has staleness 3 > 1
    assert [g[0].group_id for g in batch] == ["failed", "fresh"]
    assert all(not t.failure for g in batch for t in g)
    assert len(batch[0]) == 2  # the two healthy members of the group with infra failures
    served = sum(len(g) for g in batch)
    assert served + sum(buf.dropped.values()) + buf.held_trajectories() == buf.received
    assert buf.dropped == {"equal_rewards": 4, "infra_failure": 2, "stale": 4}  # kept aside, then too stale


def test_backpressure_flag_and_group_timeout():
    now = [0.0]
    buf = make_buffer(capacity_groups=2, clock=lambda: now[0])
    add_group(buf, "a", [0, 1])
    assert not buf.full
    add_group(buf, "b", [0, 1])
    assert buf.full
    buf.add(make_trajectory("lost", 0, reward=1.0, group_size=2))
    now[0] = 11.0
    buf.expire()
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
    assert buf.take(2, learner_version=0) is None
    batch = buf.take(2, learner_version=0, allow_equal=True)
    assert [g[0].group_id for g in batch] == ["useful", "all-solved-3"]
    assert buf.dropped["equal_rewards"] == 2 and buf.served_equal_groups == 1 and buf.equal_groups_seen == 3
    assert buf.served_trajectories + sum(buf.dropped.values()) + buf.held_trajectories() == buf.received
