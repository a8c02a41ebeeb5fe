"""The buffer's write-ahead log: order, segments, a torn tail, corruption, compaction."""

import errno
import os
import threading
import time

import pytest

import horizonrl.buffer.wal as wal_module
from horizonrl.buffer.wal import WalCorruption, WriteAheadLog


def records(n, size=100):
    return [bytes([i % 251]) * size + str(i).encode() for i in range(n)]


@pytest.mark.parametrize("fsync", ["always", "batch", "never"])
def test_records_come_back_in_order_across_segments(tmp_path, fsync):
    wal = WriteAheadLog(tmp_path, fsync=fsync, segment_bytes=1000)
    data = records(50)
    for i, r in enumerate(data):
        wal.append(r)
        if i % 7 == 0:
            wal.sync()
    wal.close()
    assert len(wal.segments()) > 3  # rotated
    assert list(WriteAheadLog(tmp_path).replay()) == data


def test_appended_but_not_synced_records_are_not_durable(tmp_path):
    wal = WriteAheadLog(tmp_path, fsync="batch")
    wal.append(b"synced")
    wal.sync()
    wal.append(b"pending")  # a crash now: never written
    assert list(WriteAheadLog(tmp_path).replay()) == [b"synced"]


def test_a_torn_tail_is_cut_off_and_appending_continues(tmp_path):
    wal = WriteAheadLog(tmp_path, fsync="always")
    for r in records(5):
        wal.append(r)
    wal.close()
    segment = wal.segments()[-1]
    segment.write_bytes(segment.read_bytes()[:-30])  # the crash interrupted the last write
    recovered = WriteAheadLog(tmp_path)
    assert list(recovered.replay()) == records(4) and recovered.torn_tail_bytes > 0
    recovered.append(b"after the crash")
    recovered.close()
    assert list(WriteAheadLog(tmp_path).replay()) == records(4) + [b"after the crash"]


def test_corruption_inside_the_log_is_an_error(tmp_path):
    wal = WriteAheadLog(tmp_path, fsync="always")
    for r in records(5):
        wal.append(r)
    wal.close()
    segment = wal.segments()[0]
    data = bytearray(segment.read_bytes())
    data[150] ^= 0xFF  # a flipped byte in the second record
    segment.write_bytes(bytes(data))
    with pytest.raises(WalCorruption, match="fails its checksum"):
        list(WriteAheadLog(tmp_path).replay())


def test_compaction_rewrites_closed_segments_atomically(tmp_path):
    wal = WriteAheadLog(tmp_path, fsync="batch", segment_bytes=500)
    data = records(20)
    for r in data:
        wal.append(r)
        wal.sync()
    before_size = wal.size_bytes()
    keep_even = lambda r: r if int(r[100:]) % 2 == 0 else b"x"  # noqa: E731 - shrink odd records to a stub
    before, after = wal.rewrite_closed(keep_even)
    wal.merge_closed()
    assert after < before and wal.size_bytes() < before_size and len(wal.segments()) == 1
    wal.append(b"new")
    wal.close()
    assert list(WriteAheadLog(tmp_path).replay()) == [keep_even(r) for r in data] + [b"new"]


def test_a_submitted_batch_becomes_durable_under_its_ticket_and_wakes_a_poller(tmp_path):
    import select

    wal = WriteAheadLog(tmp_path, fsync="batch")
    wal.append(b"a")
    first = wal.submit()
    wal.append(b"b")
    second = wal.submit()
    assert second > first and wal.submit() == second  # nothing new: the same ticket
    readable, _, _ = select.select([wal.wakeup_fd], [], [], 10)
    assert readable  # the writer said it advanced
    wal.wait_durable(second, 10)
    assert wal.durable >= second
    wal.close()
    assert list(WriteAheadLog(tmp_path).replay()) == [b"a", b"b"]


def test_a_failed_write_that_is_not_the_disks_is_raised_and_nothing_after_it_is_durable(tmp_path, monkeypatch):
    wal = WriteAheadLog(tmp_path, fsync="batch")
    wal.append(b"a")
    wal.sync()

    def disk_full(records):
        raise OSError(errno.EBADF, "Bad file descriptor")  # our own bug: no retrying it

    monkeypatch.setattr(wal, "_write", disk_full)
    wal.append(b"b")
    ticket = wal.submit()
    with pytest.raises(OSError, match="writing failed"):
        wal.wait_durable(ticket, 10)
    assert wal.durable < ticket
    with pytest.raises(OSError):
        wal.submit()  # the buffer stops: nothing is acknowledged that is not on disk


