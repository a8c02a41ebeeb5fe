"""Helpers for environment implementations; the contract itself is in ``core/environment.py``."""

from __future__ import annotations

import asyncio
import functools
from typing import Any, Callable, TypeVar

from horizonrl.core.environment import SPLITS, Environment, EnvironmentFailure, StepResult, extract_react_action

__all__ = ["SPLITS", "Environment", "EnvironmentFailure", "StepResult", "extract_react_action", "run_blocking"]

T = TypeVar("T")


async def run_blocking(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run blocking environment code in a worker thread so the event loop keeps serving."""
    return await asyncio.get_running_loop().run_in_executor(None, functools.partial(fn, *args, **kwargs))
