"""When a write fails because of the disk, not because of us (bottom layer: no torch).

A full disk, a read-only remount or a failing device is a fault of the machine: the writes a run cannot do
without (the buffer's write-ahead log, a checkpoint) wait for it and try again (:class:`Backoff`), the ones
written for people (episode records, TensorBoard) drop what it refuses and count it. Every other error of a
write is ours: it is raised.
"""

from __future__ import annotations

import errno
import time
from dataclasses import dataclass, field

# ENOSPC/EDQUOT: full; EROFS/EACCES/EPERM: not writable now (a remount, a changed mode); EIO: the device.
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO})


def is_disk_refusal(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in DISK_ERRNOS


def refusal_text(exc: BaseException) -> str:
    """What the disk refused, naming the file where the error knows it (an OSError of a write often does not)."""
    filename = getattr(exc, "filename", None)
    return f"{type(exc).__name__}: {exc}" if filename is None or str(filename) in str(exc) else (
        f"{filename}: {type(exc).__name__}: {exc}")


@dataclass
class Backoff:
    """Waits between tries of a write the disk refuses: ``first_s``, doubling up to ``max_s``, for at most
    ``limit_s`` from the first refusal (then :meth:`failed` says give up)."""

    first_s: float = 0.25
    max_s: float = 5.0
    limit_s: float = 600.0
    since: float | None = None  # monotonic time of the first refusal of this outage
    retries: int = 0
    _next_s: float = field(default=0.0, repr=False)

    def failed(self) -> tuple[bool, float]:
        """A refusal: (whether to try again, how long to wait first)."""
        now = time.monotonic()
        if self.since is None:
            self.since, self._next_s = now, self.first_s
        if now - self.since > self.limit_s:
            return False, 0.0
        wait, self._next_s = self._next_s, min(2 * self._next_s, self.max_s)
        self.retries += 1
        return True, wait

    def succeeded(self) -> float | None:
        """The write went through: the outage's length (None: there was none)."""
        if self.since is None:
            return None
        outage, self.since = time.monotonic() - self.since, None
        return outage
