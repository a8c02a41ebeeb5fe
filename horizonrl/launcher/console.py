"""What the person who started a run sees on the terminal: the run's status, and a line for anything wrong.

The coordinator knows the scalars of each learner step; it writes one status record per step to its
stdout (``protocol/status.py``). The launcher owns the terminal: it turns each record into

- on a terminal, one live block of a few lines redrawn in place (step / total with ETA, reward,
  success, turn budget, staleness, tokens/s, buffer depth, faults), refreshed every second;
- anywhere else (a pipe, a CI log, a file), one plain line per learner step that starts with
  ``step N/TOTAL |`` and holds no cursor codes, so that the output reads like a log and can be grepped.

Of everything else the run's processes write (all of it goes to ``<output_dir>/logs/``) only what says
something is wrong reaches the console, one line each: warnings and errors of horizonrl's own loggers,
vLLM's errors, the last line of a Python traceback, a command's ``error:``. ``--verbose`` shows every
line instead (and plain progress lines: a block redrawn under a flood of lines would only flicker).
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import threading
import time
from collections import deque
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator, Mapping

from horizonrl.protocol.status import BUFFER_CAPACITY, BUFFER_GROUPS, StepStatus, parse_status_line

REFRESH_S = 1.0  # the live block's clock (elapsed, ETA) moves this often between steps
ETA_WINDOW_STEPS = 10  # the ETA extrapolates the pace of the last this many steps
BAR_WIDTH = 24
MIN_WIDTH = 40

# A record of horizonrl's logging format (core/runtime.py setup_logging): "12:00:00 actor-0[123] WARNING name: text".
_OWN_RECORD = re.compile(r"^(\d\d:\d\d:\d\d) \S+\[\d+\] (DEBUG|INFO|WARNING|ERROR|CRITICAL) (\S+): (.*)$")
# vLLM's own format, with or without its process prefix: "(EngineCore pid=7) WARNING 11-25 03:36:29 [f.py:1] text".
_VLLM_RECORD = re.compile(r"^(?:\([^)]*\) )?(DEBUG|INFO|WARNING|ERROR|CRITICAL) "
                          r"\d\d-\d\d \d\d:\d\d:\d\d \[[^\]]*\] (.*)$")
# The last line of a Python traceback: "ValueError: ...", "torch.distributed.DistBackendError: ...".
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)(: .*)?$")
_CONTROL = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|[\x00-\x08\x0b-\x1f\x7f]")
_SHOWN_LEVELS = ("WARNING", "ERROR", "CRITICAL")


# ---------------------------------------------------------------------------------------------- rendering


def format_duration(seconds: float | None) -> str:
    """``None`` -> "-"; 42 -> "42s"; 754 -> "12m34s"; 3725 -> "1h02m"."""
    if seconds is None or seconds != seconds or seconds < 0:
        return "-"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _value(scalars: Mapping[str, float], key: str, fmt: str = "{:.2f}") -> str:
    return fmt.format(scalars[key]) if key in scalars else "-"


def _success(scalars: Mapping[str, float]) -> str:
    """The actors' success rate over every finished episode; the batch's when the actors finished none."""
    return _value(scalars, "rollout/success_rate" if "rollout/success_rate" in scalars else "batch/success_mean")


def _buffer(scalars: Mapping[str, float]) -> str:
    if BUFFER_GROUPS not in scalars:
        return "-"
    capacity = f"/{scalars[BUFFER_CAPACITY]:.0f}" if BUFFER_CAPACITY in scalars else ""
    return f"{scalars[BUFFER_GROUPS]:.0f}{capacity}"


def _turn_budget(scalars: Mapping[str, float]) -> str:
    budget = _value(scalars, "schedule/max_turns", "{:.0f}")
    nxt = scalars.get("schedule/next_max_turns")
    if nxt is not None and "schedule/max_turns" in scalars and nxt != scalars["schedule/max_turns"]:
        budget += f" (next {nxt:.0f})"
    return budget


def fault_summary(scalars: Mapping[str, float]) -> str:
    """The run's faults so far in a few words, "none" when there were none: supervision's events by role
    (``faults/<role>_<event>``) and the episodes that failed, by kind (never trained on; ``actor_lost``:
    played by an actor that died)."""
    events: dict[str, list[str]] = {}
    for key in sorted(k for k in scalars if k.startswith("faults/") and scalars[k]):
        role, _, event = key.removeprefix("faults/").partition("_")
        if "/" not in event and role != "episodes":  # not recovery_s/<role>; episodes_lost is actor_lost below
            events.setdefault(role, []).append(f"{event.replace('_', ' ')} {scalars[key]:.0f}")
    parts = [f"{role} {', '.join(what)}" for role, what in events.items()]
    failures = [f"{key.rsplit('/', 1)[1].replace('_', ' ')} {scalars[key]:.0f}" for key in sorted(scalars)
                if key.startswith("rollout/failures/") and scalars[key]]
    if failures:
        parts.append("failed episodes: " + ", ".join(failures))
    return "; ".join(parts) if parts else "none"


def _fault_count(scalars: Mapping[str, float]) -> float:
    return sum(v for k, v in scalars.items() if k.startswith("faults/") and k.endswith("_died"))


def progress_line(status: StepStatus, *, eta_s: float | None = None) -> str:
    """One plain line for a learner step (no cursor codes): it starts with ``step N/TOTAL |``."""
    s = status.scalars
    in_flight = (f" | in flight {_value(s, 'rollout/groups_in_flight', '{:.0f}')} (KV "
                 f"{_value(s, 'rollout/kv_cache_usage', '{:.0%}')})" if "rollout/groups_in_flight" in s else "")
    return (
        f"step {status.step}/{status.total} | reward {_value(s, 'batch/reward_mean')} | success {_success(s)}"
        f" | turns {_value(s, 'batch/turns_mean', '{:.1f}')} | max_turns {_value(s, 'schedule/max_turns', '{:.0f}')}"
        f" | staleness {_value(s, 'batch/staleness_mean')}"
        f" | rollout {_value(s, 'rollout/tokens_per_s', '{:.0f}')} tok/s"
        f" | learner {_value(s, 'throughput/learner_tokens_per_s', '{:.0f}')} tok/s | step {_value(s, 'time/step_s')} s"
        f" | buffer {_buffer(s)} | dropped {_value(s, 'buffer/dropped_total', '{:.0f}')}{in_flight}"
        f" | died {_fault_count(s):.0f} | eta {format_duration(eta_s)}"
    )


def status_lines(status: StepStatus, *, title: str, phase: str, elapsed_s: float, eta_s: float | None,
                 width: int = 100) -> list[str]:
    """The live block: four lines (five with the actors' groups in flight), none longer than ``width`` (a
    wrapped line would break the redraw)."""
    s = status.scalars
    done = min(1.0, status.step / status.total) if status.total > 0 else 0.0
    filled = int(done * BAR_WIDTH)
    bar = "#" * filled + "-" * (BAR_WIDTH - filled)
    lines = [
        f"{title} | {phase} | step {status.step}/{status.total} [{bar}] {done:4.0%} | elapsed "
        f"{format_duration(elapsed_s)} | ETA {format_duration(eta_s)}",
        f"  reward {_value(s, 'batch/reward_mean')} | success {_success(s)} | turns "
        f"{_value(s, 'batch/turns_mean', '{:.1f}')} of budget {_turn_budget(s)} | staleness "
        f"{_value(s, 'batch/staleness_mean')}",
        f"  tokens/s rollout {_value(s, 'rollout/tokens_per_s', '{:,.0f}')} learner "
        f"{_value(s, 'throughput/learner_tokens_per_s', '{:,.0f}')} | step {_value(s, 'time/step_s', '{:.1f}')} s | "
        f"buffer {_buffer(s)} groups, dropped {_value(s, 'buffer/dropped_total', '{:.0f}')}",
        f"  faults: {fault_summary(s)}",
    ]
    if "rollout/groups_in_flight" in s:  # the actors' concurrency (rollout.concurrency), before the faults
        lines.insert(3, f"  in flight {_value(s, 'rollout/groups_in_flight', '{:.0f}')} groups | KV cache "
                        f"{_value(s, 'rollout/kv_cache_usage', '{:.0%}')} | preempted "
                        f"{_value(s, 'rollout/engine_preemptions', '{:.0f}')}")
    width = max(MIN_WIDTH, width)
    return [line if len(line) <= width else line[:width - 3] + "..." for line in lines]


def shown_line(name: str, line: str, *, verbose: bool = False) -> str | None:
    """What the console shows of one line a process ``name`` wrote, or None: with ``verbose`` every line,
    otherwise only one that says something is wrong (see the module's docstring)."""
    line = _CONTROL.sub("", line).rstrip()
    if not line.strip():
        return None
    if verbose:
        return f"[{name}] {line}"
    own = _OWN_RECORD.match(line)
    if own is not None:
        clock, level, logger, text = own.groups()
        if level in _SHOWN_LEVELS and not logger.startswith("vllm"):
            return f"{clock} [{name}] {level} {text}"
        return None
    vllm = _VLLM_RECORD.match(line)
    if vllm is not None:
        level, text = vllm.groups()
        return f"{time.strftime('%H:%M:%S')} [{name}] vLLM {level} {text}" if level in ("ERROR", "CRITICAL") else None
    if _EXCEPTION.match(line) or line.startswith("error: "):
        return f"{time.strftime('%H:%M:%S')} [{name}] {line}"
    return None


# ---------------------------------------------------------------------------------------------- the console


class StepPace:
    """The ETA: the mean time per learner step over the last ``window`` steps, times the steps left. A step
    number that does not grow (a learner restarted from its checkpoint) starts the measurement again."""

    def __init__(self, window: int = ETA_WINDOW_STEPS) -> None:
        self._seen: deque[tuple[int, float]] = deque(maxlen=window + 1)

    def add(self, step: int, at: float) -> None:
        if self._seen and step <= self._seen[-1][0]:
            self._seen.clear()
        self._seen.append((step, at))

    def eta_s(self, total: int, now: float) -> float | None:
        if len(self._seen) < 2:
            return None
        (first_step, first_at), (last_step, last_at) = self._seen[0], self._seen[-1]
        per_step = (last_at - first_at) / (last_step - first_step)
        return max(0.0, per_step * (total - last_step) - (now - last_at))


class RunConsole:
    """The launcher's terminal: ``status`` for each status record, ``line`` for a line that stays (something
    wrong, a notice), ``tick`` from the launcher's watch loop; thread-safe (each child's output is read
    on its own thread). Live (a block redrawn in place) on a terminal, plain lines elsewhere."""

    def __init__(self, stream: IO[str], *, title: str, total: int, live: bool,
                 clock=time.monotonic) -> None:
        self.stream, self.title, self.live, self.clock = stream, title, live, clock
        self.phase = "starting"
        self.latest = StepStatus(0, total)
        self.pace = StepPace()
        self._started = self._drawn_at = clock()
        self._drawn_lines = 0
        self._lock = threading.Lock()

    @classmethod
    def for_stdout(cls, *, title: str, total: int, verbose: bool) -> "RunConsole":
        terminal = sys.stdout.isatty() and os.environ.get("TERM", "") != "dumb"  # dumb: no cursor movement
        return cls(sys.stdout, title=title, total=total, live=terminal and not verbose)

    def status(self, status: StepStatus) -> None:
        with self._lock:
            now = self.clock()
            if status.startup:
                # A restarted learner: the last step's scalars (its faults above all) stay until the next step.
                status = StepStatus(status.step, status.total, {**self.latest.scalars, **status.scalars}, True)
            else:
                self.pace.add(status.step, now)
                self.phase = "training" if self.phase == "starting" else self.phase
            self.latest = status
            if self.live:
                self._draw()
            elif not status.startup:
                self._write(progress_line(status, eta_s=self.pace.eta_s(status.total, now)) + "\n")

    def line(self, text: str) -> None:
        with self._lock:
            if self.live:
                self._write(self._erase() + text + "\n")
                self._drawn_lines = 0
                self._draw()
            else:
                self._write(text + "\n")

    def tick(self) -> None:
        with self._lock:
            if self.live and self.clock() - self._drawn_at >= REFRESH_S:
                self._draw()

    def set_phase(self, phase: str) -> None:
        with self._lock:
            self.phase = phase
            if self.live:
                self._draw()

    def close(self, phase: str) -> None:
        """Draw the block a last time and leave it on the screen; what is printed next goes below it."""
        self.set_phase(phase)
        with self._lock:
            self._drawn_lines, self.live = 0, False

    def lines(self) -> list[str]:
        now = self.clock()
        width = shutil.get_terminal_size((100, 24)).columns - 1
        return status_lines(self.latest, title=self.title, phase=self.phase, elapsed_s=now - self._started,
                            eta_s=self.pace.eta_s(self.latest.total, now), width=width)

    def _draw(self) -> None:
        block = self.lines()
        self._write(self._erase() + "\n".join(block) + "\n")
        self._drawn_lines, self._drawn_at = len(block), self.clock()

    def _erase(self) -> str:
        """Cursor up to the block's first line, then clear to the end of the screen."""
        return f"\x1b[{self._drawn_lines}A\r\x1b[J" if self._drawn_lines else ""

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):
            pass  # a closed terminal must not stop the run


@contextmanager
def output_to_file(path: Path) -> Iterator[None]:
    """Send everything this process and the processes it starts meanwhile write to stdout and stderr into
    ``path`` (at the file-descriptor level: vLLM's engine processes and C++ libraries included), then
    restore the terminal."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(path, "ab") as target:
        os.dup2(target.fileno(), 1)
        os.dup2(target.fileno(), 2)
        try:
            yield
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


def route_line(console: RunConsole, name: str, line: str, *, verbose: bool) -> None:
    """One line process ``name`` wrote: the coordinator's status records feed the console's status; of the rest
    the console shows what says something is wrong (all of it with ``verbose``)."""
    status = parse_status_line(line) if name == "coordinator" else None
    if status is not None:
        console.status(status)
        return
    text = shown_line(name, line, verbose=verbose)
    if text is not None:
        console.line(text)