@pytest.mark.parametrize("size", [0, 10, 255, 256, 65535, 65536, 100_000])
def test_an_accepted_record_in_parts_is_the_encoded_record(tmp_path, size):
    from horizonrl.buffer.records import Accepted, accepted_parts, decode_record, encode_record

    message = bytes(range(256)) * (size // 256) + bytes(size % 256)
    assert b"".join(accepted_parts(message)) == encode_record(Accepted(message))
    wal = WriteAheadLog(tmp_path, fsync="batch")
    wal.append(accepted_parts(message))  # written in parts, read back whole
    wal.close()
    [record] = WriteAheadLog(tmp_path).replay()
    assert decode_record(record) == Accepted(message)


def test_in_a_log_of_many_segments_only_the_newest_may_have_a_torn_tail(tmp_path):
    """Only the newest segment can hold a write a crash interrupted: a closed one was complete (and fsynced)
    before the next was opened, so a short record at its end is damage, never something to cut off."""
    wal = WriteAheadLog(tmp_path, fsync="always", segment_bytes=500)
    data = records(20)
    for r in data:
        wal.append(r)
    wal.close()
    segments = wal.segments()
    assert len(segments) > 2
    newest, closed = segments[-1], segments[0]
    newest.write_bytes(newest.read_bytes()[:-30])  # the crash interrupted the last write
    recovered = WriteAheadLog(tmp_path)
    assert list(recovered.replay()) == data[:-1] and recovered.torn_tail_bytes > 0
    damaged = closed.read_bytes()[:-30]
    closed.write_bytes(damaged)
    with pytest.raises(WalCorruption, match="fails its checksum"):
        list(WriteAheadLog(tmp_path).replay())
    assert closed.read_bytes() == damaged  # nothing was cut: the evidence stays for whoever looks


class FullDisk:
    """``_writev_all`` while the disk is full: the first refused write takes a few bytes (a record cut in half),
    every one raises ENOSPC, until ``free()``."""

    def __init__(self, monkeypatch, errno_=errno.ENOSPC):
        self.errno, self.refused, self.full = errno_, 0, threading.Event()
        real = wal_module._writev_all

        def writev(fd, pieces):
            if self.full.is_set():
                self.refused += 1
                if self.refused == 1:
                    os.write(fd, pieces[0][:5])
                raise OSError(self.errno, os.strerror(self.errno))
            real(fd, pieces)

        monkeypatch.setattr(wal_module, "_writev_all", writev)
        monkeypatch.setattr(wal_module, "RETRY_FIRST_S", 0.01)
        monkeypatch.setattr(wal_module, "RETRY_MAX_S", 0.05)

    def fill(self):
        self.full.set()

    def free(self):
        self.full.clear()


@pytest.mark.parametrize("errno_", [errno.ENOSPC, errno.EROFS])
def test_a_full_or_read_only_disk_pauses_the_log_and_it_goes_on_once_the_disk_takes_writes(tmp_path, monkeypatch,
                                                                                           errno_):
    disk = FullDisk(monkeypatch, errno_)
    wal = WriteAheadLog(tmp_path, fsync="batch", segment_bytes=400)
    data = records(12)
    for r in data[:4]:
        wal.append(r)
    wal.sync()
    disk.fill()
    for r in data[4:8]:
        wal.append(r)
    ticket = wal.submit()
    deadline = time.monotonic() + 10
    while disk.refused < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert disk.refused >= 3 and wal.durable < ticket  # nothing is durable (so nothing acknowledged) meanwhile
    assert wal.failing_since is not None and ".wal: " in wal.last_error  # the error names the file
    assert os.strerror(errno_) in wal.last_error
    wal.check()  # not an error: the writer waits for the disk
    disk.free()
    wal.wait_durable(ticket, 10)
    assert wal.failing_since is None and wal.write_retries >= 2
    for r in data[8:]:
        wal.append(r)
    wal.close()
    assert list(WriteAheadLog(tmp_path).replay()) == data  # the half record the refusal left was cut off


def test_a_disk_that_never_comes_back_stops_the_log_after_its_retry_limit(tmp_path, monkeypatch):
    disk = FullDisk(monkeypatch)
    wal = WriteAheadLog(tmp_path, fsync="batch", retry_limit_s=0.3)
    disk.fill()
    wal.append(b"a")
    ticket = wal.submit()
    with pytest.raises(OSError, match="writing failed"):
        wal.wait_durable(ticket, 10)
    assert wal.durable < ticket and wal.write_retries >= 1
