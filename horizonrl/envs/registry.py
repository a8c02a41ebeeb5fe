"""Environments by name: ``make_env("babyai", {"levels": [...]})``.

Each name maps to a factory called with the environment's settings as keyword arguments. A built-in
one's module is imported when it is made, so listing names never imports minigrid, Java, etc.; by an
import statement, so the dependency test sees it (no module named by a string).
"""

from __future__ import annotations

from typing import Any, Callable

from horizonrl.envs.base import Environment

EnvFactory = Callable[..., Environment]


BUILT_IN = ("signpost", "babyai", "textcraft", "sciworld", "searchqa", "webarena", "http", "heavy-tail")
_REGISTERED: dict[str, EnvFactory] = {}  # register(): a program's own environments


def _built_in(name: str) -> EnvFactory:
    """The factory of a built-in environment, its module imported now (minigrid, Java, ... only when used).
    ``heavy-tail`` is the benchmarks' workload (long-tailed turns, slow steps): `horizonrl bench --workload
    heavy-tail`."""
    if name == "signpost":
        from horizonrl.envs.signpost import SignpostEnv as factory
    elif name == "babyai":
        from horizonrl.envs.babyai import BabyAIEnv as factory
    elif name == "textcraft":
        from horizonrl.envs.textcraft import TextCraftEnv as factory
    elif name == "sciworld":
        from horizonrl.envs.sciworld import SciWorldEnv as factory
    elif name == "searchqa":
        from horizonrl.envs.searchqa import SearchQAEnv as factory
    elif name == "webarena":
        from horizonrl.envs.webarena import WebArenaEnv as factory
    elif name == "http":
        from horizonrl.envs.client import HTTPEnv as factory
    elif name == "heavy-tail":
        from horizonrl.envs.heavy_tail import heavy_tail_env as factory
    else:
        raise ValueError(f"{name!r} is not a built-in environment")
    return factory


def register(name: str, factory: EnvFactory) -> None:
    """Make ``factory`` (called with the settings as keyword arguments) the environment named ``name``: how a
    program adds an environment of its own before it starts the run's processes in this interpreter."""
    _REGISTERED[name] = factory


def env_names() -> list[str]:
    return sorted({*BUILT_IN, *_REGISTERED})


def make_env(name: str, settings: dict[str, Any] | None = None) -> Environment:
    if name in _REGISTERED:
        return _REGISTERED[name](**(settings or {}))
    if name not in BUILT_IN:
        raise ValueError(f"unknown environment {name!r}; known: {', '.join(env_names())}")
    return _built_in(name)(**(settings or {}))
