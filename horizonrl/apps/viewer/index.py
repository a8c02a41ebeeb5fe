"""The viewer's in-memory index of a record directory (core/episode_records.py), and its filters.

The index follows the files with :class:`EpisodeRecordReader`, so a refresh reads only the lines
appended since the last one: episodes appear while the run goes on. Episodes are numbered in the
order they were read (``seq``); "newest first" means the highest numbers first.

"Trained at step N" joins an episode's ``group_id`` with the last ``"trained"`` line naming it (a
batch handed out again after a learner restart gets a newer line, and the last one holds).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable, Mapping

from horizonrl.core.episode_records import EpisodeRecordReader

OUTCOMES = ("", "success", "failed")
KINDS = ("", "training", "evaluation")
# Failure filter values besides a failure kind itself.
FAILURE_NONE, FAILURE_ANY = "none", "any"


@dataclass
class Entry:
    """One recorded episode: its record line as read, and what the pages ask of it often."""

    seq: int
    key: str  # the episode's address in the viewer: its trajectory id, made unique
    record: dict[str, Any]

    @cached_property  # a record never changes once read
    def versions(self) -> tuple[int, int] | None:
        """The lowest and highest policy version that generated its turns (None: no turns)."""
        versions = [t.get("version") for t in self.record.get("turns", []) if isinstance(t.get("version"), int)]
        return (min(versions), max(versions)) if versions else None

    @property
    def task(self) -> tuple[str, Any]:
        return self.record.get("env", ""), self.record.get("task_id")

    def texts(self) -> Iterable[str]:
        """Everything the search box looks in."""
        r = self.record
        yield from (str(r.get(k) or "") for k in ("trajectory_id", "group_id", "env", "task_id", "category",
                                                   "failure", "failure_message", "first_observation"))
        for turn in r.get("turns", []):
            yield from (str(turn.get(k) or "") for k in ("reply", "action", "observation"))


def _int_or_none(text: str | None, name: str, errors: list[str]) -> int | None:
    if text is None or not str(text).strip():
        return None
    try:
        return int(str(text).strip())
    except ValueError:
        errors.append(f"{name} must be a whole number, not {text!r}")
        return None


@dataclass
class EpisodeFilter:
    """The list page's filters, as query parameters of the same names. Empty means "any"."""

    env: str = ""
    task: str = ""  # one task id of the environment(s)
    outcome: str = ""  # "", "success", "failed" (not successful, whatever the reason)
    failure: str = ""  # "", "none" (no failure), "any" (some failure), or one failure kind
    kind: str = ""  # "", "training", "evaluation"
    step_min: int | None = None  # the learner step that trained the episode
    step_max: int | None = None
    turns_min: int | None = None
    turns_max: int | None = None
    version_min: int | None = None  # the policy versions of its turns overlap [version_min, version_max]
    version_max: int | None = None
    q: str = ""  # words that must all appear in its texts (case-insensitive)
    errors: list[str] = field(default_factory=list, compare=False)

    NUMBERS = ("step_min", "step_max", "turns_min", "turns_max", "version_min", "version_max")
    TEXTS = ("env", "task", "outcome", "failure", "kind", "q")

    @classmethod
    def from_query(cls, query: Mapping[str, str]) -> "EpisodeFilter":
        errors: list[str] = []
        values: dict[str, Any] = {name: str(query.get(name, "")).strip() for name in cls.TEXTS}
        for name in cls.NUMBERS:
            values[name] = _int_or_none(query.get(name), name, errors)
        if values["outcome"] not in OUTCOMES:
            errors.append(f"outcome must be one of {', '.join(o for o in OUTCOMES if o)}")
            values["outcome"] = ""
        if values["kind"] not in KINDS:
            errors.append(f"kind must be one of {', '.join(k for k in KINDS if k)}")
            values["kind"] = ""
        return cls(**values, errors=errors)

    def query(self) -> dict[str, str]:
        """The filter as query parameters (only those set)."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "errors" and value not in (None, ""):
                out[f.name] = str(value)
        return out

    def matches(self, entry: Entry, trained_step: int | None) -> bool:
        r = entry.record
        if self.env and r.get("env") != self.env:
            return False
        if self.task and str(r.get("task_id")) != self.task:
            return False
        if self.outcome == "success" and not r.get("success"):
            return False
        if self.outcome == "failed" and r.get("success"):
            return False
        failure = r.get("failure") or ""
        if self.failure == FAILURE_NONE and failure:
            return False
        if self.failure == FAILURE_ANY and not failure:
            return False
        if self.failure not in ("", FAILURE_NONE, FAILURE_ANY) and failure != self.failure:
            return False
        if self.kind == "evaluation" and not r.get("evaluation"):
            return False
        if self.kind == "training" and r.get("evaluation"):
            return False
        if (self.step_min is not None or self.step_max is not None) and not _within(
                trained_step, self.step_min, self.step_max):
            return False
        if not _within(r.get("num_turns", 0), self.turns_min, self.turns_max):
            return False
        if self.version_min is not None or self.version_max is not None:
            versions = entry.versions
            if versions is None:
                return False
            low, high = versions
            if self.version_min is not None and high < self.version_min:
                return False
            if self.version_max is not None and low > self.version_max:
                return False
        if self.q:
            words = self.q.lower().split()
            text = "\n".join(entry.texts()).lower()
            if not all(w in text for w in words):
                return False
        return True


def _within(value: int | None, low: int | None, high: int | None) -> bool:
    if value is None:
        return low is None and high is None
    return (low is None or value >= low) and (high is None or value <= high)


class EpisodeIndex:
    """Every episode and "trained" line of a record directory, kept up to date by :meth:`refresh`."""

    def __init__(self, directory: str | Path, min_refresh_s: float = 0.5) -> None:
        self.directory = Path(directory)
        self.min_refresh_s = min_refresh_s
        self._reader = EpisodeRecordReader(self.directory)
        self._last_refresh = float("-inf")
        self.entries: list[Entry] = []
        self.by_key: dict[str, Entry] = {}
        self.by_task: dict[tuple[str, Any], list[Entry]] = {}
        self.group_step: dict[str, int] = {}  # group id -> the step of the last "trained" line naming it
        self.step_groups: dict[int, set[str]] = {}  # the same join, the other way round
        self.failure_kinds: set[str] = set()

    # ------------------------------------------------------------- reading
    def refresh(self, force: bool = False) -> int:
        """Read the lines appended since the last refresh; returns how many. Requests call it, so it
        reads at most every ``min_refresh_s`` unless forced."""
        now = time.monotonic()
        if not force and now - self._last_refresh < self.min_refresh_s:
            return 0
        self._last_refresh = now
        count = 0
        for record in self._reader.new_records():
            count += 1
            if record.get("kind") == "episode":
                self._add_episode(record)
            elif record.get("kind") == "trained":
                self._add_trained(int(record.get("learner_step", 0)), record.get("group_ids") or [])
        return count

    def _add_episode(self, record: dict[str, Any]) -> None:
        base = str(record.get("trajectory_id") or f"episode-{len(self.entries)}")
        key, n = base, 1
        while key in self.by_key:  # evaluations started in the same second share ids
            n += 1
            key = f"{base}~{n}"
        entry = Entry(seq=len(self.entries), key=key, record=record)
        self.entries.append(entry)
        self.by_key[key] = entry
        self.by_task.setdefault(entry.task, []).append(entry)
        if record.get("failure"):
            self.failure_kinds.add(record["failure"])

    def _add_trained(self, step: int, group_ids: list[str]) -> None:
        for group in group_ids:
            previous = self.group_step.get(group)
            if previous is not None:
                self.step_groups.get(previous, set()).discard(group)
            self.group_step[group] = step
            self.step_groups.setdefault(step, set()).add(group)

    # ------------------------------------------------------------- queries
    def trained_step(self, entry: Entry) -> int | None:
        return self.group_step.get(entry.record.get("group_id", ""))

    def select(self, flt: EpisodeFilter, after_seq: int = -1) -> list[Entry]:
        """Episodes matching ``flt`` (newer than ``after_seq``), newest first."""
        return [e for e in reversed(self.entries[after_seq + 1:]) if flt.matches(e, self.trained_step(e))]

    @property
    def latest_seq(self) -> int:
        return len(self.entries) - 1

    def env_names(self) -> list[str]:
        return sorted({e.record.get("env", "") for e in self.entries})

    def trained_at(self, step: int) -> list[Entry]:
        """The recorded episodes the learner trained on at ``step``, newest first."""
        groups = self.step_groups.get(step, set())
        return [e for e in reversed(self.entries) if e.record.get("group_id") in groups]

    def steps(self) -> list[int]:
        return sorted(s for s, groups in self.step_groups.items() if groups)

    def task_episodes(self, env: str, task_id: Any) -> list[Entry]:
        """The episodes of one task, from the oldest policy to the newest (then in recorded order)."""
        entries = self.by_task.get((env, task_id), [])
        return sorted(entries, key=lambda e: ((e.versions or (-1, -1))[0], e.seq))

    def early_and_late(self, env: str, task_id: Any) -> tuple[Entry, Entry] | None:
        """The episode of the task played earliest in training and the one played latest, by the policy
        versions of their turns; None unless there are two whose versions differ (the episodes of
        one group, played by the same weights, compare nothing)."""
        entries = [e for e in self.task_episodes(env, task_id) if e.versions is not None]
        if len(entries) < 2:
            return None
        early = min(entries, key=lambda e: (e.versions, e.seq))
        late = max(entries, key=lambda e: (e.versions[1], e.versions[0], e.seq))
        return (early, late) if late.versions != early.versions else None

    def tasks_seen_at_several_versions(self) -> list[tuple[tuple[str, Any], tuple[Entry, Entry]]]:
        """Tasks with an early and a late episode (:meth:`early_and_late`), the widest span of
        versions between the two first."""
        out = []
        for env, task_id in self.by_task:
            pair = self.early_and_late(env, task_id)
            if pair is not None:
                out.append(((env, task_id), pair))

        def order(item: tuple[tuple[str, Any], tuple[Entry, Entry]]) -> tuple:
            (env, task_id), (early, late) = item
            return (-(late.versions[1] - early.versions[0]), -(late.versions[0] - early.versions[0]), env,
                    str(task_id))

        return sorted(out, key=order)
