"""The buffer under a rising turn budget: the rule at a budget change and the staleness rule that keeps long
episodes (buffer/groups.py's docstring), and both surviving a log replay."""

import msgspec
from helpers import make_trajectory

from horizonrl.buffer.groups import GroupBuffer
from horizonrl.buffer.records import Accepted, Served, Settings, apply, settings_of
from horizonrl.core.schedule import TurnBudgetSchedule
from horizonrl.protocol import encode

RISING = TurnBudgetSchedule("scaling_inter_stepwise", (6, 13, 20), 2)  # steps 1-2: 6, 3-4: 13, then 20


def make_buffer(**kw):
    args = dict(capacity_groups=8, max_staleness=1, skip_equal_reward_groups=True, group_timeout_s=10.0)
    args.update(kw)
    return GroupBuffer(**args)


def member(gid, i, *, max_turns=6, versions=(0,), reward=None):
    """A member whose tokens come from ``versions`` in order (one turn per version: a long episode spans several)."""
    t = make_trajectory(gid, i, reward=float(i % 2) if reward is None else reward, group_size=2)
    spans = [(6 + k, 7 + k, 0, v) for k, v in enumerate(versions)]
    return msgspec.structs.replace(t, max_turns=max_turns, version_spans=spans, turn_versions=[min(versions)])


def add(buf, gid, **kw):
    for i in range(2):
        buf.accept(member(gid, i, **kw))


def test_budget_change_keep_trains_on_groups_of_the_previous_budget():
    buf = make_buffer(max_staleness=10, budget=RISING)
    add(buf, "old", max_turns=6)
    add(buf, "new", max_turns=13)
    assert buf.choose(2, learner_version=2) == ["old", "new"]  # keep is the default
    assert not buf.dropped


def test_budget_change_drop_previous_budget_drops_and_counts():
    buf = make_buffer(max_staleness=10, budget=RISING, on_budget_change="drop_previous_budget")
    add(buf, "old", max_turns=6)
    add(buf, "new", max_turns=13)
    assert buf.choose(1, learner_version=1) == ["old"]  # step 2 is still under 6: nothing dropped
    assert buf.choose(1, learner_version=2) == ["new"]  # step 3 trains under 13
    assert buf.dropped == {"previous_budget": 2}
    assert buf.fates["old-0"] == buf.fates["old-1"] == "dropped:previous_budget"
    assert buf.stats()["dropped_previous_budget"] == 2.0


def test_drop_previous_budget_without_a_schedule_keeps_everything():
    buf = make_buffer(max_staleness=10, on_budget_change="drop_previous_budget")
    add(buf, "a", max_turns=6)
    assert buf.choose(1, learner_version=5) == ["a"]


def test_oldest_token_rule_drops_a_long_episode_that_completion_keeps():
    # a long episode: its first turn under version 0, its last under 4; the learner is at 5
    long_group = dict(versions=(0, 1, 2, 3, 4))
    oldest = make_buffer(max_staleness=2)
    add(oldest, "long", **long_group)
    assert oldest.choose(1, learner_version=5) is None and oldest.dropped == {"stale": 2}
    completion = make_buffer(max_staleness=2, staleness_rule="completion")  # start bound 3 x 2 = 6
    add(completion, "long", **long_group)
    assert completion.choose(1, learner_version=5) == ["long"]


def test_completion_rule_still_drops_a_group_that_waited_too_long_or_started_too_early():
    buf = make_buffer(max_staleness=2, staleness_rule="completion", max_start_staleness=4)
    add(buf, "waited", versions=(3,))  # finished at 3, learner at 6: waited 3 > 2
    add(buf, "early", versions=(1, 5))  # finished recently, started 5 versions ago > 4
    add(buf, "fine", versions=(2, 5))  # start age 4, completion age 1
    assert buf.choose(1, learner_version=6) == ["fine"] and buf.ready_groups == 1
    assert buf.dropped == {"stale": 4}


def test_completion_age_is_the_groups_newest_token_not_each_members():
    # a short member finished long ago, its long sibling just now: the group completed now
    buf = make_buffer(max_staleness=1, staleness_rule="completion")
    buf.accept(member("g", 0, versions=(0,)))
    buf.accept(member("g", 1, versions=(0, 1, 2, 3)))
    assert buf.choose(1, learner_version=3) == ["g"]


def test_settings_replay_the_rules():
    live = make_buffer(max_staleness=2, staleness_rule="completion", max_start_staleness=5,
                       on_budget_change="drop_previous_budget", budget=RISING)
    replayed = make_buffer()
    apply(replayed, settings_of(live))
    assert settings_of(replayed) == settings_of(live)
    for buf in (live, replayed):
        for gid, kw in (("old", dict(max_turns=6, versions=(2,))), ("long", dict(max_turns=13, versions=(0, 1, 2, 3)))):
            for i in range(2):
                apply(buf, Accepted(encode(member(gid, i, **kw))))
        chosen = buf.choose(2, learner_version=3)
        apply(buf, Served(buf.next_batch, 1, 3, chosen or []))
    assert live.fates == replayed.fates and live.dropped == replayed.dropped == {"previous_budget": 2}


def test_a_log_written_before_these_settings_decides_as_before():
    old_record = msgspec.msgpack.decode(msgspec.msgpack.encode(Settings(4, 2, True)), type=Settings)
    buf = make_buffer(staleness_rule="completion", on_budget_change="drop_previous_budget", budget=RISING)
    apply(buf, old_record)
    assert (buf.staleness_rule, buf.on_budget_change, buf.budget) == ("oldest_token", "keep", None)
