"""WebArena task files: loading, site placeholders, storage states.

A task is WebArena's JSON object (``task_id``, ``sites``, ``require_login``, ``storage_state``,
``start_url`` with ``__SHOPPING__``-style placeholders, ``intent``, ``eval``). A task source is
one JSON file holding a list (WebArena's ``test.raw.json``, this package's ``local_tasks.json``)
or one object, or a directory of such files (WebArena's ``config_files/*.json``). Environment task
ids are positions in the list sorted by ``task_id``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DATA_DIR = Path(__file__).resolve().parent / "data"
LOCAL_TASKS = DATA_DIR / "local_tasks.json"
LOCAL_EXPERT = DATA_DIR / "local_expert.json"

# WebArena's site names and the placeholders its task files use for their base URLs.
PLACEHOLDERS = {"shopping": "__SHOPPING__", "shopping_admin": "__SHOPPING_ADMIN__", "reddit": "__REDDIT__",
                "gitlab": "__GITLAB__", "wikipedia": "__WIKIPEDIA__", "map": "__MAP__", "homepage": "__HOMEPAGE__"}


def load_tasks(source: str | Path) -> list[dict[str, Any]]:
    """Every task of ``source`` (file or directory), sorted by ``task_id``; raises on a bad file."""
    path = Path(source).expanduser()
    if not path.exists():
        raise ValueError(f"WebArena task source {str(path)!r} does not exist")
    files = sorted(path.glob("*.json")) if path.is_dir() else [path]
    tasks: list[dict[str, Any]] = []
    for file in files:
        data = json.loads(file.read_text())
        items = data if isinstance(data, list) else [data]
        for task in items:
            missing = [k for k in ("task_id", "sites", "start_url", "intent", "eval") if k not in task]
            if missing:
                raise ValueError(f"{file}: a task lacks {missing}")
            tasks.append(task)
    if not tasks:
        raise ValueError(f"no WebArena tasks in {str(path)!r}")
    tasks.sort(key=lambda t: t["task_id"])
    ids = [t["task_id"] for t in tasks]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: task_id values repeat")
    return tasks


def fill_placeholders(text: str, urls: dict[str, str]) -> str:
    """``__SHOPPING__/cart`` -> ``http://host:port/cart`` for every configured site."""
    for site, placeholder in PLACEHOLDERS.items():
        if placeholder in text and site in urls:
            text = text.replace(placeholder, urls[site].rstrip("/"))
    return text


def unfilled_placeholders(text: str) -> list[str]:
    return [p for p in PLACEHOLDERS.values() if p in text]


def storage_state_path(task: dict[str, Any], auth_dir: str | Path | None,
                       storage_states: dict[str, str] | None = None) -> Path | None:
    """The storage-state file a task logs in with, or None.

    ``storage_states`` maps a site to a file and wins; otherwise WebArena's relative path
    (``./.auth/shopping_state.json``) is looked up by file name in ``auth_dir``.
    """
    state = task.get("storage_state")
    if not state:
        return None
    for site in task.get("sites", []):
        if storage_states and site in storage_states:
            return Path(storage_states[site]).expanduser()
    if auth_dir is None:
        raise ValueError(f"task {task['task_id']} logs in with {state!r}: set auth_dir or storage_states")
    return Path(auth_dir).expanduser() / Path(state).name


def task_category(task: dict[str, Any]) -> str:
    """``<sites>/<kind>``: kind is info (string_match), navigation (url_match) or state (program_html)."""
    types = task["eval"].get("eval_types", [])
    kind = "state" if "program_html" in types else "info" if "string_match" in types else "navigation"
    return f"{'+'.join(task.get('sites', [])) or 'none'}/{kind}"


def needs_judge(task: dict[str, Any]) -> bool:
    answers = (task["eval"].get("reference_answers") or {})
    return "string_match" in task["eval"].get("eval_types", []) and "fuzzy_match" in answers
