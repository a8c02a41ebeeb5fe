"""Recorded episodes: the JSON Lines format round-trips and reads with the standard library alone;
the writer's size limit and parts; the reader's following of a file being written; what the
actor sends and what the buffer refuses."""

from __future__ import annotations

import json
import subprocess
import sys

import msgspec
from helpers import make_trajectory

from horizonrl.actors.episode_messages import recorded, to_trajectory
from horizonrl.actors.episode import Episode
from horizonrl.core.environment import extract_action
from horizonrl.core.episode_records import EpisodeRecordReader, EpisodeRecordWriter, episode_record, trained_record
from horizonrl.protocol import EpisodeText, decode, encode
from horizonrl.protocol.validation import trajectory_problem


def with_text(t, **text):
    fields = dict(first_observation="Find the exit.", replies=["Thought: go.\nAction: go left"], actions=["go left"],
                  observations=["A wall. ✓"])
    return msgspec.structs.replace(t, text=EpisodeText(**{**fields, **text}))


READ_WITH_STDLIB = """
import glob, json, sys
episodes, trained = {}, {}
for path in sorted(glob.glob(sys.argv[1] + "/episodes-*.jsonl")):
    for line in open(path, encoding="utf-8"):
        record = json.loads(line)
        if record["kind"] == "episode":
            episodes[record["trajectory_id"]] = record
        else:
            trained.update({g: record["learner_step"] for g in record["group_ids"]})
print(json.dumps({"episodes": episodes, "trained": trained}))
"""


def test_records_round_trip_through_a_standard_library_reader(tmp_path):
    t = with_text(make_trajectory("g7", 2, reward=1.0, version=3, epoch=1, task_id=41))
    writer = EpisodeRecordWriter(tmp_path)
    assert writer.write(episode_record(t)) and writer.write(trained_record(4, ["g7", "g8"]))
    writer.close()
    out = subprocess.run([sys.executable, "-I", "-c", READ_WITH_STDLIB, str(tmp_path)], capture_output=True,
                         text=True, check=True, timeout=60).stdout
    read = json.loads(out)
    episode = read["episodes"]["g7-2"]
    assert (episode["env"], episode["task_id"], episode["group_id"], episode["success"], episode["reward"]) == \
        ("signpost", 41, "g7", True, 1.0)
    assert episode["first_observation"] == "Find the exit."
    assert episode["turns"] == [{"reply": "Thought: go.\nAction: go left", "action": "go left",
                                 "observation": "A wall. ✓", "reward": 1.0, "version": 3, "epoch": 1, "sample": 0,
                                 "summary": False}]
    assert episode["samples"] == 1
    assert episode["evaluation"] is False and episode["failure"] == "" and episode["stop_reason"] == "done"
    assert read["trained"] == {"g7": 4, "g8": 4}


def test_a_failed_turn_has_no_observation_and_no_reward(tmp_path):
    t = msgspec.structs.replace(make_trajectory("g1", 0), turn_rewards=[], failure="environment",
                                failure_message="server gone")
    record = episode_record(with_text(t, observations=[]))
    assert record["turns"][0]["observation"] is None and record["turns"][0]["reward"] is None
    assert record["failure"] == "environment" and record["failure_message"] == "server gone"


def test_size_limit_and_parts(tmp_path):
    record = episode_record(with_text(make_trajectory("g1", 0)))
    size = len(json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode()) + 1
    writer = EpisodeRecordWriter(tmp_path, max_bytes=size * 5, part_bytes=size * 2)
    assert [writer.write(record) for _ in range(7)] == [True] * 5 + [False] * 2
    writer.close()
    parts = sorted(p.name for p in tmp_path.glob("episodes-*.jsonl"))
    assert parts == ["episodes-00000.jsonl", "episodes-00001.jsonl", "episodes-00002.jsonl"]
    again = EpisodeRecordWriter(tmp_path, max_bytes=size * 5)  # a restarted buffer counts what is there
    assert again.total_bytes == size * 5 and not again.write(record)


def test_the_reader_follows_a_file_being_written(tmp_path):
    reader = EpisodeRecordReader(tmp_path)
    assert list(reader.new_records()) == []
    path = tmp_path / "episodes-00000.jsonl"
    path.write_text('{"kind": "trained", "learner_step": 1, "group_ids": []}\n{"kind": "trai')
    assert [r["learner_step"] for r in reader.new_records()] == [1]  # the half line waits
    with open(path, "a") as f:
        f.write('ned", "learner_step": 2, "group_ids": []}\n')
    assert [r["learner_step"] for r in reader.new_records()] == [2]
    assert list(reader.new_records()) == []


