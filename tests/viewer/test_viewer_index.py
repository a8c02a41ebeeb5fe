"""The viewer's index: every filter of the list page, the join of episodes with the learner step that
trained on them (the last "trained" line holds), following files that grow, early vs late."""

from __future__ import annotations

import pytest
from viewer_records import synthetic_record

from horizonrl.core.episode_records import EpisodeRecordWriter, trained_record
from horizonrl.apps.viewer.index import EpisodeFilter, EpisodeIndex


@pytest.fixture
def index(tmp_path):
    writer = EpisodeRecordWriter(tmp_path)
    records = [
        synthetic_record("g1", 0, env="babyai", task_id=7, success=True, turns=3, versions=[0, 0, 1]),
        synthetic_record("g1", 1, env="babyai", task_id=7, turns=5, versions=[0, 1, 1, 1, 1]),
        synthetic_record("g2", 0, env="textcraft", task_id=3, failure="environment", turns=2, versions=[2, 2]),
        synthetic_record("g3", 0, env="babyai", task_id=7, success=True, turns=2, versions=[4, 4],
                         reply="Action: pickup the purple key"),
        synthetic_record("e1", 0, env="babyai", task_id=0, failure="prompt_too_long", turns=0, evaluation=True),
    ]
    for record in records:
        writer.write(record)
    writer.write(trained_record(1, ["g1", "g2"]))
    writer.write(trained_record(2, ["g3"]))
    writer.write(trained_record(3, ["g2"]))  # g2 handed out again after a learner restart: step 3 holds
    writer.close()
    idx = EpisodeIndex(tmp_path)
    idx.refresh(force=True)
    return idx


def keys(index, **query):
    flt = EpisodeFilter.from_query({k: str(v) for k, v in query.items()})
    assert not flt.errors, flt.errors
    return [e.key for e in index.select(flt)]


def test_newest_first_and_every_filter(index):
    assert keys(index) == ["e1-0", "g3-0", "g2-0", "g1-1", "g1-0"]
    assert keys(index, env="textcraft") == ["g2-0"]
    assert keys(index, task=7) == ["g3-0", "g1-1", "g1-0"]
    assert keys(index, outcome="success") == ["g3-0", "g1-0"]
    assert keys(index, outcome="failed") == ["e1-0", "g2-0", "g1-1"]
    assert keys(index, failure="any") == ["e1-0", "g2-0"]
    assert keys(index, failure="none") == ["g3-0", "g1-1", "g1-0"]
    assert keys(index, failure="prompt_too_long") == ["e1-0"]
    assert keys(index, kind="evaluation") == ["e1-0"]
    assert keys(index, kind="training") == ["g3-0", "g2-0", "g1-1", "g1-0"]
    assert keys(index, step_min=2) == ["g3-0", "g2-0"]
    assert keys(index, step_min=1, step_max=1) == ["g1-1", "g1-0"]
    assert keys(index, turns_min=3) == ["g1-1", "g1-0"]
    assert keys(index, turns_max=0) == ["e1-0"]
    assert keys(index, version_min=1, version_max=2) == ["g2-0", "g1-1", "g1-0"]  # turns' versions overlap [1, 2]
    assert keys(index, version_min=3) == ["g3-0"]
    assert keys(index, q="PURPLE key") == ["g3-0"]  # words anywhere in the texts, any case
    assert keys(index, q="observation 5") == ["g1-1"]
    assert keys(index, env="babyai", outcome="failed", failure="none") == ["g1-1"]


def test_bad_filter_values_are_reported_not_applied():
    flt = EpisodeFilter.from_query({"turns_min": "three", "outcome": "maybe", "env": "babyai"})
    assert len(flt.errors) == 2 and flt.turns_min is None and flt.outcome == "" and flt.env == "babyai"
    assert flt.query() == {"env": "babyai"}


def test_each_episode_joins_the_last_step_that_trained_its_group(index):
    step = {e.key: index.trained_step(e) for e in index.entries}
    assert step == {"g1-0": 1, "g1-1": 1, "g2-0": 3, "g3-0": 2, "e1-0": None}
    assert [e.key for e in index.trained_at(1)] == ["g1-1", "g1-0"]
    assert [e.key for e in index.trained_at(3)] == ["g2-0"]
    assert index.steps() == [1, 2, 3]  # step 1 keeps g1


def test_early_and_late_versions_of_a_task(index):
    early, late = index.early_and_late("babyai", 7)
    assert (early.key, late.key) == ("g1-0", "g3-0")
    assert index.early_and_late("textcraft", 3) is None  # one episode
    assert [task for task, _ in index.tasks_seen_at_several_versions()] == [("babyai", 7)]


def test_one_groups_episodes_at_the_same_versions_compare_nothing(tmp_path):
    writer = EpisodeRecordWriter(tmp_path)
    for i in range(3):
        writer.write(synthetic_record("g1", i, task_id=2, turns=2, versions=[0, 3]))
    writer.close()
    index = EpisodeIndex(tmp_path)
    index.refresh(force=True)
    assert index.early_and_late("signpost", 2) is None and index.tasks_seen_at_several_versions() == []


def test_the_index_follows_a_growing_directory(tmp_path):
    index = EpisodeIndex(tmp_path, min_refresh_s=0.0)
    assert index.refresh() == 0 and index.entries == []
    writer = EpisodeRecordWriter(tmp_path, part_bytes=1)  # every line in a new part file
    writer.write(synthetic_record("g1", 0))
    writer.write(synthetic_record("g1", 0))  # the same trajectory id twice (two evaluations in one second)
    assert index.refresh() == 2
    assert [e.key for e in index.entries] == ["g1-0", "g1-0~2"]
    writer.write(trained_record(5, ["g1"]))
    writer.close()
    assert index.refresh() == 1 and index.trained_step(index.entries[1]) == 5
    assert len(list(tmp_path.glob("episodes-*.jsonl"))) == 3
