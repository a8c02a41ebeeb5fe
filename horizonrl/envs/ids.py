"""AgentGym-RL-style dataset id files: JSON lists of rows like ``{"item_id": "babyai_12"}``.

``read_ids`` accepts a JSON list of such rows, a JSON list of ``"babyai_12"`` strings, or JSONL
with one row per line; it returns ``(env name, index)`` pairs. ``write_split_files`` writes
``<env>_train.json`` and ``<env>_test.json`` from an environment's own splits.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from horizonrl.envs.base import Environment

_ID = re.compile(r"^([A-Za-z][A-Za-z0-9]*)_(\d+)$")


def parse_item_id(item_id: str) -> tuple[str, int]:
    match = _ID.match(item_id.strip())
    if not match:
        raise ValueError(f"not an id of the form <env>_<index>: {item_id!r}")
    return match.group(1), int(match.group(2))


def read_ids(path: str | Path) -> list[tuple[str, int]]:
    text = Path(path).read_text(encoding="utf-8").strip()
    rows = json.loads(text) if text.startswith("[") else [json.loads(line) for line in text.splitlines() if line]
    return [parse_item_id(row if isinstance(row, str) else row["item_id"]) for row in rows]


def write_split_files(env: Environment, out_dir: str | Path, name: str | None = None) -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = name or env.name
    paths = {}
    for split in ("train", "test"):
        path = out / f"{name}_{split}.json"
        path.write_text(json.dumps([{"item_id": f"{name}_{i}"} for i in env.task_ids(split)]) + "\n")
        paths[split] = path
    return paths
