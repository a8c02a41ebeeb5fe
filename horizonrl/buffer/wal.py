"""The buffer's write-ahead log: append-only segment files of checksummed records.

Layout: ``<dir>/seg_00000001.wal``, ``seg_00000002.wal``, ... Each record is

    u32 length | u32 crc32(payload) | payload (length bytes)          (little-endian)

and a segment is closed once it exceeds ``segment_bytes``; records are only ever appended to the
newest one. What a record means is the caller's business (``buffer/records.py``).

Durability (``fsync``): ``always`` — each :meth:`append` is on disk before it returns;
``batch`` — :meth:`sync` (called once per batch of appends, before their acknowledgements go
out) writes and fsyncs them together (group commit); ``never`` — records reach the OS at
:meth:`sync` and the disk when the OS decides (a machine crash can lose the newest ones, a
process crash cannot).

Recovery (:meth:`replay`): a crash can leave the newest segment with a torn last record; it is cut
off (and counted). A checksum mismatch anywhere else is corruption of durable data: a clear
error, never a silent skip.

Compaction (:meth:`rewrite_closed`): the caller rewrites each closed segment through a function
that keeps, shrinks or drops records; the rewritten segment replaces the old one atomically
(write to a temporary file, fsync, rename).
"""

from __future__ import annotations

import logging
import os
import re
import struct
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

log = logging.getLogger("horizonrl.buffer.wal")

HEADER = struct.Struct("<II")
SEGMENT = re.compile(r"^seg_(\d{8})\.wal$")
FSYNC_POLICIES = ("always", "batch", "never")


class WalCorruption(RuntimeError):
    """A record inside the log (not a torn tail) fails its checksum: durable data is damaged."""


class WriteAheadLog:
    def __init__(self, directory: str | Path, *, fsync: str = "batch", segment_bytes: int = 64 << 20) -> None:
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync must be one of {FSYNC_POLICIES}, not {fsync!r}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync
        self.segment_bytes = segment_bytes
        self.torn_tail_bytes = 0  # cut off the newest segment by the last replay
        self._file = None
        self._pending: list[bytes] = []  # appended, not yet written (fsync=batch/never)
        self.bytes_written = 0

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

    def append(self, payload: bytes) -> None:
        """Add one record; durable at once (fsync=always) or at the next :meth:`sync`."""
        self._pending.append(HEADER.pack(len(payload), zlib.crc32(payload)) + payload)
        if self.fsync == "always":
            self.sync()

    def sync(self) -> None:
        """Write what was appended (and fsync it unless fsync=never); rotate a full segment."""
        if not self._pending:
            return
        f = self._writer()
        data = b"".join(self._pending)
        self._pending.clear()
        f.write(data)
        f.flush()
        if self.fsync != "never":
            os.fsync(f.fileno())
        self.bytes_written += len(data)
        if f.tell() >= self.segment_bytes:
            self._close_file()

    def _writer(self):
        if self._file is None:
            segments = self.segments()
            number = int(SEGMENT.match(segments[-1].name).group(1)) + 1 if segments else 1
            path = self.directory / f"seg_{number:08d}.wal"
            self._file = open(path, "ab")
            self._fsync_directory()  # the new file's name is durable too
        return self._file

    def _close_file(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def close(self) -> None:
        self.sync()
        self._close_file()

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
        self.sync()
        self._close_file()  # the current segment is closed too: the next append starts a new one
        before = after = 0
        for path in self.closed_segments():
            records = list(self._read_segment(path, newest=False))
            kept = [r for r in (transform(record) for record in records) if r is not None]
            tmp = path.with_suffix(".tmp")
            with open(tmp, "wb") as f:
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
        with open(tmp, "wb") as out:
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
