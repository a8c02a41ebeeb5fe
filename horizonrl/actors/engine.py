"""The rollout engine: the one module that calls vLLM's Python API.

vLLM upgrades rename things (weight-update RPCs, engine arguments); keeping every call
here means an upgrade touches one file. Generation is token-in/token-out: the prompt
is token ids, and the result is the generated token ids with the behaviour policy's
log-probabilities of exactly those tokens (``processed_logprobs``: of the distribution vLLM sampled
from, after temperature and top-p, so they match ``log_softmax(nucleus_p(logits / T))`` computed by the
learner, ``learner/policy_loss.py``). The engine sets no other sampling setting (top-k, min-p, penalties:
the config refuses them, ``core/config.py`` ``UNREPRODUCED_SAMPLING``); vLLM's generation config of the
model adds only its end-of-sequence ids to a request (read in 0.16-0.34's
``SamplingParams.update_from_generation_config``).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import os
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from horizonrl.actors.concurrency import EngineLoad, load_logger_factory
from horizonrl.actors.engine_api import ENGINE_LOAD_KEYS, EngineApi, EngineVersionError, check_engine_api
from horizonrl.actors.lora_adapter import AdapterSlot, engine_lora_args
from horizonrl.core.config import ConfigError, EngineConfig
from horizonrl.core.programs import VLLM_WORKER_EXTENSION
from horizonrl.protocol.worker_replies import RpcReply, StageOutcome, WorkerReply
from horizonrl.core.runtime import BusyClock

log = logging.getLogger("horizonrl.actors.engine")

SUBMIT_WAIT_S = 60.0  # a weight swap waits this long at most for requests being submitted
STAGED_ASK_AFTER_MS = 10_000  # a staging worker's word this late: ask it directly (stage_weights)
# Every call into the workers carries a deadline (absolute); vLLM's executor is given this much more to bring the
# answer (a bucket's load after the last wait, the reply's way back), so it never gives up on an answer that comes.
RPC_REPLY_MARGIN_S = 30.0
# A join forms a group with the learner (which admits members one at a time) and then takes a whole version: its
# deadline is this many weight-sync timeouts.
JOIN_DEADLINE_TIMEOUTS = 2
ECHO_READS_MAX = 8  # answers still queued behind late ones that one call reads at most (RolloutEngine._rpc)
# At shutdown vLLM sends its engine process SIGTERM and kills it (with its workers) after a grace period, 5 s by
# default. On the CPU the processes hold nothing to release, and their teardown alone outlasts those 5 s (the
# worker's interpreter exit ~3 s, then the engine process's): each vLLM-CPU engine stopped in 5 s and a kill.
CPU_ENGINE_EXIT_GRACE_S = 1.0


@dataclass(frozen=True)
class WeightUpdate:
    version: int
    epoch: int
    receive_s: float  # inside the worker: the broadcast (waiting for the sender included)
    load_s: float  # inside the worker: loading into the model (vLLM-CPU re-packs every linear layer)
    stall_s: float  # the engine generated nothing for this long: the swap (aborts, load, prefix-cache reset)
    # With the requests kept: how long the engine took to reach the end of the step it was in when asked to pause.
    # It generated that step's tokens meanwhile, so this is not stall; the swap's wall time is the two together.
    pause_wait_s: float = 0.0


@dataclass(frozen=True)
class StagedWeights:
    """A version received into the workers' staging buffers while the engine kept generating."""

    version: int
    epoch: int
    receive_s: float  # inside the workers' receiving threads (waiting for the sender included)

    @property
    def key(self) -> tuple[int, int]:
        return (self.epoch, self.version)


@dataclass(frozen=True)
class Generation:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (end of turn), "length" (max tokens) or "abort"
    # Which weights generated which tokens: ``(end, epoch, version)`` per run of tokens of one version, in
    # order, ``end`` an offset into ``token_ids`` (the last one is ``len(token_ids)``). More than one when a
    # weight update came while the request was in flight. Empty: the generator does not say (test doubles).
    version_spans: list[tuple[int, int, int]] = field(default_factory=list)


class WeightUpdateMismatch(RuntimeError):
    """The workers of one engine did not all load the same weight version: the engine is inconsistent."""


def agreed_update(results: list) -> WeightUpdate:
    """One :class:`WeightUpdate` from every worker's reply (``WorkerReply``, as ``collective_rpc`` hands it back):
    every worker must have succeeded and loaded the same (epoch, version) — a tensor-parallel engine whose
    shards come from two versions computes garbage — and the engine waited for the slowest (the max of the
    times)."""
    from horizonrl.protocol.weights import WeightSyncError

    if not results:
        raise WeightUpdateMismatch("the weight update RPC returned no worker results")
    replies = [r if isinstance(r, WorkerReply) else WorkerReply.from_wire(r) for r in results]
    errors = {r.worker: r.error for r in replies if r.error}
    if errors:
        raise WeightSyncError(f"weight update failed in {len(errors)} of the engine's {len(replies)} workers: "
                              + "; ".join(f"worker {rank}: {error}" for rank, error in sorted(errors.items())))
    keys = {(r.epoch, r.version) for r in replies}
    if len(keys) != 1:
        by_worker = {r.worker: (r.epoch, r.version) for r in replies}
        raise WeightUpdateMismatch(f"the engine's workers loaded different weights (epoch, version): {by_worker}")
    (epoch, version), = keys
    return WeightUpdate(version, epoch, max(r.receive_s for r in replies), max(r.load_s for r in replies), 0.0)


