"""The buffer's write-ahead log: append-only segment files of checksummed records.

Layout: ``<dir>/seg_00000001.wal``, ``seg_00000002.wal``, ... Each record is

    u32 length | u32 crc32(payload) | payload (length bytes)          (little-endian)

and a segment is closed once it exceeds ``segment_bytes``; records are only ever appended to the
newest one. What a record means is the caller's business (``buffer/records.py``).

Durability (``fsync``): ``always`` — each :meth:`append` is on disk before it returns;
``batch`` — the records appended since the last :meth:`submit` are written and fsynced together
(group commit); ``never`` — records reach the OS when written and the disk when the OS decides (a
machine crash can lose the newest ones, a process crash cannot).

Writing happens on a writer thread, so the caller goes on with its work while the disk works
(the checksums, the write and the fsync release the GIL): :meth:`submit` hands over what was
appended and returns a ticket; ``durable`` is the newest ticket on disk, and ``wakeup_fd``
becomes readable each time it advances (for a poller). While one batch is being written the
next one grows, so batches get larger exactly when the disk is the bottleneck. :meth:`sync`
submits and waits.

A disk that is full, read-only or failing (``DISK_ERRNOS``) is not the buffer's bug: the writer cuts what the
failed attempt left of the batch off the segment, waits (back-off from ``RETRY_FIRST_S`` to ``RETRY_MAX_S``)
and writes the batch again, for up to ``retry_limit_s``; meanwhile ``durable`` does not move, so nothing is
acknowledged that is not on disk, and ``failing_since``/``write_retries``/``last_error`` say so (the buffer
turns them into events and counters). Any other failed write, or one past the limit, stops the writer:
``durable`` never passes it, and the next :meth:`submit` or :meth:`check` raises the error.

Recovery (:meth:`replay`): a crash can leave the newest segment with a torn last record; it is cut
off (and counted). A checksum mismatch anywhere else is corruption of durable data: a clear
error, never a silent skip.

Compaction (:meth:`rewrite_closed`): the caller rewrites each closed segment through a function
that keeps, shrinks or drops records; the rewritten segment replaces the old one atomically
(write to a temporary file, fsync, rename).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import re
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

from horizonrl.core.disk import DISK_ERRNOS

log = logging.getLogger("horizonrl.buffer.wal")

HEADER = struct.Struct("<II")
IOV_MAX = 1024  # buffers per writev call (Linux's limit)
SEGMENT = re.compile(r"^seg_(\d{8})\.wal$")
FSYNC_POLICIES = ("always", "batch", "never")
RETRY_FIRST_S = 0.25
RETRY_MAX_S = 5.0
RETRY_LIMIT_S = 600.0  # past this the disk is not coming back: the buffer stops (and its supervisor decides)


class WalCorruption(RuntimeError):
    """A record inside the log (not a torn tail) fails its checksum: durable data is damaged."""


class WriteAheadLog:
    def __init__(self, directory: str | Path, *, fsync: str = "batch", segment_bytes: int = 64 << 20,
                 retry_limit_s: float = RETRY_LIMIT_S) -> None:
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync must be one of {FSYNC_POLICIES}, not {fsync!r}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync
        self.segment_bytes = segment_bytes
        self.torn_tail_bytes = 0  # cut off the newest segment by the last replay
        self._file = None
        self._pending: list[tuple[bytes, ...]] = []  # appended (header, then the record's parts), not yet submitted
        self.bytes_written = 0
        self._submitted = 0  # the newest ticket handed to the writer
        self.durable = 0  # the newest ticket written (and fsynced, unless fsync=never)
        self._batches: queue.Queue[tuple[int, list[tuple[bytes, ...]]] | None] = queue.Queue()
        self._writer: threading.Thread | None = None  # started on the first submit
        self._error: BaseException | None = None
        self._written = threading.Condition()
        self.retry_limit_s = retry_limit_s
        self.write_retries = 0  # batches written again after the disk refused them
        self.failing_since: float | None = None  # monotonic time the disk first refused the batch being written
        self.last_error = ""  # the newest refusal, with the file it concerned
        self._closing = threading.Event()  # no more waiting for the disk: close() is giving up on it
        self._good_size = 0  # the open segment's size after its last complete write
        self._torn = False  # a failed attempt may have left part of a batch after _good_size
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)

    # ------------------------------------------------------------------ reading

    def segments(self) -> list[Path]:
        found = sorted((int(m.group(1)), p) for p in self.directory.iterdir() if (m := SEGMENT.match(p.name)))
        return [p for _, p in found]

    def replay(self) -> Iterator[bytes]:
        """Every record's payload, oldest first. Cuts a torn tail off the newest segment."""
        segments = self.segments()
        for index, path in enumerate(segments):
            newest = index == len(segments) - 1
            yield from self._read_segment(path, newest)

    def _read_segment(self, path: Path, newest: bool) -> Iterator[bytes]:
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            end = offset + HEADER.size
            if end <= len(data):
                length, crc = HEADER.unpack_from(data, offset)
                payload = data[end:end + length]
                if len(payload) == length and zlib.crc32(payload) == crc:
                    yield payload
                    offset = end + length
                    continue
            # A bad record: at the end of the newest segment it is a write the crash interrupted.
            if newest and self._only_garbage_follows(data, offset):
                self.torn_tail_bytes = len(data) - offset
                log.warning("write-ahead log %s: cutting a torn record (%d bytes) off its end", path.name,
                            self.torn_tail_bytes)
                with open(path, "r+b") as f:
                    f.truncate(offset)
                    os.fsync(f.fileno())
                return
            raise WalCorruption(f"write-ahead log {path}: the record at byte {offset} fails its checksum; the log "
                                "is damaged (move the directory away to start the buffer without it)")

    @staticmethod
    def _only_garbage_follows(data: bytes, offset: int) -> bool:
        """True when no complete, valid record starts after ``offset`` (so the bad record is the last write)."""
        length, _ = HEADER.unpack_from(data, offset) if offset + HEADER.size <= len(data) else (0, 0)
        return offset + HEADER.size + length >= len(data) or offset + HEADER.size > len(data)

    # ------------------------------------------------------------------ writing

    def append(self, payload: bytes | tuple[bytes, ...]) -> None:
        """Add one record (its bytes, or parts that are written one after the other); durable at once
        (fsync=always) or once a later :meth:`submit` is durable."""
        parts = payload if isinstance(payload, tuple) else (payload,)
        crc = 0
        for piece in parts:
            crc = zlib.crc32(piece, crc)
        # The header is made here, not on the writer thread: there each checksum would release and
        # retake the GIL, and retaking it waits for this (busy) thread.
        self._pending.append((HEADER.pack(sum(len(piece) for piece in parts), crc), *parts))
        if self.fsync == "always":
            self.sync()

    def submit(self) -> int:
        """Hand what was appended to the writer; the ticket it is durable under (``durable`` >= it)."""
        self.check()
        if self._pending:
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_forever, name="wal-writer", daemon=True)
                self._writer.start()
            self._submitted += 1
            self._batches.put((self._submitted, self._pending))
            self._pending = []
        return self._submitted

    def sync(self, timeout_s: float = 600.0) -> None:
        """Submit what was appended and wait until it is durable."""
        self.wait_durable(self.submit(), timeout_s)

    def wait_durable(self, ticket: int, timeout_s: float = 600.0) -> None:
        with self._written:
            if not self._written.wait_for(lambda: self.durable >= ticket or self._error is not None, timeout_s):
                raise TimeoutError(f"write-ahead log {self.directory}: not written within {timeout_s:.0f} s "
                                   "(a hung disk?)")
        self.check()

    def check(self) -> None:
        """Raise the writer's error, if it failed."""
        if self._error is not None:
            raise OSError(f"write-ahead log {self.directory}: writing failed: {self._error}") from self._error

    @property
    def wakeup_fd(self) -> int:
        """Readable after ``durable`` advanced; read it empty with :meth:`clear_wakeup`."""
        return self._wake_read

    def clear_wakeup(self) -> None:
        try:
            while os.read(self._wake_read, 4096):
                pass
        except BlockingIOError:
            pass

    def _write_forever(self) -> None:
        while True:
            item = self._batches.get()
            if item is None:
                return
            ticket, records = item
            try:  # whatever else was submitted meanwhile goes into the same write and fsync
                while True:
                    more = self._batches.get_nowait()
                    if more is None:
                        self._batches.put(None)
                        break
                    ticket, records = more[0], records + more[1]
            except queue.Empty:
                pass
            try:
                self._write_until_done(records)
            except BaseException as exc:  # noqa: BLE001 - kept for the caller's thread; nothing more is durable
                log.exception("write-ahead log %s: writing failed", self.directory)
                with self._written:
                    self._error = exc
                    self._written.notify_all()
                os.write(self._wake_write, b"!")
                return
            with self._written:
                self.durable = ticket
                self._written.notify_all()
            try:
                os.write(self._wake_write, b".")
            except BlockingIOError:
                pass  # the pipe is full of wake-ups already

    def _write_until_done(self, records: list[tuple[bytes, ...]]) -> None:
        """:meth:`_write`, again after a back-off while the disk refuses it (``DISK_ERRNOS``, ``retry_limit_s``)."""
        delay = RETRY_FIRST_S
        while True:
            try:
                self._write(records)
            except OSError as exc:
                self._torn = True
                now = time.monotonic()
                first = self.failing_since is None
                if first:
                    self.failing_since = now
                self.last_error = f"{self._segment_name()}: {type(exc).__name__}: {exc}"
                if (exc.errno not in DISK_ERRNOS or now - self.failing_since > self.retry_limit_s
                        or self._closing.is_set()):
                    raise
                if first:
                    log.warning("write-ahead log %s: the disk refuses the write (%s); nothing more is acknowledged "
                                "until it takes it: retrying for up to %.0f s", self.directory, self.last_error,
                                self.retry_limit_s)
                self.write_retries += 1
                self._closing.wait(delay)
                delay = min(2 * delay, RETRY_MAX_S)
                continue
            if self.failing_since is not None:
                log.warning("write-ahead log %s: written again after %.1f s and %d retries", self.directory,
                            time.monotonic() - self.failing_since, self.write_retries)
                self.failing_since = None
            return

    def _segment_name(self) -> str:
        return self._file.name if self._file is not None else str(self.directory)

    def _write(self, records: list[tuple[bytes, ...]]) -> None:
        """Write records (each its header, then its parts) and fsync; rotate a full segment. After a failed
        attempt the segment is first cut back to its last complete write (a retry never leaves half a batch)."""
        f = self._open_segment()
        if self._torn:
            os.ftruncate(f.fileno(), self._good_size)
            os.lseek(f.fileno(), 0, os.SEEK_END)
            self._torn = False
        # Headers and payload parts go to the kernel as they are (writev): no payload is copied in this process.
        parts = [piece for record in records for piece in record]
        for start in range(0, len(parts), IOV_MAX):
            _writev_all(f.fileno(), parts[start:start + IOV_MAX])
        written = sum(len(piece) for piece in parts)
        if self.fsync != "never":
            os.fsync(f.fileno())
        self.bytes_written += written
        self._good_size = os.lseek(f.fileno(), 0, os.SEEK_END)
        if self._good_size >= self.segment_bytes:
            self._close_file()

    def _open_segment(self):
        if self._file is None:
            segments = self.segments()
            number = int(SEGMENT.match(segments[-1].name).group(1)) + 1 if segments else 1
            path = self.directory / f"seg_{number:08d}.wal"
            file = open(path, "ab", buffering=0)  # written with os.writev
            try:
                self._fsync_directory()  # the new file's name is durable too
            except OSError:
                file.close()
                raise
            self._file, self._good_size, self._torn = file, 0, False
        return self._file

    def _close_file(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def close(self, timeout_s: float = 600.0) -> None:
        """Write what was appended, stop the writer, close the segment. A disk that still refuses the write
        ``timeout_s`` later is given up on (an error: what was not written was never acknowledged)."""
        try:
            try:
                self.sync(timeout_s)
            except TimeoutError:
                self._closing.set()  # the writer's next retry raises instead of waiting on
                raise
        finally:
            if self._writer is not None:
                self._batches.put(None)
                self._writer.join(timeout=60)
                self._writer = None
            self._close_file()
            for fd in (self._wake_read, self._wake_write):
                try:
                    os.close(fd)
                except OSError:
                    pass

    # ------------------------------------------------------------------ compaction

    def closed_segments(self) -> list[Path]:
        """Segments no longer appended to (all of them once :meth:`sync` rotated, else all but the newest)."""
        segments = self.segments()
        if self._file is not None and segments:
            return segments[:-1]
        return segments

    def rewrite_closed(self, transform: Callable[[bytes], bytes | None]) -> tuple[int, int]:
        """Pass every record of every closed segment through ``transform`` (None drops it); each
        rewritten segment atomically replaces the old one. Returns (bytes before, bytes after)."""
        self.sync()  # the writer is idle now (it waits for the next submit): the files are ours
        self._close_file()  # the current segment is closed too: the next append starts a new one
        before = after = 0
        for path in self.closed_segments():
            records = list(self._read_segment(path, newest=False))
            kept = [r for r in (transform(record) for record in records) if r is not None]
            tmp = path.with_suffix(".tmp")
            with _removed_on_failure(tmp), open(tmp, "wb") as f:
                for record in kept:
                    f.write(HEADER.pack(len(record), zlib.crc32(record)) + record)
                f.flush()
                os.fsync(f.fileno())
            before += path.stat().st_size
            after += tmp.stat().st_size
            os.replace(tmp, path)
        self._fsync_directory()
        return before, after

    def merge_closed(self) -> None:
        """Concatenate the closed segments into the first one (after compaction they are small)."""
        closed = self.closed_segments()
        if len(closed) < 2:
            return
        tmp = closed[0].with_suffix(".tmp")
        with _removed_on_failure(tmp), open(tmp, "wb") as out:
            for path in closed:
                out.write(path.read_bytes())
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, closed[0])
        for path in closed[1:]:
            path.unlink()
        self._fsync_directory()

    def size_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.segments())

    def _fsync_directory(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def _removed_on_failure(path: Path) -> Iterator[None]:
    """A temporary copy that could not be finished (a full disk) is removed, not left to fill the disk."""
    try:
        yield
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def _writev_all(fd: int, pieces: list[bytes]) -> None:
    """``os.writev`` until every byte is written (a regular file rarely takes less than asked)."""
    while pieces:
        done = os.writev(fd, pieces)
        while pieces and done >= len(pieces[0]):
            done -= len(pieces[0])
            pieces = pieces[1:]
        if pieces and done:
            pieces = [pieces[0][done:], *pieces[1:]]
