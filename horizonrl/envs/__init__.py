"""Environments behind one async interface (see ``base.Environment``)."""

from horizonrl.envs.base import Environment, EnvironmentFailure, StepResult, extract_react_action, run_blocking
from horizonrl.envs.registry import env_names, make_env, register

__all__ = [
    "Environment",
    "EnvironmentFailure",
    "StepResult",
    "env_names",
    "extract_react_action",
    "make_env",
    "register",
    "run_blocking",
]