def cpu_engine_setup(engine: EngineConfig, api: EngineApi, cpus: Sequence[int] | None) -> dict:
    """A CPU engine's KV-cache arguments; with tensor parallelism, its workers' core binding too."""
    tp = engine.tensor_parallel_size
    if tp > 1:
        # vLLM-CPU's automatic binding gives each tensor-parallel worker a NUMA node of its own and refuses to start
        # on a host with fewer nodes than workers. Each worker gets its share of this engine's cores instead ("0|1"
        # on 2 cores; "nobind" only when there are fewer cores than workers): unbound, the workers' threads compete
        # for every core, and the tensor-parallel engine test ran 3.4x slower.
        from horizonrl.core.placement import vllm_cpu_binding

        cores = sorted(cpus) if cpus else sorted(os.sched_getaffinity(0))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", vllm_cpu_binding(cores, tp))
    return cpu_kv_cache_args(engine.kv_cache_gib_or_default, api.has("kv_cache_bytes"))


class RolloutEngine:
    """One vLLM ``AsyncLLM`` with the weights it holds, ``weights`` = (epoch, version).

    Weight updates and generation (why the code looks the way it does): a version is received into
    the workers' staging buffers while the engine keeps generating (:meth:`stage_weights`), then swapped
    in between two engine steps (:meth:`load_staged`). A swap closes the *gate* (no request enters the
    engine), waits for requests being submitted, changes the weights and opens the gate. What happens to
    the requests in flight is ``on_weight_update`` (rollout.engine.on_weight_update):

    - ``keep`` (default): vLLM is paused with its requests kept (``pause_generation``'s mode "keep"); the
      weights change and vLLM resumes. Each request goes on in place, from the keys and values the old weights
      computed. Which tokens the old weights sampled: from vLLM 0.32 on, vLLM labels every token with the
      weight version set when it was sampled (``update_weight_version``, ``CompletionOutput.weight_versions``);
      before, the worker says how many tokens each request has generated at the pause (vLLM's client cannot:
      its outputs of the last step may still be on the way), read from the V1 model runner's request states.
      No abort, no re-submission, no prefill.
    - ``resubmit``: the requests are aborted — vLLM hands back their partial tokens and the logprobs they
      were sampled with — and each :meth:`generate` goes on from where it stopped, the partial reply
      appended to its prompt, under the new weights; the prefix cache serves all but the last partial
      KV block of that context.
    - ``recompute``: as ``resubmit``, and the prefix cache is dropped (its keys and values came from the
      old weights), so every token after the swap comes from the new weights alone, at the cost of one
      prefill of each request's context.

    Either way a request in flight during an update finishes, and every token is known to come from
    exactly one version (``Generation.version_spans``). Measured: docs/benchmarks.md.

    The prefix cache is keyed by weight version (vLLM's ``cache_salt``): a request started after a swap
    never reuses keys and values an older version computed (without the salt the system prompt's blocks,
    hit by every episode, would have stayed those of version 0 for the whole run, and a new turn's context
    those of the version that generated it). A request cut off by a swap under ``resubmit`` goes on under
    its first salt, so it reuses its own context's blocks as described above.
    """

    def __init__(self, llm, on_gpu: bool, on_weight_update: str = "keep", api: EngineApi | None = None,
                 load: EngineLoad | None = None, adapter: AdapterSlot | None = None) -> None:
        self._llm = llm
        # The scheduler's KV-cache use and preemptions (actors/concurrency.py), filled by the stat logger start()
        # gives vLLM where the installed vLLM has it; ``load.reports`` stays 0 otherwise.
        self.load = load or EngineLoad()
        self.on_gpu = on_gpu
        # rollout.engine.on_weight_update: keep | resubmit | recompute (the class docstring)
        self.on_weight_update = on_weight_update
        # What the installed vLLM has (engine_api.check_engine_api); None: a stand-in engine of the tests, taken to
        # have what 0.18-0.31 have (a shutdown time-out, no weight labels).
        self.api = api
        # keep: whose word says which weights sampled each token. "vllm": vLLM labels them (0.32 on); "worker": the
        # worker counts each request's tokens at the pause (V1 model runner's request states).
        self.token_versions = "vllm" if api is not None and labels_tokens(api) else "worker"
        self._runner_checked = api is None
        # request id -> (tokens it had generated, the weights after) for each swap it was kept through
        self._switches: dict[str, list[tuple[int, tuple[int, int]]]] = {}
        self.weights: tuple[int, int] = (0, 0)  # (epoch, version): version 0 is the checkpoint it started from
        # Time with no request in the engine: the engine's idle share (rollout/engine_idle_share).
        self.clock = BusyClock()
        self._gate_open = asyncio.Event()
        self._gate_open.set()
        self._submitting = 0  # requests between the gate and vLLM's add_request returning
        self._submitted = asyncio.Event()  # set whenever _submitting drops to 0
        self._submitted.set()
        self._in_flight: set[str] = set()  # request ids inside the engine
        self._cut_off: set[str] = set()  # request ids a swap aborted: their generate() goes on
        self._swap_lock = asyncio.Lock()
        self._staged = None  # the PULL socket the workers' staging threads report to (made on first use)
        self._staged_context = None
        self._staged_address = ""
        self._stage_id = 0
        self.swaps = 0
        self.continued_requests = 0  # requests a swap cut off and that went on under the new weights
        self.kept_requests = 0  # requests a swap kept in the engine (on_weight_update=keep)
        self.lost_stage_messages = 0  # staged receives whose end the workers' message never told (stage_weights)
        self._calls = 0  # the number of the last call into the workers (_rpc)
        self._echoes: collections.deque[int] = collections.deque(maxlen=64)  # the numbers of recent echo calls
        self.stale_replies = 0  # workers' answers to older calls, read late and dropped (_rpc)
        # learner.lora: where the workers keep the policy's adapter; every request names it (actors/lora_adapter.py)
        self.adapter = adapter
        self._adapter_announced = False

    @classmethod
    def start(cls, model_path: str, *, dtype: str | None, engine: EngineConfig, max_model_len: int,
              seed: int, cpus: Sequence[int] | None = None, lora_rank: int | None = None) -> "RolloutEngine":
        """Start an AsyncLLM (an EngineCore and one Worker process per tensor-parallel rank). The caller
        needs a ``if __name__ == "__main__"`` guard: vLLM spawns its processes.

        ``cpus``: the CPU cores the engine's processes run on (``resources.engine_cpus``) when they are not
        this process's (``starting_on_cpus``).

        ``lora_rank`` (``learner.lora.rank``): the engine serves the policy as the model plus one LoRA adapter of
        that rank, and each weight version is that adapter (actors/lora_adapter.py).

        The device follows the launcher's placement (core/placement.py): it put this engine's
        ``tensor_parallel_size`` GPUs in CUDA_VISIBLE_DEVICES, or hid every GPU for a CPU plan, so the
        engine runs on what this process sees; the weight group's backend follows from that device
        the same way the learner's does (NCCL on GPUs, gloo on the CPU)."""
        import torch
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from horizonrl.actors.cpu_affinity import starting_on_cpus
        from horizonrl.core.placement import local_device_type, visible_gpus
        from horizonrl.core.precision import resolve_engine_dtype

        api = check_engine_api()  # before a minute of start-up, not in the first weight update
        if engine.num_kv_blocks is not None and not api.has("kv_blocks_override"):
            raise ConfigError(f"rollout.engine.num_kv_blocks needs vLLM's num_gpu_blocks_override, which vLLM "
                              f"{api.version} lacks: {api.problems.get('kv_blocks_override')}")
        if v1_model_runner_needed(api, engine.on_weight_update):
            use_v1_model_runner(api, engine.on_weight_update)
        gpus = visible_gpus(os.environ, lambda: torch.cuda.device_count() if torch.cuda.is_available() else 0)
        on_gpu = local_device_type("auto", gpus) == "cuda"
        # rollout.engine.dtype, else the deprecated model.dtype (``dtype``), else bf16 on GPUs and fp32 on the
        # CPU; never vLLM's own "auto", which would turn the fp32 tiny model into bf16.
        try:
            dtype = resolve_engine_dtype(engine.dtype, dtype, engine_on_gpu=on_gpu)
        except ValueError as error:
            raise ConfigError(str(error)) from error
        tp = engine.tensor_parallel_size
        if on_gpu and len(gpus) < tp:
            raise ConfigError(f"rollout.engine.tensor_parallel_size={tp} but this engine sees {len(gpus)} GPU(s) "
                              f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}); start it "
                              "with `horizonrl train`, which gives each engine its GPUs (docs/gpu.md)")
        kv_cache = {} if on_gpu else cpu_engine_setup(engine, api, cpus)
        args = AsyncEngineArgs(
            model=model_path,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            max_num_seqs=engine.max_num_seqs,
            enforce_eager=engine.enforce_eager,
            enable_prefix_caching=engine.enable_prefix_caching,
            **({"block_size": engine.block_size} if engine.block_size is not None else {}),
            **({"num_gpu_blocks_override": engine.num_kv_blocks} if engine.num_kv_blocks is not None else {}),
            **kv_cache,
            gpu_memory_utilization=engine.gpu_memory_utilization,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=VLLM_WORKER_EXTENSION,
            tensor_parallel_size=tp,
            # One worker process per shard; with one shard vLLM's default (a single worker) stays.
            distributed_executor_backend="mp" if tp > 1 else None,
            disable_log_stats=True,  # vLLM's own loggers off; the stat logger below still gets the scheduler's stats
            **(engine_lora_args(lora_rank) if lora_rank else {}),
        )
        load = EngineLoad()
        reports_load = all(api.has(key) for key in ENGINE_LOAD_KEYS)
        stat_loggers = {"stat_loggers": [load_logger_factory(load)]} if reports_load else {}
        with starting_on_cpus(cpus):
            # No local name for the AsyncLLM: something in its start-up keeps a frame below this one alive (likely an
            # exception's traceback), whose f_back is this frame, so a local here would outlive shutdown() and
            # vLLM's __del__ would run at interpreter exit, failing noisily once module globals are gone.
            return cls(AsyncLLM.from_engine_args(args, **stat_loggers), on_gpu, engine.on_weight_update, api, load,
                       adapter=AdapterSlot.create() if lora_rank else None)

    async def generate(self, prompt_ids: list[int], *, max_tokens: int, temperature: float, top_p: float,
                       stop_token_ids: list[int], ignore_eos: bool = False) -> Generation:
        """Sample one reply to ``prompt_ids``. A weight swap while it is in flight keeps it in the engine or cuts
        it off, and either way it goes on under the new weights (see the class docstring): it returns only when
        the reply is complete, each token tagged with the version that sampled it."""
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        ids: list[int] = []
        logprobs: list[float] = []
        spans: list[tuple[int, int, int]] = []
        salt = None  # resubmit: the first submission's weights' salt, for a continuation after a cut-off
        while True:
            params = SamplingParams(
                temperature=temperature,
                top_p=top_p,
                max_tokens=max_tokens - len(ids),
                logprobs=0,  # exactly the sampled token's logprob at each position
                stop_token_ids=stop_token_ids,
                ignore_eos=ignore_eos,
                detokenize=False,
                # One output per request, not one per token: the actor only reads the final one, and
                # per-token outputs cost the client's event loop a wake-up per token per episode.
                output_kind=RequestOutputKind.FINAL_ONLY,
            )
            request_id = uuid.uuid4().hex
            weights, queue = await self._submit(request_id, prompt_ids + ids, params, salt)
            if self.on_weight_update == "resubmit":  # its continuation reuses the blocks of its own context
                salt = salt or cache_salt(weights)
            try:
                final = await self._final_output(request_id, queue)
            finally:
                self._in_flight.discard(request_id)
                cut_off = request_id in self._cut_off
                self._cut_off.discard(request_id)
                switches = self._switches.pop(request_id, [])
                self.clock.exit()
            completion = final.outputs[0]
            new_ids = list(completion.token_ids)
            if self.token_versions == "vllm":
                spans += spans_of_labels(len(ids), len(new_ids), completion.weight_versions)
            else:
                spans += spans_of_request(len(ids), len(new_ids), weights, switches)
            ids += new_ids
            logprobs += [float(pos[tok].logprob) for pos, tok in zip(completion.logprobs or [], new_ids)]
            finish_reason = completion.finish_reason or "abort"
            if finish_reason == "abort" and cut_off and len(ids) < max_tokens:
                self.continued_requests += 1
                continue  # the rest of the reply under the new weights
            if finish_reason == "abort" and cut_off:
                finish_reason = "length"  # every token it asked for had come before the swap
            return Generation(ids, logprobs, finish_reason, _merged(spans))

    async def _submit(self, request_id: str, prompt_ids: list[int], params,
                      salt: str | None) -> tuple[tuple[int, int], object]:
        """Put one request into the engine once no swap is in progress; returns the weights it is generated
        with and vLLM's output queue. A swap that starts meanwhile waits for this to return (so it sees and
        aborts the request) and cannot finish before, so those weights are the request's until it ends or
        is cut off. Its prefix-cache salt is ``salt``, else those weights' (the class docstring)."""
        from vllm.inputs import TokensPrompt

        while not self._gate_open.is_set():
            await self._gate_open.wait()
        self._submitting += 1
        self._submitted.clear()
        try:
            weights = self.weights
            prompt = TokensPrompt(prompt_token_ids=prompt_ids, cache_salt=salt or cache_salt(weights))
            self.clock.enter()
            try:
                queue = await self._llm.add_request(
                    request_id, prompt, params, **({"lora_request": self.adapter.request()} if self.adapter else {}))
            except BaseException as exc:
                self.clock.exit()
                if isinstance(exc, asyncio.CancelledError):  # it may have reached the engine: end it there
                    await self._abort(request_id)
                raise
            self._in_flight.add(request_id)
            return weights, queue
        finally:
            self._submitting -= 1
            if self._submitting == 0:
                self._submitted.set()

    async def _final_output(self, request_id: str, queue):
        """vLLM's ``AsyncLLM.generate`` loop for one request: its final output (FINAL_ONLY); cancelled, it
        aborts the request in the engine."""
        try:
            while True:
                output = queue.get_nowait() or await queue.get()
                if output.finished:
                    return output
        except asyncio.CancelledError:
            await self._abort(request_id)
            raise

    async def _abort(self, request_id: str) -> None:
        """End a cancelled request in the engine. After :meth:`shutdown` there is no engine to tell: the actor
        process ending cancels the generations still pending (asyncio.run's clean-up) after the engine is gone."""
        if self._llm is not None:
            await asyncio.shield(self._llm.abort(request_id))

    # ------------------------------------------------------------------ weights

    async def join_weights(self, host: str, port: int, *, actor: int, run_id: str, timeout_s: float,
                           connect_timeout_s: float | None = None) -> WeightUpdate:
        """Join (or rejoin) the learner's weight hub; the learner's newest weights are in the engine on return.
        The receive runs in the engine's loop (a join is rare: start, a restarted learner, a lost member).
        ``connect_timeout_s``: see ``weight_receiver.join_weight_hub``."""
        from horizonrl.core.placement import engine_weight_transport

        args = (host, port, actor, run_id, timeout_s, engine_weight_transport(self.on_gpu, os.environ),
                connect_timeout_s)
        await self._check_model_runner()
        if self.adapter is not None and not self._adapter_announced:
            answers = await self._rpc("horizonrl_use_adapter", SUBMIT_WAIT_S, (self.adapter.directory,))
            if not all(answers):
                raise RuntimeError(f"the engine's workers did not take the adapter slot: {answers}")
            self._adapter_announced = True
        return await self._swap(lambda: self._worker_rpc("horizonrl_join_weight_hub",
                                                         JOIN_DEADLINE_TIMEOUTS * timeout_s, args))

    async def _check_model_runner(self) -> None:
        """Once, before the first weights move: the model runner vLLM gave the workers has what a weight update
        needs (engine_api's entries of that runner; for ``keep`` counted by the worker, its request states).
        Which runner a worker gets is vLLM's choice at start, so this cannot be known earlier."""
        if self._runner_checked:
            return
        facts = await self._rpc("horizonrl_model_runner", SUBMIT_WAIT_S)
        problems = []
        for fact in facts:
            problems += self.api.runner_problems(fact["runner"])
            if self.on_weight_update == "keep" and self.token_versions == "worker" and not fact["holds_requests"]:
                problems.append(f"{fact['class']} (the {fact['runner']} model runner) keeps no per-request token "
                                "lists, which on_weight_update=keep counts on this vLLM (it labels tokens by weight "
                                "version from 0.32 on); needed for keeping requests through a weight swap")
        if problems:
            raise EngineVersionError(f"vLLM {self.api.version}, model runner {facts[0]['class']}:\n"
                                     + "\n".join(f"  - {p}" for p in sorted(set(problems)))
                                     + "\nUnset VLLM_USE_V2_MODEL_RUNNER, or set rollout.engine.on_weight_update="
                                       "resubmit, or install vLLM 0.32 or newer")
        self._runner_checked = True

    async def receive_weights(self, timeout_s: float) -> WeightUpdate:
        """Receive the next version the learner sends and load it, with the engine paused throughout:
        bucket by bucket into vLLM's loader (extra memory: about one bucket). For models whose second copy
        does not fit beside the engine; otherwise :meth:`stage_weights` + :meth:`load_staged`."""
        return await self._swap(lambda: self._worker_rpc("horizonrl_receive_weights", timeout_s, ()))

    async def stage_weights(self, timeout_s: float) -> StagedWeights:
        """Receive the next version into the workers' staging buffers (the size of the model in the engine's
        dtype) while the engine keeps generating; each worker acknowledges it to the learner once received,
        and tells this engine so over a socket of its own (``weight_receiver.StagedReceive``); a word more than
        10 s late, and the workers are asked directly. Raises ``WeightSyncError`` when a worker's receive fails or
        does not end within ``timeout_s`` (+ 30 s)."""
        import zmq
        import zmq.asyncio

        from horizonrl.protocol.weights import WeightSyncError

        if self._staged is None:
            self._staged_context = zmq.asyncio.Context()
            self._staged = self._staged_context.socket(zmq.PULL)
            self._staged.setsockopt(zmq.LINGER, 0)
            self._staged_address = f"ipc://{tempfile.gettempdir()}/horizonrl-staged-{os.getpid()}-{id(self):x}"
            self._staged.bind(self._staged_address)
        self._stage_id += 1
        started = await self._rpc("horizonrl_stage_weights", 60, (self._stage_id, self._staged_address))
        agreed_update(started)  # every worker started its thread, or takes the version from TP rank 0 at the load
        stagers = sum(WorkerReply.from_wire(reply).stages for reply in started)
        outcomes: dict[int, WorkerReply] = {}
        deadline = time.monotonic() + timeout_s + 30  # each worker's collectives time out after timeout_s
        while len(outcomes) < stagers:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                raise WeightSyncError(f"{stagers - len(outcomes)} of the engine's {stagers} staging workers did "
                                      f"not say within {timeout_s + 30:.0f} s whether the next version arrived")
            if not await self._staged.poll(min(left_ms, STAGED_ASK_AFTER_MS)):
                # Their message is late. A lost one would cost the weight-sync timeout: the worker has the version
                # and the learner its acknowledgement, while the actor waits it out and the learner's next version
                # waits for the actor (minutes of a run). Ask the workers whether they are done.
                asked = await self._rpc("horizonrl_staged_outcome", 60, (self._stage_id,))
                ended = {o.worker: o.reply for o in (StageOutcome.from_wire(a) for a in asked if a is not None)}
                if len(ended) == stagers:
                    log.warning("staged receive %d ended %.0f s ago or more with no word from its workers; "
                                "took their outcome from them", self._stage_id, STAGED_ASK_AFTER_MS / 1000)
                    self.lost_stage_messages += 1
                    outcomes = ended
                continue
            outcome = StageOutcome.decode(await self._staged.recv())
            if outcome.stage_id == self._stage_id:  # an older stage's late word is not this one's
                outcomes[outcome.worker] = outcome.reply
        update = agreed_update(list(outcomes.values()))
        return StagedWeights(update.version, update.epoch, update.receive_s)

    async def load_staged(self, timeout_s: float = 60.0) -> WeightUpdate:
        """Swap the staged version in between two engine steps (the class docstring says how)."""
        return await self._swap(lambda: self._worker_rpc("horizonrl_load_staged", timeout_s, ()))

    async def _swap(self, change) -> WeightUpdate:
        """Close the gate, cut off the requests in flight (or, keeping them, pause the engine at the end of its
        step), ``change()`` the weights, reset the prefix cache, reopen. The engine generates nothing from the
        aborts (the pause) to the reopening: that is the update's stall."""
        async with self._swap_lock:
            start = time.perf_counter()
            pause_wait = 0.0
            self._gate_open.clear()
            try:
                try:
                    await asyncio.wait_for(self._submitted.wait(), SUBMIT_WAIT_S)
                except asyncio.TimeoutError:
                    raise RuntimeError(f"a request submitted to the engine did not get in within {SUBMIT_WAIT_S:.0f} s "
                                       "(is the engine's core process alive?)") from None
                if self.on_weight_update == "keep":
                    update, pause_wait = await self._change_keeping_requests(change)
                else:
                    await self._cut_off_requests(list(self._in_flight))
                    update = await change()
                    await self._label_tokens(update)  # nothing runs in the engine: the gate is closed
                if self.on_weight_update == "recompute":
                    # Cached prefixes hold keys/values computed with the old weights.
                    await self._llm.reset_prefix_cache(reset_running_requests=True)
                self.weights = (update.epoch, update.version)
                self.swaps += 1
            finally:
                self._gate_open.set()
            return WeightUpdate(update.version, update.epoch, update.receive_s, update.load_s,
                                time.perf_counter() - start - pause_wait, pause_wait)

    async def _cut_off_requests(self, request_ids: list[str]) -> None:
        """Abort these requests; each :meth:`generate` goes on with a new request for the rest of its reply."""
        if request_ids:
            self._cut_off.update(request_ids)
            # Handed back at once with the tokens the client has; the engine drops the rest. The abort
            # reaches the engine before the weights change, so nothing of theirs runs on the new weights.
            await self._llm.abort(request_ids)

    async def _change_keeping_requests(self, change) -> tuple[WeightUpdate, float]:
        """``change()`` the weights with the engine paused between two steps and its requests kept in it: each
        goes on after the swap from where it stopped. Which of its tokens the old weights sampled comes from vLLM
        (``token_versions == "vllm"``: the tokens sampled after the swap carry the new weights' label) or from
        the worker (``"worker"``: its count of each request's tokens at the pause, exact since vLLM generates
        nothing while paused; :func:`spans_of_request` tags them, and a request the worker does not hold — not
        scheduled yet, or finished with its output still on the way to this client — is cut off instead, as
        with ``resubmit``). Also returns how long the pause took: the engine core takes it between two steps,
        so it first ends the step it is in (and vLLM's ``pause_generation`` then sleeps 20 ms in 0.32-0.33)."""
        try:
            try:
                asked = time.perf_counter()
                await asyncio.wait_for(self._llm.pause_generation(mode="keep", clear_cache=False), SUBMIT_WAIT_S)
                pause_wait = time.perf_counter() - asked
            except asyncio.TimeoutError:
                raise RuntimeError(f"the engine did not pause within {SUBMIT_WAIT_S:.0f} s for a weight swap "
                                   "(is its core process alive?)") from None
            if self.token_versions == "vllm":
                update = await change()
                await self._label_tokens(update)  # while paused: every token sampled after it is the new weights'
                self.kept_requests += len(self._in_flight)
                return update, pause_wait
            return await self._change_counting_tokens(change), pause_wait
        finally:
            await asyncio.wait_for(self._llm.resume_generation(), SUBMIT_WAIT_S)

    async def _label_tokens(self, update: WeightUpdate) -> None:
        """Where vLLM labels tokens (``token_versions == "vllm"``): every token sampled from now on, until the next
        swap, carries the new weights' label (:func:`cache_salt`'s form), under every ``on_weight_update``."""
        if self.token_versions == "vllm":
            await self._llm.update_weight_version(cache_salt((update.epoch, update.version)))

    async def _change_counting_tokens(self, change) -> WeightUpdate:
        """The worker's part of a kept swap where vLLM does not label tokens (see above)."""
        [generated, *_] = await self._rpc("horizonrl_output_counts", SUBMIT_WAIT_S)
        # vLLM's internal id is ours + "-" + 8 characters of its own (ours are hex, no "-")
        generated = {internal.rsplit("-", 1)[0]: int(count) for internal, count in generated.items()}
        await self._cut_off_requests([r for r in self._in_flight if r not in generated])
        update = await change()
        after = (update.epoch, update.version)
        kept = self._in_flight - self._cut_off  # no await from here: the set is this moment's
        for request_id in kept:
            self._switches.setdefault(request_id, []).append((generated[request_id], after))
        self.kept_requests += len(kept)
        return update

    async def _worker_rpc(self, method: str, timeout_s: float, args: tuple) -> WeightUpdate:
        """``method`` in every worker of the engine (one per tensor-parallel rank; TP rank 0 is the engine's member
        of the weight hub and relays to the others); all must report the same version (:func:`agreed_update`). A
        failure inside a worker
        (the learner gone, a timeout) is raised here; the worker itself carries on."""
        return agreed_update(await self._rpc(method, timeout_s, args))

    async def _rpc(self, method: str, timeout_s: float, args: tuple = ()) -> list:
        """``method(*args)`` in every worker (through ``vllm_worker``'s ``horizonrl_call``): what each returned, in
        rank order. The worker ends every wait of a weight transfer by the deadline ``timeout_s`` from now;
        vLLM's executor is given :data:`RPC_REPLY_MARGIN_S` more, so it does not give up on an answer that comes.

        Should it give up all the same (a worker stuck where no deadline reaches, with tensor parallelism; TP = 1
        has no executor time-out), the late answer stays queued and the next RPC reads it (0.33
        ``multiproc_executor.py:466,503-509``). So each call has a number, echoed in every answer: an answer to an
        older call is dropped (``stale_replies``), and that worker's answer to this call, queued behind it, is
        read with ``horizonrl_echo`` calls. A worker once behind stays one answer behind (every call sends one
        request to each worker and reads one answer from each), so from then on each call costs one echo call
        more (milliseconds). RuntimeError when a worker's method raised."""
        self._calls += 1
        call = self._calls
        deadline = time.time() + timeout_s
        answers: dict[int, RpcReply] = {}
        replies = await self._llm.collective_rpc("horizonrl_call", timeout=timeout_s + RPC_REPLY_MARGIN_S,
                                                 args=(call, deadline, method, list(args)))
        for _ in range(ECHO_READS_MAX):
            for index, wire in enumerate(replies):
                reply = RpcReply.from_wire(wire)
                if reply.call == call and index not in answers:
                    answers[index] = reply
                elif reply.call < call and reply.call not in self._echoes:
                    self.stale_replies += 1
                    log.warning("worker %d answered call %d late (an RPC vLLM gave up on); dropped it, reading on "
                                "(each later call reads one answer more: one echo call)", index, reply.call)
            if len(answers) == len(replies):
                break
            # The missing answers are queued behind late ones: each call reads one answer per worker.
            self._calls += 1
            self._echoes.append(self._calls)
            replies = await self._llm.collective_rpc("horizonrl_call", timeout=RPC_REPLY_MARGIN_S,
                                                     args=(self._calls, deadline, "horizonrl_echo", []))
        if len(answers) != len(replies):
            raise RuntimeError(f"{method}: {len(replies) - len(answers)} of the engine's {len(replies)} workers did "
                               f"not answer call {call} within {ECHO_READS_MAX} reads")
        errors = {index: reply.error for index, reply in answers.items() if reply.error}
        if errors:
            raise RuntimeError(f"{method} failed in {len(errors)} of the engine's {len(replies)} workers: "
                               + "; ".join(f"worker {index}: {error}" for index, error in sorted(errors.items())))
        return [answers[index].payload for index in range(len(replies))]

    @property
    def dead(self) -> bool:
        """The engine's processes are gone (or it was shut down): nothing can be generated any more."""
        return self._llm is None or bool(self._llm.errored)

    def shutdown(self) -> None:
        if self.adapter is not None:
            self.adapter.remove()
        if self._staged is not None:
            self._staged.close(linger=0)
            self._staged_context.term()
            self._staged = None
            try:
                os.unlink(self._staged_address.removeprefix("ipc://"))
            except OSError:
                pass
        if self._llm is None:
            return
        # GPUs keep vLLM's grace: an engine killed in its teardown could leave device memory behind.
        if self.api is None or self.api.has("shutdown_timeout"):
            self._llm.shutdown(timeout=None if self.on_gpu else CPU_ENGINE_EXIT_GRACE_S)
        else:  # vLLM 0.16-0.17: its own grace
            self._llm.shutdown()
        # Drop the engine now: its __del__ would shut down again at interpreter exit,
        # when module globals are already gone.
        self._llm = None
        import gc

        gc.collect()