def test_the_text_travels_in_the_trajectory_message_and_is_checked():
    t = with_text(make_trajectory("g1", 0))
    assert decode(encode(t)) == t
    assert trajectory_problem(t) is None
    assert trajectory_problem(with_text(t, replies=["a", "b"]))[0] == "fields"  # two replies, one turn
    assert trajectory_problem(with_text(t, observations=["x" * 5000]))[0] == "fields"  # over MAX_SAMPLE_TEXT


def test_the_actor_records_whole_groups_at_the_configured_share():
    ids = [f"a{a}-g{g}" for a in range(4) for g in range(2500)]
    share = sum(recorded(i, 0.1) for i in ids) / len(ids)
    assert 0.08 < share < 0.12
    assert not any(recorded(i, 0.0) for i in ids) and all(recorded(i, 1.0) for i in ids)
    # a CRC of the id, not Python's per-process hash(): these very groups on every actor, machine and restart
    assert [g for g in range(60) if recorded(f"a0-g{g}", 0.1)] == [20, 24, 28, 34, 38]
    ep = Episode(observations=["task", "first answer"], replies=["Action: go"], actions=["go"],
                 turn_spans=[(2, 3)], turn_versions=[0], turn_epochs=[0], turn_rewards=[0.0],
                 token_ids=[1, 2, 3], loss_mask=[0, 0, 1], logprobs=[0.0, 0.0, -1.0], prompt_length=2)
    kwargs = dict(run_id="r", trajectory_id="g-0", group_id="g", group_size=1, env="signpost", task_id=0,
                  actor_id=0, max_turns=4, category="")
    assert to_trajectory(ep, **kwargs).text is None
    text = to_trajectory(ep, **kwargs, with_text=True).text
    assert (text.first_observation, text.replies, text.actions, text.observations) == \
        ("task", ["Action: go"], ["go"], ["first answer"])


def test_extract_action_for_people():
    assert extract_action("Thought: hm.\nAction: go to red ball 1.\n") == "go to red ball 1"
    assert extract_action("no action here") == ""
    assert extract_action("<think>x</think><search> capital of France </search>", "tags") == "search: capital of France"
    # WebArena's replies name the action between triple backticks (a language tag line is not the action)
    assert extract_action("Let me open it. In summary, the next action I will perform is ```click [12]```",
                          "backticks") == "click [12]"
    assert extract_action("```text\ntype [3] [red shoes] [1]\n```", "backticks") == "type [3] [red shoes] [1]"
    assert extract_action("```go_back```", "backticks") == "go_back"
    assert extract_action("click [12]", "backticks") == ""
    assert extract_action("<answer>Paris</answer>", "tags") == "answer: Paris"


class _FullDiskFile:
    """A file on a disk that is full: each write takes a few bytes, then raises ENOSPC."""

    def __init__(self, real):
        self.real = real
        self.name = real.name

    def write(self, data):
        self.real.write(bytes(data[:7]))
        raise OSError(28, "No space left on device")

    def __getattr__(self, name):
        return getattr(self.real, name)


def test_a_full_disk_costs_the_records_it_refuses_never_the_writer(tmp_path, monkeypatch, caplog):
    import builtins

    import horizonrl.core.episode_records as records

    monkeypatch.setattr(EpisodeRecordWriter, "RETRY_S", 0.0)
    writer = EpisodeRecordWriter(tmp_path)
    assert writer.write(trained_record(1, ["g0"]))
    full = [True]
    real_open = builtins.open
    monkeypatch.setattr(records, "open", lambda *a, **k: _FullDiskFile(real_open(*a, **k)) if full[0]
                        else real_open(*a, **k), raising=False)
    writer.close()  # the next line opens the file again, on the full disk
    with caplog.at_level("WARNING", logger="horizonrl.episode_records"):
        assert not writer.write(trained_record(2, ["g1"]))
        assert not writer.write(trained_record(3, ["g2"]))
        assert writer.failing and writer.write_failures == 2
        full[0] = False
        assert writer.write(trained_record(4, ["g3"]))
    assert not writer.failing
    refusals = [r.getMessage() for r in caplog.records if "cannot write" in r.getMessage()]
    assert len(refusals) == 1 and "episodes-00000.jsonl" in refusals[0]  # once per outage, naming the file
    writer.close()
    lines = (tmp_path / "episodes-00000.jsonl").read_text().splitlines()
    assert [json.loads(line)["learner_step"] for line in lines] == [1, 4]  # no half line left by the refusals
