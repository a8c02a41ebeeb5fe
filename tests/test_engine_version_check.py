"""The engine-API check (actors/engine_api.py): passes on the installed vLLM, and names the installed
version and the needed range when a call the code makes is missing or re-signed. No engine starts."""

import re
import sys
import tomllib
import types
from pathlib import Path

import pytest

from horizonrl.actors.engine_api import (
    ENGINE_API,
    SUPPORTED_VLLM,
    EngineVersionError,
    NeededCall,
    check_engine_api,
    installed_vllm_version,
)

REPO = Path(__file__).resolve().parents[1]


def test_installed_vllm_has_the_engine_api():
    assert check_engine_api() == installed_vllm_version()
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", installed_vllm_version())


def test_the_gpu_extra_pins_the_checked_range():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert f"vllm{SUPPORTED_VLLM}" in extras["gpu"]


def test_an_older_reload_weights_is_refused_with_version_and_range(monkeypatch):
    import vllm
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def reload_weights(self) -> None:  # the signature of vLLM 0.15: re-reads the checkpoint from disk
        raise AssertionError("never called")

    monkeypatch.setattr(GPUModelRunner, "reload_weights", reload_weights)
    monkeypatch.setattr(vllm, "__version__", "0.15.1")
    with pytest.raises(EngineVersionError) as info:
        check_engine_api()
    message = str(info.value)
    assert message.startswith("vLLM 0.15.1 lacks engine API")
    assert "GPUModelRunner.reload_weights(weights_iterator=, is_checkpoint_format=)" in message
    assert "takes (no parameters), without weights_iterator, is_checkpoint_format" in message
    assert f"vllm{SUPPORTED_VLLM}" in message
    assert message.count("\n  - ") == 1  # the other calls are fine


def test_every_re_signed_call_is_listed(monkeypatch):
    from vllm.v1.engine.async_llm import AsyncLLM

    async def reset_prefix_cache(self) -> bool:  # vLLM 0.11: running requests keep their KV
        raise AssertionError("never called")

    async def pause_generation(self, *, wait_for_inflight_requests: bool = False, clear_cache: bool = True):
        raise AssertionError("never called")

    monkeypatch.setattr(AsyncLLM, "reset_prefix_cache", reset_prefix_cache)
    monkeypatch.setattr(AsyncLLM, "pause_generation", pause_generation)
    with pytest.raises(EngineVersionError) as info:
        check_engine_api()
    message = str(info.value)
    assert "reset_prefix_cache(reset_running_requests=): the installed one takes (no parameters)" in message
    assert "pause_generation(mode=): the installed one takes (wait_for_inflight_requests, clear_cache), without mode" \
        in message


def test_a_fake_module_without_the_class(monkeypatch):
    fake = types.ModuleType("fake_vllm_runner")
    monkeypatch.setitem(sys.modules, "fake_vllm_runner", fake)
    needed = (NeededCall("fake_vllm_runner", "GPUModelRunner", "reload_weights", ("weights_iterator",), "loading"),)
    with pytest.raises(EngineVersionError, match=r"fake_vllm_runner.GPUModelRunner cannot be imported"):
        check_engine_api(needed)

    fake.GPUModelRunner = type("GPUModelRunner", (), {})
    with pytest.raises(EngineVersionError, match=r"GPUModelRunner has no reload_weights; needed for loading"):
        check_engine_api(needed)

    class GPUModelRunner:
        def reload_weights(self, weights_iterator=None, weights_path=None):
            pass

    fake.GPUModelRunner = GPUModelRunner
    check_engine_api(needed)  # now it is there, with the parameter


def test_every_needed_call_names_its_use():
    assert all(call.used_for and call.parameters for call in ENGINE_API)


# ------------------------------------------------------------------ RolloutEngine.start: the check, then the plan


def started_engine_args(monkeypatch, tensor_parallel_size: int, visible: str | None, **engine_settings):
    """The engine arguments RolloutEngine.start builds (AsyncLLM is replaced: nothing starts)."""
    from vllm.v1.engine.async_llm import AsyncLLM

    from horizonrl.actors.engine import RolloutEngine
    from horizonrl.core.config import EngineConfig

    captured = []
    monkeypatch.setattr(AsyncLLM, "from_engine_args", classmethod(lambda cls, args: captured.append(args) or object()))
    # set, then deleted: monkeypatch then restores the variable as it was (a plain delenv of an unset variable
    # records nothing, and the engine's setdefault below would outlive the test)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "")
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    engine = RolloutEngine.start("/m", dtype="float32",
                                 engine=EngineConfig(tensor_parallel_size=tensor_parallel_size, **engine_settings),
                                 max_model_len=256, seed=0)
    return engine, captured[0]


def test_start_follows_the_placement_on_the_cpu(monkeypatch):
    import os

    engine, args = started_engine_args(monkeypatch, 1, None)
    assert not engine.on_gpu and args.tensor_parallel_size == 1
    assert args.distributed_executor_backend is None  # vLLM's single in-process worker
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ
    engine, args = started_engine_args(monkeypatch, 2, None)
    assert args.tensor_parallel_size == 2 and args.distributed_executor_backend == "mp"
    # vllm-cpu refuses to bind 2 workers on a host with one NUMA node; unbound they start (docs/gpu.md)
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    # CUDA_VISIBLE_DEVICES set, but no GPU behind it (this machine): still the CPU, as the launcher planned
    engine, _ = started_engine_args(monkeypatch, 1, "0")
    assert not engine.on_gpu


def test_the_kv_block_size_is_vllms_unless_set(monkeypatch):
    from vllm.engine.arg_utils import AsyncEngineArgs

    _, args = started_engine_args(monkeypatch, 1, None)
    assert args.block_size == AsyncEngineArgs.block_size  # vLLM's default: its platform picks (128 on the CPU)
    _, args = started_engine_args(monkeypatch, 1, None, block_size=32)
    assert args.block_size == 32


def test_start_checks_the_engine_api_before_anything_starts(monkeypatch):
    from vllm.v1.engine.async_llm import AsyncLLM

    async def reset_prefix_cache(self) -> bool:
        raise AssertionError("never called")

    monkeypatch.setattr(AsyncLLM, "reset_prefix_cache", reset_prefix_cache)
    with pytest.raises(EngineVersionError, match="reset_running_requests"):
        started_engine_args(monkeypatch, 1, None)