def cpu_kv_cache_args(kv_cache_gib: float, takes_bytes: bool) -> dict:
    """The engine arguments that give vLLM-CPU a KV cache of ``kv_cache_gib``. Its environment variable
    VLLM_CPU_KVCACHE_SPACE takes whole GiB (0.5 became 1, silently) and wins over the argument where it is set: a
    value there is left to it, and it is the only way into a vLLM without ``kv_cache_memory_bytes``."""
    if os.environ.get("VLLM_CPU_KVCACHE_SPACE"):  # empty is unset, to vLLM too
        return {}
    if takes_bytes:
        return {"kv_cache_memory_bytes": int(kv_cache_gib * 2**30)}
    whole = max(1, math.ceil(kv_cache_gib))
    if whole != kv_cache_gib:
        log.warning("rollout.engine.kv_cache_gib=%s: this vLLM takes whole GiB on the CPU, so the KV cache gets %d",
                    kv_cache_gib, whole)
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(whole)
    return {}


def labels_tokens(api: EngineApi) -> bool:
    """vLLM labels each generated token with the weight version set at the time (0.32 on)."""
    return api.has("weight_version_label") and api.has("weight_version_spans") and api.has("weight_version_span")


def v1_model_runner_needed(api: EngineApi, on_weight_update: str) -> bool:
    """Whether only vLLM's V1 model runner has what the weight updates need: V2's lacks ``reload_weights`` before
    0.22 (docs/gpu.md's matrix; V2 is opt-in there), and on a vLLM that does not label tokens by weights (before
    0.32) ``keep`` counts each request's tokens in the runner's request states, which only V1 keeps."""
    return bool(api.runner_problems("v2")) or (on_weight_update == "keep" and not labels_tokens(api))


