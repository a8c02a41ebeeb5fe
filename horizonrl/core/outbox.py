"""The file format of an actor's outbox (``RunDir.outbox``): written by the actor (actors/delivery.py), read
by the actor that restarts and by ``horizonrl accounting`` (buffer/accounting.py), all through this module.

An outbox is a sequence of segment files ``outbox_<n>.bin`` of length-prefixed encoded trajectories
(a little-endian uint32 length, then the msgpack of a ``Trajectory``), each with ``outbox_<n>.acked``
listing the ids the buffer has acknowledged so far, one per line. Appends are not fsync'ed, so a crash
can leave the last entry torn: reading stops there (that trajectory was never sent). An entry that does
not decode — another run's, or damaged — is skipped and reported; the entries after it are read.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

from horizonrl.protocol import ProtocolError, Trajectory, decode_as

_LENGTH = struct.Struct("<I")
_SEGMENT = re.compile(r"^outbox_(\d{8})\.bin$")


def segment_path(outbox_dir: Path, number: int) -> Path:
    return Path(outbox_dir) / f"outbox_{number:08d}.bin"


def acked_path(outbox_dir: Path, number: int) -> Path:
    return Path(outbox_dir) / f"outbox_{number:08d}.acked"


def framed(data: bytes) -> bytes:
    """One entry as it is appended to a segment."""
    return _LENGTH.pack(len(data)) + data


def segments(outbox_dir: Path) -> list[tuple[int, Path]]:
    """The outbox's segment files, by number, oldest first."""
    outbox_dir = Path(outbox_dir)
    if not outbox_dir.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in outbox_dir.iterdir() if (m := _SEGMENT.match(p.name)))


@dataclass
class Segment:
    """What one segment holds that the buffer has not acknowledged: each entry's encoded bytes (resent as
    they are) and its trajectory; ``undecodable`` says why each skipped entry was skipped."""

    number: int
    path: Path
    unacked: list[tuple[bytes, Trajectory]] = field(default_factory=list)
    undecodable: list[str] = field(default_factory=list)


def read_segment(number: int, path: Path, run_id: str | None = None) -> Segment:
    """Read one segment; with ``run_id`` an entry of another run counts as undecodable."""
    acked_file = acked_path(path.parent, number)
    acked = set(acked_file.read_text().split()) if acked_file.is_file() else set()
    data = path.read_bytes()
    segment = Segment(number, path)
    offset = 0
    while offset + _LENGTH.size <= len(data):
        (length,) = _LENGTH.unpack_from(data, offset)
        payload = data[offset + _LENGTH.size: offset + _LENGTH.size + length]
        if len(payload) < length:
            break  # a torn last append: that trajectory was never sent
        offset += _LENGTH.size + length
        try:
            trajectory = decode_as(payload, Trajectory, run_id=run_id)
        except ProtocolError as exc:
            segment.undecodable.append(str(exc))
            continue
        if trajectory.trajectory_id not in acked:
            segment.unacked.append((payload, trajectory))
    return segment


def read_outbox(outbox_dir: Path, run_id: str | None = None) -> list[Segment]:
    """Every segment of one outbox, oldest first."""
    return [read_segment(number, path, run_id) for number, path in segments(outbox_dir)]
