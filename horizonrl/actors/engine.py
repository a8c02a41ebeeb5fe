"""The rollout engine: the one module that calls vLLM's Python API.

vLLM upgrades rename things (weight-update RPCs, engine arguments); keeping every call
here means an upgrade touches one file. Generation is token-in/token-out: the prompt
is token ids, and the result is the generated token ids with the behaviour policy's
log-probabilities of exactly those tokens (``processed_logprobs``: after temperature,
so they match ``log_softmax(logits / T)`` computed by the learner).
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import dataclass

from horizonrl.core.config import EngineConfig
from horizonrl.core.runtime import BusyClock

log = logging.getLogger("horizonrl.actors.engine")

WORKER_EXTENSION = "horizonrl.actors.vllm_worker.WeightReceiverExtension"


@dataclass(frozen=True)
class WeightUpdate:
    version: int
    epoch: int
    receive_s: float  # inside the worker: the broadcast (waiting for the sender included)
    load_s: float  # inside the worker: loading into the model (vLLM-CPU re-packs every linear layer)
    stall_s: float  # the engine generated nothing for this long: RPC scheduling + both + prefix-cache reset


@dataclass(frozen=True)
class Generation:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (end of turn), "length" (max tokens) or "abort"


class WeightUpdateMismatch(RuntimeError):
    """The workers of one engine did not all load the same weight version: the engine is inconsistent."""


def agreed_update(results: list) -> WeightUpdate:
    """One :class:`WeightUpdate` from every worker's ``(version, epoch, receive_s, load_s, rank, error)``
    (``vllm_worker.py``): every worker must have succeeded and loaded the same (epoch, version) — a
    tensor-parallel engine whose shards come from two versions computes garbage — and the engine
    waited for the slowest (the max of the times)."""
    from horizonrl.protocol.weights import WeightSyncError

    if not results:
        raise WeightUpdateMismatch("the weight update RPC returned no worker results")
    errors = {int(r[4]): r[5] for r in results if len(r) > 5 and r[5]}
    if errors:
        raise WeightSyncError(f"weight update failed in {len(errors)} of the engine's {len(results)} workers: "
                              + "; ".join(f"worker {rank}: {error}" for rank, error in sorted(errors.items())))
    keys = {(int(r[1]), int(r[0])) for r in results}
    if len(keys) != 1:
        by_worker = {int(r[4]) if len(r) > 4 else i: (int(r[1]), int(r[0])) for i, r in enumerate(results)}
        raise WeightUpdateMismatch(f"the engine's workers loaded different weights (epoch, version): {by_worker}")
    (epoch, version), = keys
    return WeightUpdate(version, epoch, max(float(r[2]) for r in results), max(float(r[3]) for r in results), 0.0)


class RolloutEngine:
    def __init__(self, llm, on_gpu: bool) -> None:
        self._llm = llm
        self.on_gpu = on_gpu
        # Time with no request in flight: the engine's idle share (rollout/engine_idle_share).
        self.clock = BusyClock()

    @classmethod
    def start(cls, model_path: str, *, dtype: str | None, engine: EngineConfig, max_model_len: int,
              seed: int) -> "RolloutEngine":
        """Start an AsyncLLM (an EngineCore and one Worker process per tensor-parallel rank). The caller
        needs a ``if __name__ == "__main__"`` guard: vLLM spawns its processes.

        The device follows the launcher's placement (core/placement.py): it put this engine's
        ``tensor_parallel_size`` GPUs in CUDA_VISIBLE_DEVICES, or hid every GPU for a CPU plan, so the
        engine runs on what this process sees; the weight group's backend follows from that device
        the same way the learner's does (NCCL on GPUs, gloo on the CPU)."""
        import torch
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from horizonrl.actors.engine_api import check_engine_api
        from horizonrl.core.config import ConfigError
        from horizonrl.core.placement import local_device_type, visible_gpus
        from horizonrl.core.precision import resolve_engine_dtype

        check_engine_api()  # before a minute of start-up, not in the first weight update
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
        if not on_gpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(round(engine.kv_cache_gib)))))
            if tp > 1:
                # vLLM-CPU binds each tensor-parallel worker's threads to a NUMA node of its own and refuses
                # to start on a host with fewer nodes than workers; unbound threads start and load shards.
                os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        args = AsyncEngineArgs(
            model=model_path,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            max_num_seqs=engine.max_num_seqs,
            enforce_eager=engine.enforce_eager,
            enable_prefix_caching=engine.enable_prefix_caching,
            gpu_memory_utilization=engine.gpu_memory_utilization,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=WORKER_EXTENSION,
            tensor_parallel_size=tp,
            # One worker process per shard; with one shard vLLM's default (a single worker) stays.
            distributed_executor_backend="mp" if tp > 1 else None,
            disable_log_stats=True,
        )
        return cls(AsyncLLM.from_engine_args(args), on_gpu)

    async def generate(self, prompt_ids: list[int], *, max_tokens: int, temperature: float, top_p: float,
                       stop_token_ids: list[int]) -> Generation:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            temperature=temperature,
            top_p=top_p,
            max_tokens=max_tokens,
            logprobs=0,  # exactly the sampled token's logprob at each position
            stop_token_ids=stop_token_ids,
            detokenize=False,
            # One output per request, not one per token: the actor only reads the final one, and
            # per-token outputs cost the client's event loop a wake-up per token per episode.
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        final = None
        self.clock.enter()
        try:
            async for output in self._llm.generate(TokensPrompt(prompt_token_ids=prompt_ids), params,
                                                   uuid.uuid4().hex):
                final = output
        finally:
            self.clock.exit()
        completion = final.outputs[0]
        ids = list(completion.token_ids)
        logprobs = [float(pos[tok].logprob) for pos, tok in zip(completion.logprobs, ids)]
        return Generation(ids, logprobs, completion.finish_reason or "abort")

    async def join_weights(self, host: str, port: int, *, actor: int, run_id: str, timeout_s: float) -> "WeightUpdate":
        """Join (or rejoin) the learner's weight hub; the learner's newest weights are in the engine on return."""
        return await self._weight_rpc("horizonrl_join_weight_hub", timeout_s,
                                      (host, port, actor, run_id, timeout_s, "nccl" if self.on_gpu else "gloo"))

    async def receive_weights(self, timeout_s: float) -> "WeightUpdate":
        """Receive the next version the learner sends into the live engine."""
        return await self._weight_rpc("horizonrl_receive_weights", timeout_s, ())

    async def _weight_rpc(self, method: str, timeout_s: float, args: tuple) -> "WeightUpdate":
        """The receive runs inside the engine's busy loop, so generation pauses meanwhile; requests in
        flight continue afterwards under the new weights. ``collective_rpc`` runs it in every worker of
        the engine (one per tensor-parallel rank), each receiving from its own membership of the weight
        hub; all of them must report the same version (:func:`agreed_update`). A failure inside a worker
        (the learner gone, a timeout) is raised here; the worker itself carries on."""
        start = time.perf_counter()
        results = await self._llm.collective_rpc(method, timeout=timeout_s + 30, args=args)
        update = agreed_update(results)
        # Cached prefixes hold keys/values computed with the old weights. Running requests
        # are preempted and recompute theirs, so every token after this point is sampled
        # from the new weights alone.
        await self._llm.reset_prefix_cache(reset_running_requests=True)
        return WeightUpdate(update.version, update.epoch, update.receive_s, update.load_s, time.perf_counter() - start)

    @property
    def dead(self) -> bool:
        """The engine's processes are gone (or it was shut down): nothing can be generated any more."""
        return self._llm is None or bool(self._llm.errored)

    def shutdown(self) -> None:
        if self._llm is None:
            return
        self._llm.shutdown()
        # Drop the engine now: its __del__ would shut down again at interpreter exit,
        # when module globals are already gone.
        self._llm = None
        import gc

        gc.collect()
