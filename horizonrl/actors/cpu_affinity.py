"""Where the processes an actor starts run: its vLLM engine's processes on the engine's cores
(``resources.engine_cpus``, ``core/placement.py`` says which), the actor's own threads where they were."""

from __future__ import annotations

import contextlib
import os
from typing import Sequence


@contextlib.contextmanager
def starting_on_cpus(cpus: Sequence[int] | None):
    """Processes started inside run on ``cpus``; afterwards every thread of this process is back on this
    thread's own cores. (A new process or thread inherits the affinity of the thread that starts it: this
    thread holds ``cpus`` meanwhile, and threads started then — ZeroMQ's I/O threads of a vLLM client — are
    put back.)"""
    own = os.sched_getaffinity(0)
    if cpus is None:
        yield
        return
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(tid), own)
            except ProcessLookupError:
                pass  # a thread that has ended meanwhile
