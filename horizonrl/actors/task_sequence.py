"""Which task each of an actor's groups plays: a pure function of (run seed, actor, group number).

The state is one number — the next group — kept in ``<output_dir>/actors/actor_<i>.json`` and
written (atomically) before a group starts. A restarted actor, or a whole run resumed from a
checkpoint, continues its sequence where it left off instead of replaying the same tasks from the
start; a group number is never used twice, so group and trajectory ids stay unique in the run.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

from horizonrl.core.config import EnvSpec


@dataclass(frozen=True)
class GroupTask:
    number: int  # the actor's n-th group
    env: EnvSpec
    task_id: int


class TaskSequence:
    def __init__(self, state_file: Path, seed: int, actor: int, envs: list[EnvSpec],
                 train_ids: dict[str, list[int]]) -> None:
        self.state_file = Path(state_file)
        self.seed, self.actor = seed, actor
        self.envs = envs
        self.train_ids = train_ids
        self.next_group = self._load()

    def _load(self) -> int:
        if not self.state_file.is_file():
            return 0
        return int(json.loads(self.state_file.read_text())["next_group"])

    def task_of(self, number: int) -> GroupTask:
        """The task of group ``number`` (the same on every machine and after every restart)."""
        rng = random.Random(f"{self.seed}:{self.actor}:{number}")
        spec = rng.choices(self.envs, weights=[s.weight for s in self.envs])[0]
        return GroupTask(number, spec, rng.choice(self.train_ids[spec.name]))

    def next(self) -> GroupTask:
        """The next group's task; the sequence position is on disk before it is handed out."""
        number = self.next_group
        self.next_group += 1
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"next_group": self.next_group, "seed": self.seed, "actor": self.actor}))
        os.replace(tmp, self.state_file)
        return self.task_of(number)
