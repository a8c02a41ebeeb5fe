"""What an episode's record does not hold, rebuilt by playing it again.

BabyAI and TextCraft are deterministic given the task id and the replies, so a fresh environment
fed the recorded replies passes through the same states: BabyAI's grid is drawn at each of them
(PNG frames), TextCraft's inventory is read at each. Position 0 is the state after ``reset``,
position k the state after turn k.

The settings the episode ran with are not in the record. The candidates, tried in order, are those
given on the command line, then the run's ``config.yaml`` (its ``envs`` entries of that name), then
the environment's defaults; the first whose ``reset`` gives the recorded first observation is used.
Every later observation is checked against the record too: where the replay stops reproducing the
record (other settings, another version of the environment's code, a reply cut to
``MAX_SAMPLE_TEXT``), it stops, and the page says so rather than drawing a state that never was.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from horizonrl.envs import make_env
from horizonrl.protocol import MAX_SAMPLE_TEXT
from horizonrl.core.run_dirs import RunDir

log = logging.getLogger("horizonrl.apps.viewer")

REPLAYED_ENVS = frozenset({"babyai", "textcraft"})
MAX_FRAME_PIXELS = 640  # the longer side of a BabyAI frame; tiles shrink for big levels


@dataclass
class Replay:
    """The states of one episode played again: ``frames[k]`` (PNG) / ``inventories[k]`` at position k,
    for the positions that reproduced the record (``reproduced`` of them)."""

    frames: list[bytes] = field(default_factory=list)
    inventories: list[dict[str, int]] = field(default_factory=list)
    reproduced: int = 0
    settings: dict[str, Any] | None = None
    problem: str = ""  # why some or all positions could not be rebuilt ("" when all were)


def run_env_settings(run_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """Environment name -> the settings of each of the run's ``envs`` entries, from config.yaml.

    Read as plain YAML rather than validated: a viewer should open an old run whose config a newer
    schema would reject, and it needs only the environments."""
    path = RunDir(run_dir).config
    if not path.is_file():
        return {}
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        log.warning("cannot read %s (%s); replays use the environments' defaults", path, exc)
        return {}
    out: dict[str, list[dict[str, Any]]] = {}
    for spec in data.get("envs") or []:
        if isinstance(spec, dict) and spec.get("name"):
            out.setdefault(spec["name"], []).append(dict(spec.get("settings") or {}))
    return out


def parse_env_settings(items: list[str]) -> dict[str, dict[str, Any]]:
    """``["babyai={...}", ...]`` (the command's ``--env-settings``) -> name -> settings."""
    out = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"--env-settings {item!r} is not of the form NAME=JSON")
        try:
            settings = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"--env-settings {item!r}: not JSON ({exc})") from None
        if not isinstance(settings, dict):
            raise ValueError(f"--env-settings {item!r}: the JSON must be an object")
        out[name.strip()] = settings
    return out


def _same_text(replayed: str, recorded: str | None) -> bool:
    return recorded is not None and replayed[:MAX_SAMPLE_TEXT] == recorded


