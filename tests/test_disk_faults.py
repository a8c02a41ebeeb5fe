"""Faults that are not the process's own bug do not kill it (in-process, with the disk's refusals simulated
where the process writes): a full disk costs TensorBoard's scalars and the episode records what they refuse,
counted and said once with the path; the buffer's write-ahead log waits for the disk and acknowledges nothing
meanwhile; the events of the outage reach ``events.jsonl`` after it."""

from __future__ import annotations

import errno
import time

import pytest

from horizonrl.apps.hostile import trajectory
from horizonrl.buffer.server import BufferServer
from horizonrl.coordinator import Coordinator
from horizonrl.coordinator.faults import WRITE_FAILURES
from horizonrl.coordinator.writers import TensorBoardWriter
from horizonrl.core.config import TrainConfig
from horizonrl.core.episode_records import EpisodeRecordWriter
from horizonrl.core.run_events import read_events
from horizonrl.core.runtime import StopFlag
from horizonrl.launcher import resolve_ports
from horizonrl.protocol import ACK_ACCEPTED, LearnerReport, encode

RUN_ID = "disk"
# TensorBoard's writer thread dies of the refused write, as it does on a full disk (the test's point)
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")


@pytest.fixture
def config(tmp_path) -> TrainConfig:
    return resolve_ports(TrainConfig.model_validate({
        "run": {"output_dir": str(tmp_path), "run_id": RUN_ID}, "model": {"path": "unused", "vocab_size": 128},
        "envs": [{"name": "signpost"}], "network": {"host": "127.0.0.1"},
        "rollout": {"n": 2, "max_context_tokens": 64, "max_tokens_per_turn": 8},
        "learner": {"total_steps": 10, "groups_per_step": 1}, "buffer": {"capacity_groups": 4}}))


@pytest.fixture
def full_disk(monkeypatch):
    """TensorBoard's record writer refuses every write while ``full[0]`` (its writer thread dies of it, as on a
    full disk: every later call of the SummaryWriter raises the error)."""
    from tensorboard.summary.writer import record_writer

    full = [False]
    real = record_writer.RecordWriter.write

    def write(self, data):
        if full[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, data)

    monkeypatch.setattr(record_writer.RecordWriter, "write", write)
    monkeypatch.setattr(TensorBoardWriter, "RETRY_S", 0.0)
    return full


def scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    mux = EventMultiplexer().AddRunsFromDirectory(str(run_dir / "tensorboard"))
    mux.Reload()
    out: dict[str, list] = {}
    for run in mux.Runs():
        for tag in mux.GetAccumulator(run).Tags()["scalars"]:
            out.setdefault(tag, []).extend((e.step, e.value) for e in mux.Scalars(run, tag))
    return out


def test_tensorboard_on_a_full_disk_drops_and_counts_the_scalars_and_writes_again_after(tmp_path, full_disk, caplog):
    writer = TensorBoardWriter(tmp_path / "tensorboard")
    assert writer.scalars({"loss/policy": 1.0}, 1)
    full_disk[0] = True
    with caplog.at_level("WARNING", logger="horizonrl.coordinator"):
        assert not writer.scalars({"loss/policy": 2.0}, 2)
        assert not writer.text("episodes/signpost", "text", 2)
        full_disk[0] = False
        assert writer.scalars({"loss/policy": 3.0}, 3)  # a new writer, a new event file
    writer.close()
    assert writer.failures >= 2
    refusals = [r.getMessage() for r in caplog.records if "cannot write TensorBoard" in r.getMessage()]
    assert len(refusals) == 1 and str(tmp_path / "tensorboard") in refusals[0]
    assert sorted(step for step, _ in scalars(tmp_path)["loss/policy"]) == [1, 3]


def test_the_coordinator_takes_a_learner_report_on_a_full_disk_and_counts_the_refused_write(config, full_disk):
    coordinator = Coordinator(config, StopFlag())
    try:
        full_disk[0] = True
        for step in (1, 2):
            coordinator.take(encode(LearnerReport(run_id=RUN_ID, step=step, weight_version=step,
                                                  metrics={"loss/policy": 0.5})))
        assert coordinator.learner_step == 2  # the run goes on
        assert coordinator.ledger.faults[WRITE_FAILURES] >= 2
        full_disk[0] = False
        coordinator.take(encode(LearnerReport(run_id=RUN_ID, step=3, weight_version=3, metrics={"loss/policy": 0.5})))
    finally:
        coordinator.close()
    charted = scalars(config.run_dir.root)
    assert max(step for step, _ in charted["loss/policy"]) == 3
    assert max(value for _, value in charted[f"faults/{WRITE_FAILURES}"]) >= 2


def test_the_buffer_accepts_on_while_its_episode_records_are_refused(config, monkeypatch):
    import horizonrl.core.episode_records as records

    monkeypatch.setattr(EpisodeRecordWriter, "RETRY_S", 0.0)
    server = BufferServer(config, StopFlag())
    try:
        def refused(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(records, "open", refused, raising=False)
        server.recorder.close()
        for n in range(2):
            t = trajectory(RUN_ID, f"g-{n}", with_text=True)
            server._admit(b"actor-0", t, encode(t))
        assert [entry[1] for entry in server._outbox[b"actor-0"]] == [ACK_ACCEPTED, ACK_ACCEPTED]
        server._watch_the_disk()
        assert server.stats()["episode_record_write_failures"] == 2
    finally:
        server.close()
    [failed] = read_events(config.output_dir, "write_failed")
    assert failed["critical"] is False and failed["path"].endswith("episodes")


def test_the_buffer_holds_its_acknowledgements_while_its_log_waits_for_the_disk(config, monkeypatch):
    import horizonrl.buffer.wal as wal_module

    monkeypatch.setattr(wal_module, "RETRY_FIRST_S", 0.01)
    monkeypatch.setattr(wal_module, "RETRY_MAX_S", 0.05)
    full = [False]
    real = wal_module._writev_all

    def writev(fd, pieces):
        if full[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, pieces)

    monkeypatch.setattr(wal_module, "_writev_all", writev)
    server = BufferServer(config, StopFlag())
    sent = []
    monkeypatch.setattr(server, "_send", lambda sock, identity, message: sent.append(message))
    try:
        full[0] = True
        t = trajectory(RUN_ID, "g-0")
        server._admit(b"actor-0", t, encode(t))
        server._flush()
        deadline = time.monotonic() + 5
        while server.wal.write_retries < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        server._flush()
        server._watch_the_disk()
        assert sent == [] and server.stats()["wal_write_retries"] >= 2  # not acknowledged: not on disk
        full[0] = False
        server.wal.wait_durable(server.wal.submit(), 5)
        server._flush()
        server._watch_the_disk()
        assert [ack.statuses for ack in sent] == [[ACK_ACCEPTED]]
    finally:
        server.close()
    kinds = [e["event"] for e in read_events(config.output_dir) if e["event"].startswith("write_")]
    assert kinds == ["write_failed", "write_recovered"]
