"""Environments by name: ``make_env("babyai", {"levels": [...]})``.

Each module registers a factory that takes the environment's settings as keyword
arguments. Imports are lazy so that listing names never imports minigrid, Java, etc.
"""

from __future__ import annotations

import importlib
from typing import Any

from horizonrl.envs.base import Environment

# name -> "module:factory"; the factory is called with the settings as keyword arguments.
_FACTORIES: dict[str, str] = {
    "signpost": "horizonrl.envs.signpost:SignpostEnv",
    "babyai": "horizonrl.envs.babyai:BabyAIEnv",
    "textcraft": "horizonrl.envs.textcraft:TextCraftEnv",
    "sciworld": "horizonrl.envs.sciworld:SciWorldEnv",
    "searchqa": "horizonrl.envs.searchqa:SearchQAEnv",
    "webarena": "horizonrl.envs.webarena:WebArenaEnv",
    "http": "horizonrl.envs.client:HTTPEnv",
    # The benchmark's workload (long-tailed turns, slow steps), for `horizonrl bench --workload heavy-tail`.
    "heavy-tail": "horizonrl.bench.workload:heavy_tail_env",
}


def register(name: str, target: str) -> None:
    """Register ``"module:factory"`` under ``name`` (used by plug-in environments)."""
    _FACTORIES[name] = target


def env_names() -> list[str]:
    return sorted(_FACTORIES)


def make_env(name: str, settings: dict[str, Any] | None = None) -> Environment:
    if name not in _FACTORIES:
        raise ValueError(f"unknown environment {name!r}; known: {', '.join(env_names())}")
    module_name, _, attr = _FACTORIES[name].partition(":")
    factory = getattr(importlib.import_module(module_name), attr)
    return factory(**(settings or {}))
