"""Environments by name: ``make_env("babyai", {"levels": [...]})``.

Each name maps to a factory called with the environment's settings as keyword arguments. The
factories import their module when called, so listing names never imports minigrid, Java, etc.;
they are plain functions, so every environment the package has is reachable by an import the
dependency test can see (no module named by a string).
"""

from __future__ import annotations

from typing import Any, Callable

from horizonrl.envs.base import Environment

EnvFactory = Callable[..., Environment]


def _signpost(**settings: Any) -> Environment:
    from horizonrl.envs.signpost import SignpostEnv

    return SignpostEnv(**settings)


def _babyai(**settings: Any) -> Environment:
    from horizonrl.envs.babyai import BabyAIEnv

    return BabyAIEnv(**settings)


def _textcraft(**settings: Any) -> Environment:
    from horizonrl.envs.textcraft import TextCraftEnv

    return TextCraftEnv(**settings)


def _sciworld(**settings: Any) -> Environment:
    from horizonrl.envs.sciworld import SciWorldEnv

    return SciWorldEnv(**settings)


def _searchqa(**settings: Any) -> Environment:
    from horizonrl.envs.searchqa import SearchQAEnv

    return SearchQAEnv(**settings)


def _webarena(**settings: Any) -> Environment:
    from horizonrl.envs.webarena import WebArenaEnv

    return WebArenaEnv(**settings)


def _http(**settings: Any) -> Environment:
    from horizonrl.envs.client import HTTPEnv

    return HTTPEnv(**settings)


def _heavy_tail(**settings: Any) -> Environment:
    from horizonrl.envs.heavy_tail import heavy_tail_env

    return heavy_tail_env(**settings)


_FACTORIES: dict[str, EnvFactory] = {
    "signpost": _signpost,
    "babyai": _babyai,
    "textcraft": _textcraft,
    "sciworld": _sciworld,
    "searchqa": _searchqa,
    "webarena": _webarena,
    "http": _http,
    # The benchmarks' workload (long-tailed turns, slow steps), for `horizonrl bench --workload heavy-tail`.
    "heavy-tail": _heavy_tail,
}


def register(name: str, factory: EnvFactory) -> None:
    """Make ``factory`` (called with the settings as keyword arguments) the environment named ``name``: how a
    program adds an environment of its own before it starts the run's processes in this interpreter."""
    _FACTORIES[name] = factory


def env_names() -> list[str]:
    return sorted(_FACTORIES)


def make_env(name: str, settings: dict[str, Any] | None = None) -> Environment:
    if name not in _FACTORIES:
        raise ValueError(f"unknown environment {name!r}; known: {', '.join(env_names())}")
    return _FACTORIES[name](**(settings or {}))