def use_v1_model_runner(api: EngineApi, on_weight_update: str) -> None:
    """Ask vLLM for its V1 model runner (its default may be V2 from 0.22 on); one asked for by hand
    (``VLLM_USE_V2_MODEL_RUNNER=1``) is refused here, before a minute of start-up, naming why."""
    forced = os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "").strip().lower()
    if forced in ("1", "true"):
        why = api.runner_problems("v2") or [
            f"on_weight_update={on_weight_update} counts each request's tokens in V1's request states (vLLM labels "
            "tokens by weight version only from 0.32 on)"]
        raise ConfigError(f"VLLM_USE_V2_MODEL_RUNNER is set, but on vLLM {api.version} the weight updates need the V1 "
                          "model runner:\n" + "\n".join(f"  - {w}" for w in why) + "\nUnset it"
                          + (", or set rollout.engine.on_weight_update=resubmit" if not api.runner_problems("v2")
                             else ", or install vLLM 0.32 or newer"))
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")


def cache_salt(weights: tuple[int, int]) -> str:
    """The prefix-cache salt of requests generated with ``weights`` = (epoch, version)."""
    return f"w{weights[0]}.{weights[1]}"


def spans_of_request(before: int, new: int, weights: tuple[int, int],
                     switches: list[tuple[int, tuple[int, int]]]) -> list[tuple[int, int, int]]:
    """The version spans, ``(end, epoch, version)``, of the ``new`` tokens one vLLM request generated after the
    reply's first ``before``: it started under ``weights`` and was kept through the swaps in ``switches``,
    each ``(tokens the request had generated then, the weights after)``. Spans with no token are left out."""
    spans, start = [], 0
    for count, after in [*switches, (new, weights)]:
        end = min(count, new)
        if end > start:
            spans.append((before + end, *weights))
            start = end
        weights = after
    return spans


