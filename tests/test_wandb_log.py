"""Weights & Biases in offline mode (no network): the scalars land under TensorBoard's names and the
episodes as a table, read back from the files wandb writes."""

from __future__ import annotations

import json
import struct

import pytest

from horizonrl.coordinator import Coordinator
from horizonrl.core.config import TrainConfig
from horizonrl.core.runtime import StopFlag
from horizonrl.coordinator.wandb_log import EPISODE_COLUMNS, WandbLog, episode_row
from horizonrl.launcher import resolve_ports
from horizonrl.protocol import EpisodeSample, LearnerReport

BLOCK = 32 * 1024
HEADER = 7  # ":W&B", a 2-byte magic and a version byte


def wandb_records(path):
    """The protobuf records of a ``.wandb`` file (LevelDB's log format: 32 KiB blocks of
    chunks with a 7-byte header: checksum, length, type FULL=1 / FIRST=2 / MIDDLE=3 / LAST=4)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pending, pos = [], b"", HEADER
    while pos + 7 <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < 7:
            pos += left_in_block  # trailer padding
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def history(run_dir):
    [run_file] = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    rows = []
    for record in wandb_records(run_file):
        if record.WhichOneof("record_type") == "history":
            rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item})
    return rows


def test_offline_scalars_and_episode_table(tmp_path):
    sink = WandbLog({"project": "test", "mode": "offline"}, tmp_path, "run-abc", {"learner": {"lr": 1e-6}})
    sink.scalars({"rollout/success_rate": 0.25, "learner/loss": 1.5}, step=1)
    sink.scalars({"rollout/success_rate": 0.5, "learner/loss": 1.25}, step=2)
    sample = EpisodeSample(run_id="run-abc", env="babyai", task_id=7, actor_id=0, weight_version=2, max_turns=5,
                           reward=1.0, success=True, score=1.0, num_turns=2, stop_reason="done",
                           transcript=[("observation", "Goal: go to the red ball"), ("reply", "Action: turn left")])
    sink.episodes([episode_row(sample, 2)], step=2)
    sink.close()

    scalars = [(h["_step"], h.get("rollout/success_rate"), h.get("learner/loss")) for h in history(tmp_path)
               if "learner/loss" in h]
    assert scalars == [(1, 0.25, 1.5), (2, 0.5, 1.25)]
    [table_file] = list((tmp_path / "wandb").glob("offline-run-*/files/media/table/episodes/samples_*.table.json"))
    table = json.loads(table_file.read_text())
    assert table["columns"] == EPISODE_COLUMNS
    assert table["data"] == [[2, "babyai", 7, True, 1.0, 2, "",
                              "[observation] Goal: go to the red ball\n\n[reply] Action: turn left"]]


def test_the_coordinator_logs_each_step_and_its_episode_samples_when_asked(tmp_path):
    """A run's own path: monitor.wandb makes the coordinator log every learner step's scalars (the names it
    writes to TensorBoard) and the episode samples received since the last step as that step's table."""
    config = resolve_ports(TrainConfig.model_validate({
        "run": {"output_dir": str(tmp_path), "run_id": "wandb-run"}, "model": {"path": "unused"},
        "envs": [{"name": "signpost"}], "network": {"host": "127.0.0.1"},
        "algorithm": {"rounds_ctrl": {"type": "scaling_inter_stepwise", "rounds": [2, 3], "steps_scaling_inter": 1}},
        "monitor": {"wandb": {"project": "test", "mode": "offline"}}}))
    coordinator = Coordinator(config, StopFlag())
    try:
        coordinator.on_episode_sample(EpisodeSample(
            run_id="wandb-run", env="signpost", task_id=3, actor_id=1, weight_version=0, max_turns=2, reward=0.0,
            success=False, score=0.0, num_turns=2, stop_reason="max_turns",
            transcript=[("observation", "The sign points left."), ("reply", "Action: right")]))
        coordinator.on_learner_report(LearnerReport(run_id="wandb-run", step=1, weight_version=1,
                                                    metrics={"learner/loss": 0.75}))
        coordinator.on_learner_report(LearnerReport(run_id="wandb-run", step=2, weight_version=2,
                                                    metrics={"learner/loss": 0.5}))
    finally:
        coordinator.close()
    steps = {h["_step"]: h for h in history(tmp_path) if "learner/loss" in h}
    assert sorted(steps) == [1, 2]
    assert (steps[1]["learner/loss"], steps[2]["learner/loss"]) == (0.75, 0.5)
    # the budget the step trained under, then the next: rounds [2, 3] switch after step 1
    assert (steps[1]["schedule/max_turns"], steps[2]["schedule/max_turns"]) == (2, 3)
    assert "rollout/failures/environment" in steps[1]  # every TensorBoard scalar, not a chosen few
    [table_file] = list((tmp_path / "wandb").glob("offline-run-*/files/media/table/episodes/samples_*.table.json"))
    table = json.loads(table_file.read_text())
    assert [row[:3] for row in table["data"]] == [[0, "signpost", 3]]  # logged once, at step 1


def test_close_gives_up_waiting_after_its_timeout(caplog):
    """A stalled finish (an upload that never completes) must not hang the coordinator's exit. The real
    finish is tested above; here a stand-in run that never returns isolates the bound."""
    import threading
    import time

    release = threading.Event()

    class StalledRun:
        dir = "/tmp/somewhere/wandb/run-x"

        def finish(self):
            release.wait(60)

    class FakeWandb:
        @staticmethod
        def teardown():
            pass

    sink = WandbLog.__new__(WandbLog)
    sink.run, sink._wandb = StalledRun(), FakeWandb()
    start = time.monotonic()
    try:
        with caplog.at_level("WARNING", logger="horizonrl.wandb"):
            sink.close(timeout_s=0.5)
        assert time.monotonic() - start < 10
        assert "did not finish within 0.5 s" in caplog.text
        assert "/tmp/somewhere/wandb/run-x" in caplog.text
    finally:
        release.set()


def test_close_raises_what_finish_raised():
    class BrokenRun:
        def finish(self):
            raise RuntimeError("disk full")

    sink = WandbLog.__new__(WandbLog)
    sink.run, sink._wandb = BrokenRun(), None
    with pytest.raises(RuntimeError, match="disk full"):
        sink.close(timeout_s=10)
