"""Helpers for environment implementations; the contract itself is in ``core/environment.py``."""

from __future__ import annotations

import asyncio
import functools
from typing import Any, Callable, TypeVar

from horizonrl.core.environment import SPLITS, Environment, EnvironmentFailure, StepResult

__all__ = ["SPLITS", "Environment", "EnvironmentFailure", "StepResult", "extract_react_action", "run_blocking"]

T = TypeVar("T")


def extract_react_action(reply: str) -> str | None:
    """The text after the last ``Action:`` of a ReAct reply (first line only), or None."""
    last = reply.lower().rfind("action:")
    if last < 0:
        return None
    text = reply[last + len("action:"):].strip()
    text = text.splitlines()[0].strip() if text else ""
    return text.strip().strip("`").strip().rstrip(".").strip() or None


async def run_blocking(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run blocking environment code in a worker thread so the event loop keeps serving."""
    return await asyncio.get_running_loop().run_in_executor(None, functools.partial(fn, *args, **kwargs))