class Replayer:
    """Replays episodes on request, one at a time, keeping the last ``cache_size`` results."""

    def __init__(self, run_dir: Path, given_settings: dict[str, dict[str, Any]] | None = None,
                 cache_size: int = 32) -> None:
        self.given_settings = dict(given_settings or {})
        self.config_settings = run_env_settings(run_dir)
        self.cache_size = cache_size
        self._cache: OrderedDict[str, Replay] = OrderedDict()
        self._envs: dict[str, Any] = {}  # (name, settings) -> an environment kept for later replays
        self._lock = asyncio.Lock()

    def settings_candidates(self, env: str) -> list[dict[str, Any]]:
        candidates = ([self.given_settings[env]] if env in self.given_settings else []) + \
            self.config_settings.get(env, []) + [{}]
        unique: list[dict[str, Any]] = []
        for c in candidates:
            if c not in unique:
                unique.append(c)
        return unique

    async def replay(self, key: str, record: dict[str, Any]) -> Replay | None:
        """The episode's replay (None for environments that are not replayed)."""
        if record.get("env") not in REPLAYED_ENVS:
            return None
        async with self._lock:  # one replay at a time: environments are shared and CPU-bound
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            try:
                result = await self._replay(record)
            except Exception as exc:  # a broken replay must not take the page down; the page says why
                log.exception("replay of %s failed", key)
                result = Replay(problem=f"the replay failed: {type(exc).__name__}: {exc}")
            self._cache[key] = result
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return result

    async def close(self) -> None:
        for env in self._envs.values():
            try:
                await env.close()
            except Exception:  # closing at exit: nothing left to do about it
                log.debug("closing a replay environment failed", exc_info=True)
        self._envs.clear()

    # ------------------------------------------------------------ replaying
    def _env(self, name: str, settings: dict[str, Any]) -> Any:
        key = f"{name}:{json.dumps(settings, sort_keys=True)}"
        if key not in self._envs:
            self._envs[key] = make_env(name, settings)
        return self._envs[key]

    async def _start(self, record: dict[str, Any]) -> tuple[Any, dict[str, Any]] | None:
        """An environment reset to the record's task whose first observation is the recorded one."""
        for settings in self.settings_candidates(record["env"]):
            try:
                env = self._env(record["env"], settings)
                observation = await env.reset(record["task_id"])
            except (ValueError, TypeError) as exc:  # settings this environment refuses, an id out of range
                log.info("replay of %s with settings %s: %s", record.get("trajectory_id"), settings, exc)
                continue
            if _same_text(observation, record.get("first_observation")):
                return env, settings
        return None

    async def _replay(self, record: dict[str, Any]) -> Replay:
        started = await self._start(record)
        if started is None:
            tried = "; ".join(json.dumps(s) for s in self.settings_candidates(record["env"]))
            return Replay(problem=f"no settings reproduce the recorded first observation (tried {tried}); "
                                  f"pass them with `horizonrl view RUN_DIR --env-settings {record['env']}=JSON`")
        env, settings = started
        result = Replay(settings=settings)
        await self._capture(env, record["env"], result)
        for k, turn in enumerate(record.get("turns", []), start=1):
            if turn.get("observation") is None:
                result.problem = f"the episode failed during turn {k}; there is no state after it"
                break
            reply = turn.get("reply") or ""
            if len(reply) >= MAX_SAMPLE_TEXT and turn.get("action"):
                reply = f"Action: {turn['action']}"  # the recorded reply was cut; the action is what counted
            step = await env.step(reply)
            if not _same_text(step.observation, turn.get("observation")):
                result.problem = (f"the replay stops reproducing the record at turn {k} (the environment answered "
                                  "differently); later states are not shown")
                break
            await self._capture(env, record["env"], result)
        return result

    async def _capture(self, env: Any, name: str, result: Replay) -> None:
        if name == "babyai":
            result.frames.append(await asyncio.to_thread(babyai_frame_png, env))
        elif name == "textcraft":
            result.inventories.append(textcraft_inventory(env))
        result.reproduced += 1


def babyai_frame_png(env: Any) -> bytes:
    """The whole grid as minigrid draws it (the agent's field of view highlighted), as PNG.

    Reads the BabyAI environment's gymnasium env (``_env``): the viewer is a program and may look
    inside a part; the text environment has no drawing of its own."""
    from PIL import Image

    grid_env = env._env.unwrapped
    tile = max(8, min(32, MAX_FRAME_PIXELS // max(grid_env.width, grid_env.height)))
    frame = grid_env.get_frame(highlight=True, tile_size=tile)
    buffer = io.BytesIO()
    Image.fromarray(frame).save(buffer, format="PNG")
    return buffer.getvalue()


def textcraft_inventory(env: Any) -> dict[str, int]:
    from horizonrl.envs.textcraft import item_name

    return {item_name(item): count for item, count in sorted(env.inventory.items())}