def weights_of_label(label: str) -> tuple[int, int]:
    """(epoch, version) of a weight label set by :meth:`RolloutEngine._change_keeping_requests`
    (:func:`cache_salt`'s form); vLLM's own label before the first one, "default", is the checkpoint the engine
    started from."""
    if label == "default":
        return (0, 0)
    epoch, _, version = label.removeprefix("w").partition(".")
    return (int(epoch), int(version))


def spans_of_labels(before: int, new: int, labels) -> list[tuple[int, int, int]]:
    """The version spans, ``(end, epoch, version)``, of the ``new`` tokens one vLLM request generated after the
    reply's first ``before``, from vLLM's weight labels (``CompletionOutput.weight_versions``: ``start``/``end``
    over the request's tokens, ``version`` a label). None with tokens: this vLLM did not label them."""
    if not new:
        return []
    if not labels:
        raise RuntimeError("vLLM returned tokens without weight-version labels; on_weight_update=keep cannot tell "
                           "which weights sampled them")
    if labels[-1].end != new or labels[0].start != 0:
        raise RuntimeError(f"vLLM's weight-version labels cover tokens {labels[0].start}-{labels[-1].end} of {new}")
    return [(before + span.end, *weights_of_label(span.version)) for span in labels if span.end > span.start]


def _merged(spans: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Consecutive runs of the same (epoch, version) as one (a request cut off by a join that brought the
    weights it already had)."""
    out: list[tuple[int, int, int]] = []
    for span in spans:
        if out and out[-1][1:] == span[1:]:
            out[-1] = span
        else:
            out.append(span)
    return out
