"""The run's event file (core/run_events.py): what tests and tools read instead of console wording."""

import multiprocessing
import os

from horizonrl.core.run_dirs import RunDir
from horizonrl.core.run_events import EventLog, RunEvent, iter_events, read_events


def _write_many(output_dir: str, role: str, count: int) -> None:
    events = EventLog(output_dir, role)
    for step in range(count):
        events.emit(RunEvent.STEP_DONE, step=step, padding="x" * 200)


def test_lines_of_several_processes_never_interleave(tmp_path):
    workers = [multiprocessing.get_context("spawn").Process(target=_write_many, args=(str(tmp_path), f"w{i}", 300))
               for i in range(3)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
    records = read_events(tmp_path)
    assert len(records) == 900
    for role in ("w0", "w1", "w2"):
        assert [r["step"] for r in records if r["role"] == role] == list(range(300))


def test_reading_filters_by_kind_and_skips_a_torn_last_line(tmp_path):
    events = EventLog(tmp_path, "learner-0")
    events.emit(RunEvent.STEP_TRAINED, step=1)
    events.emit(RunEvent.CHECKPOINT_WRITTEN, step=1, path="x")
    with open(RunDir(tmp_path).events, "ab") as out:
        out.write(b'{"event": "step_done", "st')  # a writer killed mid-line
    assert [r["event"] for r in read_events(tmp_path)] == ["step_trained", "checkpoint_written"]
    [written] = read_events(tmp_path, RunEvent.CHECKPOINT_WRITTEN)
    assert written["step"] == 1 and written["role"] == "learner-0" and written["pid"] == os.getpid()
    assert read_events(tmp_path / "nowhere") == []


def test_an_unwritable_run_directory_does_not_stop_the_writer(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    events = EventLog(blocked, "buffer")
    events.emit(RunEvent.BUFFER_FULL, ready_groups=4)  # logged once, never raised
    events.emit(RunEvent.BUFFER_FULL, ready_groups=4)
    assert read_events(blocked) == []


def test_a_tail_reads_only_the_newest_whole_lines(tmp_path):
    events = EventLog(tmp_path, "learner-0")
    for step in range(200):
        events.emit(RunEvent.STEP_DONE, step=step, weights_sent=True)
    size = (RunDir(tmp_path).events).stat().st_size
    tail = list(iter_events(tmp_path, RunEvent.STEP_DONE, tail_bytes=size // 4))
    assert 30 <= len(tail) <= 50 and [e["step"] for e in tail] == list(range(200 - len(tail), 200))
    assert len(list(iter_events(tmp_path, tail_bytes=10 * size))) == 200  # a tail longer than the file: all of it


def test_the_events_of_an_outage_reach_the_file_once_it_takes_them_again(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.write_text("a file where the run directory should be: every write fails")  # as a full disk's would
    events = EventLog(run_dir, "launcher")
    events.emit(RunEvent.PROCESS_DIED, name="buffer", exit_code=1)
    events.emit(RunEvent.PROCESS_RESTARTED, name="buffer", restarts=1, delay_s=1.0)
    events.retry()  # still refused: kept
    run_dir.unlink()  # the disk takes writes again
    events.retry()
    events.emit(RunEvent.PROCESS_RECOVERED, name="buffer")
    assert [(e["event"], e["name"]) for e in read_events(run_dir)] == [
        ("process_died", "buffer"), ("process_restarted", "buffer"), ("process_recovered", "buffer")]
