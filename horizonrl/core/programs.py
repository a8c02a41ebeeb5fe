"""The registry of programs: every way one process of horizonrl starts another, and every dotted path
handed to a library that imports our code by name.

A module named in a string escapes the dependency test (an import statement it can read; a string it
cannot), so such strings live here and nowhere else in the package (``tests/test_dependencies.py``
checks that, and that every name below is a module or class that exists). Everything else reaches
code through ``import``.
"""

from __future__ import annotations

import sys

PACKAGE_MODULE = "horizonrl"  # ``python -m horizonrl ...``: the command line (apps/cli.py)
OFFLINE_RANK_MODULE = "horizonrl.learner.offline"  # one rank of ``horizonrl sft|dpo`` (learner/offline.py)
TENSORBOARD_MODULE = "horizonrl.apps.tensorboard_main"  # TensorBoard for ``horizonrl train --tensorboard``
# vLLM's ``worker_extension_cls``: vLLM imports it by this name inside each engine worker (actors/vllm_worker.py).
VLLM_WORKER_EXTENSION = "horizonrl.actors.vllm_worker.WeightReceiverExtension"


def horizonrl_command(*args: str, python: str | None = None) -> list[str]:
    """``python -m horizonrl ARGS...`` with this interpreter (or ``python``)."""
    return [python or sys.executable, "-m", PACKAGE_MODULE, *args]


def role_command(role: str, config_path: str, *extra: str, index: int | None = None) -> list[str]:
    """One process of a run: ``horizonrl ROLE --config CONFIG [EXTRA...] [--index I]``."""
    args = [role, "--config", str(config_path), *extra]
    return horizonrl_command(*args, *(["--index", str(index)] if index is not None else []))


def offline_rank_command(paradigm: str, config_path: str, data_path: str) -> list[str]:
    """One rank of an offline (SFT, DPO) run, started by its first process."""
    return [sys.executable, "-m", OFFLINE_RANK_MODULE, paradigm, "--config", str(config_path), "--data", str(data_path)]


def tensorboard_command(logdir: str, port: int) -> list[str]:
    """TensorBoard on 127.0.0.1:``port`` over ``logdir``, as a process of a run (it ends with its launcher)."""
    return [sys.executable, "-m", TENSORBOARD_MODULE, "--logdir", str(logdir), "--host", "127.0.0.1",
            "--port", str(port)]
