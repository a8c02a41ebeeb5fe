"""Check the learner's GPU path on one machine: no network, no vLLM, no downloaded model.

    python scripts/gpu_check.py [--out gpu_check.json] [--tokens 512] [--no-large] [--only CHECK ...]
    python scripts/gpu_check.py --large-size 1.5B --tokens 8192 --checkpointing --only peak_memory
    python scripts/gpu_check.py --cpu [--out ...]      the parts that need no CUDA, on the CPU
    python scripts/gpu_check.py --sizing               print docs/gpu.md's sizing table and exit

Models: the tiny Qwen2 of ``horizonrl.apps.tiny_model`` and a randomly initialised model in the shape of
Qwen2.5-0.5B, or of ``--large-size`` (transformers' Qwen2Config, written to a temporary directory, loaded
the way the learner loads: meta device, sharded, rank 0 reads). Checks, each PASS / FAIL / SKIPPED with its figures:

    dtype_policy           the resolved precision policy on this device (core/precision.py)
    mixed_precision_step   FSDP2 AdamW steps at lr 1e-6 in bf16 compute: the forward ran in bf16, master
                           weights and AdamW moments are fp32, and the norm weights (exactly 1.0) moved by
                           less than bf16 can represent there yet still moved (tiny; + 0.5B on CUDA)
    activation_formula     bytes autograd saves per token, measured with saved-tensor hooks, against
                           learner/sizing.py's formula (bf16; with and without activation checkpointing)
    loss_parity            the tiny model's loss on CUDA (fp32, bf16) against the CPU's fp32      [CUDA]
    peak_memory            the large model: measured memory after load, after a step (states) and at the
                           peak of a step (``--checkpointing``: with activation checkpointing), and the
                           weight gather's extra, against learner/sizing.py                  [CUDA]
    bucket_broadcast       2 processes: bucketed gather + broadcast (learner/weight_broadcast.py's
                           gather_buckets and protocol/weight_buckets.py's plan) against one raw
                           broadcast of the same bytes, GB/s; the receiver checks every byte.
                           NCCL needs 2 GPUs (it refuses two ranks on one device); --cpu: gloo
    cuda_ipc               a CUDA tensor handed to a second process through torch.multiprocessing's
                           CUDA-IPC reductions: the receiver reads the sender's bytes, and a write by
                           the receiver is seen by the sender (shared memory, not a copy)   [CUDA]
    colocated_handoff      the one-GPU weight path: learner/weight_ipc.py sends 1 GB of bf16 (0.5B layer
                           shapes, 256 MiB buckets) over ZeroMQ + CUDA IPC to actors/weight_ipc.py in a
                           second process, which copies each tensor into its own; GB/s against one
                           device copy of the same bytes, every byte checked, and a sender whose
                           receiver is gone fails within its bound                         [CUDA]
    colocated_training     colocated mode end to end without vLLM: a learner process (the weight hub of
                           learner/weight_broadcast.py, a 0.5B model with fp32 master weights, its memory
                           capped at resources.learner_memory_fraction) and an engine process whose worker
                           is actors/vllm_worker.py's WeightReceiverExtension with a transformers model in
                           place of vLLM's; the engine joins through CUDA IPC, takes version 0, the learner
                           trains a step and publishes version 1; the engine's logits must equal the
                           learner's bf16 logits at each version; then the engine takes no more, and
                           version 2 must drop it within the hub's 3 s bound                    [CUDA]
    staging_stream         a staged receive (actors/weight_receiver.py receive_weights, in host memory through
                           one device bucket) while the default stream is busy with ~1.5 s of matmuls, as
                           both model runners compute on it: on the receiver's own stream it must finish well
                           before that work, and the same receive on the default stream (the code before) must
                           wait behind it; every byte checked. The learner is a stand-in group that copies
                           each bucket on the current stream, where NCCL orders its broadcast      [CUDA]

Prints a table; ``--out`` writes the JSON. Exit status 1 if any check FAILED (SKIPPED is not a failure).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from horizonrl.learner.sizing import GB, QWEN25, broadcast_bytes, learner_memory, sizing_table  # noqa: E402

TINY_LR = 1e-6
MEMORY_TOLERANCE = 0.15  # the bar for the sizing table against the measured peak
JOIN_TIMEOUT_S = 300.0


@dataclass
class CheckResult:
    name: str
    status: str  # PASS, FAIL, SKIPPED
    figures: dict = field(default_factory=dict)
    note: str = ""


class Skip(Exception):
    """The check cannot run here (say why)."""


@dataclass
class Context:
    device: str  # "cuda" or "cpu"
    tokens: int
    large: bool
    workdir: Path
    gpus: int
    large_size: str = "0.5B"  # a key of learner/sizing.py's QWEN25: the random model of the large checks
    checkpointing: bool = False  # peak_memory with activation checkpointing

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"


# ----------------------------------------------------------------------------------------- helpers

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_single_rank(cuda: bool) -> None:
    """A one-rank default group: FSDP2 and the learner's collectives need one. CPU tensors (metrics)
    go over gloo, CUDA tensors over NCCL, as in the learner."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                            rank=0, world_size=1, timeout=timedelta(seconds=120))


def run_process_pair(targets: list[tuple[Callable, tuple]], outputs: list[Path]) -> list[dict] | str:
    """Run each ``(function, args)`` in its own spawned process, together, killing any still running
    after ``JOIN_TIMEOUT_S``; each writes its JSON result to its ``outputs`` path (``"error"``: a
    traceback). Returns the results, or why they are missing (a hang, an error, no result file)."""
    spawn = mp.get_context("spawn")
    processes = [spawn.Process(target=function, args=args) for function, args in targets]
    for process in processes:
        process.start()
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    for process in processes:
        process.join(max(1.0, deadline - time.monotonic()))
    hung = [p.pid for p in processes if p.is_alive()]
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join(10)
    if hung:
        return f"processes {hung} did not finish in {JOIN_TIMEOUT_S:.0f} s"
    results = [json.loads(path.read_text()) if path.is_file() else {"error": "no result file"} for path in outputs]
    errors = [r["error"] for r in results if "error" in r]
    return errors[0][-2000:] if errors else results


def report_and_exit(result: dict, out_path: str) -> None:
    """A child process's end: its result as JSON at ``out_path`` for :func:`run_process_pair`, then exit
    without interpreter finalization (gloo and NCCL threads can abort it after the work is done)."""
    Path(out_path).write_text(json.dumps(result, default=str))
    sys.stdout.flush()
    os._exit(0)


def tiny_model_dir(workdir: Path) -> Path:
    from horizonrl.apps.tiny_model import build_model

    path = workdir / "tiny"
    if not (path / "model.safetensors").is_file():
        build_model(vocab_size=320, seed=0).save_pretrained(path)
    return path


def qwen_config(key: str):
    from transformers import Qwen2Config

    s = QWEN25[key]
    return Qwen2Config(vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate,
                       num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                       head_dim=s.head_dim, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=s.tied, use_sliding_window=False, dtype="float32")


def large_model_dir(workdir: Path, size: str = "0.5B") -> Path:
    """A random Qwen2.5-shaped model on disk (float32: ~2 GB for 0.5B, ~6 GB for 1.5B), built once per
    work directory."""
    import torch
    from transformers import Qwen2ForCausalLM

    path = workdir / f"qwen{size.lower()}-random"
    if not any((path / name).is_file() for name in ("model.safetensors", "model.safetensors.index.json")):
        torch.manual_seed(0)
        Qwen2ForCausalLM(qwen_config(size)).save_pretrained(path)
    return path


def precision(cuda: bool):
    from horizonrl.core.precision import resolve_precision
    from horizonrl.learner.model import flash_attn_installed

    return resolve_precision("float32", "bfloat16", "auto", None, learner_on_cuda=cuda, engine_on_gpu=cuda,
                             flash_attn_installed=flash_attn_installed())


def synthetic_samples(vocab: int, rows: int, length: int, seed: int = 0, mixed_signs: bool = True):
    """Trajectories whose every token after the first is a loss token (the sizing's upper bound).
    ``mixed_signs``: advantages +1, -1, +1, ... (a real batch); else all +1 (a loss far from 0, for
    comparing losses by their relative error)."""
    import torch

    from horizonrl.learner.batching import Sample

    generator = torch.Generator().manual_seed(seed)
    samples = []
    for row in range(rows):
        mask = torch.ones(length)
        mask[0] = 0
        samples.append(Sample(token_ids=torch.randint(0, vocab, (length,), generator=generator), loss_mask=mask,
                              behaviour_logprobs=torch.full((length,), -5.0) * mask,
                              advantage=1.0 if (row % 2 == 0 or not mixed_signs) else -1.0, group=0))
    return samples


def train_steps(model, optimizer, samples, device, steps: int = 1, micro_batch_size: int | None = None) -> None:
    from horizonrl.learner.algorithm import LossSettings, UpdateSettings, train_on_batch

    for _ in range(steps):
        train_on_batch(model, optimizer, samples, rank=0, world_size=1, settings=LossSettings(),
                       update=UpdateSettings(micro_batch_size=micro_batch_size or len(samples)), device=device)


# ------------------------------------------------------------------------------------------ checks

def check_dtype_policy(ctx: Context) -> CheckResult:
    policy = precision(ctx.cuda)
    figures = asdict(policy)
    ok = policy.param_dtype == "float32" and policy.reduce_dtype == "float32" and policy.compute_dtype == "bfloat16"
    if policy.attention == "flash_attention_2":
        ok = ok and policy.compute_dtype in ("bfloat16", "float16")
    return CheckResult("dtype_policy", "PASS" if ok else "FAIL", figures)


def _mixed_step(model_dir: Path, device, vocab: int, tokens: int) -> dict:
    import torch

    from horizonrl.learner.model import build_sharded_model, gather_full_state_dict

    model = build_sharded_model(str(model_dir), kind="policy", policy=precision(device.type == "cuda"), device=device)
    seen = {}
    model.model.layers[0].mlp.down_proj.register_forward_pre_hook(
        lambda module, args: seen.update(weight=str(module.weight.dtype), input=str(args[0].dtype)))
    before = {k: v.clone() for k, v in gather_full_state_dict(model).items() if k.endswith("norm.weight")}
    optimizer = torch.optim.AdamW(model.parameters(), lr=TINY_LR, weight_decay=0.0)
    train_steps(model, optimizer, synthetic_samples(vocab, 2, max(8, tokens // 2)), device)
    after = gather_full_state_dict(model)
    moved, below_bf16 = [], []
    for name, old in before.items():
        delta = after[name] - old
        moved.append(float((delta != 0).float().mean()))
        as_bf16 = (old.to(torch.bfloat16) + delta.to(torch.bfloat16)).float()
        below_bf16.append(bool(torch.equal(as_bf16, old.to(torch.bfloat16).float())))
    moments = {str(v.dtype) for state in optimizer.state.values() for k, v in state.items()
               if k in ("exp_avg", "exp_avg_sq")}
    figures = {
        "compute_weight_dtype": seen.get("weight"), "compute_input_dtype": seen.get("input"),
        "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}), "moment_dtypes": sorted(moments),
        "norm_weights_moved_fraction_min": min(moved), "update_below_bf16_resolution": all(below_bf16),
        "max_abs_update": max(float((after[n] - o).abs().max()) for n, o in before.items()),
    }
    del model, optimizer
    return figures


def check_mixed_precision_step(ctx: Context) -> CheckResult:
    import torch

    init_single_rank(ctx.cuda)
    device = torch.device(ctx.device)
    runs = {"tiny": _mixed_step(tiny_model_dir(ctx.workdir), device, 320, 64)}
    if ctx.cuda and ctx.large:
        runs[ctx.large_size] = _mixed_step(large_model_dir(ctx.workdir, ctx.large_size), device,
                                           QWEN25[ctx.large_size].vocab, ctx.tokens)
    ok = all(f["compute_weight_dtype"] == "torch.bfloat16" and f["compute_input_dtype"] == "torch.bfloat16"
             and f["param_dtypes"] == ["torch.float32"] and f["moment_dtypes"] == ["torch.float32"]
             and f["norm_weights_moved_fraction_min"] > 0.9 and f["update_below_bf16_resolution"]
             for f in runs.values())
    note = "" if (ctx.cuda and ctx.large) else "tiny model only" + ("" if ctx.cuda else " (gloo on the CPU)")
    return CheckResult("mixed_precision_step", "PASS" if ok else "FAIL", runs, note)


def saved_bytes_per_token(config, tokens: int, checkpointing: bool, device) -> float:
    """Bytes autograd keeps from forward to backward (distinct storages, parameters excluded) per
    token, for the model's trunk in bf16: what sizing's ``stored_activation_bytes`` predicts (the
    layer recomputed under checkpointing exists only inside backward and is not counted here)."""
    import torch
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(device=device, dtype=torch.bfloat16)
    model.train()
    if checkpointing:
        model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def keep(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    input_ids = torch.randint(0, config.vocab_size, (1, tokens), device=device)
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        hidden = model.model(input_ids=input_ids, use_cache=False).last_hidden_state
    del model, hidden
    return sum(storages.values()) / tokens


def check_activation_formula(ctx: Context) -> CheckResult:
    import torch
    from transformers import Qwen2Config

    from horizonrl.learner.sizing import ModelShape

    shapes = {"tiny": ModelShape("tiny", 320, 128, 256, 2, 2, 1, 64, True),
              "mid": ModelShape("mid", 1000, 512, 1408, 4, 8, 2, 64, True)}
    if ctx.cuda and ctx.large:
        shapes[ctx.large_size] = QWEN25[ctx.large_size]
    device = torch.device(ctx.device)
    figures, ok = {}, True
    for key, shape in shapes.items():
        config = Qwen2Config(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                             num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                             num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
                             tie_word_embeddings=shape.tied, attn_implementation="sdpa")
        for checkpointing in (False, True):
            measured = saved_bytes_per_token(config, 256, checkpointing, device)
            predicted = shape.stored_activation_bytes(checkpointing)
            error = abs(measured - predicted) / predicted
            ok = ok and error <= MEMORY_TOLERANCE
            figures[f"{key}{'/ac' if checkpointing else ''}"] = {
                "measured_bytes_per_token": round(measured), "formula_bytes_per_token": predicted,
                "relative_error": round(error, 4)}
    return CheckResult("activation_formula", "PASS" if ok else "FAIL", figures,
                       "saved tensors of the trunk; the logits term is not measured here")


def check_loss_parity(ctx: Context) -> CheckResult:
    if not ctx.cuda:
        raise Skip("needs CUDA")
    import torch

    from horizonrl.learner.batching import collate
    from horizonrl.learner.model import load_model
    from horizonrl.learner.algorithm import LossSettings, micro_batch_loss

    micro = collate(synthetic_samples(320, 4, 48, seed=1, mixed_signs=False))
    losses = {}
    for label, device, dtype in (("cpu_fp32", "cpu", torch.float32), ("cuda_fp32", "cuda", torch.float32),
                                 ("cuda_bf16", "cuda", torch.bfloat16)):
        model = load_model(str(tiny_model_dir(ctx.workdir)), "float32", torch.device(device))
        model = model.to(device=device, dtype=dtype)
        with torch.no_grad():
            loss, _ = micro_batch_loss(model, micro.to(torch.device(device)), LossSettings(),
                                       int(micro.loss_mask.sum()), micro.num_sequences)
        losses[label] = float(loss)
    reference = losses["cpu_fp32"]
    fp32_error = abs(losses["cuda_fp32"] - reference) / abs(reference)
    bf16_error = abs(losses["cuda_bf16"] - reference) / abs(reference)
    ok = fp32_error < 1e-4 and bf16_error < 2e-2
    return CheckResult("loss_parity", "PASS" if ok else "FAIL",
                       {**losses, "fp32_relative_error": fp32_error, "bf16_relative_error": bf16_error},
                       "bounds: fp32 1e-4, bf16 2e-2 (relative)")


def check_peak_memory(ctx: Context) -> CheckResult:
    if not ctx.cuda:
        raise Skip("needs CUDA")
    if not ctx.large:
        raise Skip("--no-large")
    import torch

    from horizonrl.learner.model import build_sharded_model, weights_to_send
    from horizonrl.protocol.weight_buckets import plan_buckets
    from horizonrl.learner.weight_gather import gather_buckets, layout_of

    init_single_rank(True)
    device = torch.device("cuda")
    shape = QWEN25[ctx.large_size]
    path = large_model_dir(ctx.workdir, ctx.large_size)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    model = build_sharded_model(str(path), kind="policy", policy=precision(True), device=device,
                                activation_checkpointing=ctx.checkpointing)
    torch.cuda.synchronize()
    loaded = torch.cuda.memory_allocated() - base
    optimizer = torch.optim.AdamW(model.parameters(), lr=TINY_LR, weight_decay=0.0)
    # Two micro-batches of ``tokens`` each: the second runs with the first one's gradients allocated,
    # as every micro-batch after the first of an update does (the sizing's forward/backward term).
    samples = synthetic_samples(shape.vocab, 2, ctx.tokens)
    train_steps(model, optimizer, samples, device, micro_batch_size=1)  # creates gradients and AdamW state
    torch.cuda.synchronize()
    states = torch.cuda.memory_allocated() - base
    torch.cuda.reset_peak_memory_stats()
    train_steps(model, optimizer, samples, device, micro_batch_size=1)
    torch.cuda.synchronize()
    step_peak = torch.cuda.max_memory_allocated() - base

    bucket_bytes = 256 << 20
    named = weights_to_send(model.config, dict(model.state_dict()))
    names, dtypes, shapes = layout_of(named, torch.bfloat16)
    plan = plan_buckets(names, dtypes, shapes, bucket_bytes)
    before_gather = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for _ in gather_buckets(named, plan, device=device, fill=True):
        pass
    torch.cuda.synchronize()
    gather_extra = torch.cuda.max_memory_allocated() - before_gather

    predicted = learner_memory(shape, world_size=1, tokens=ctx.tokens, checkpointing=ctx.checkpointing)
    predicted_gather = broadcast_bytes(shape, 1, bucket_bytes)
    rows = {
        "after_load": (loaded, predicted.params),
        "states_after_step": (states, predicted.states),
        "step_peak": (step_peak, predicted.peak),
        "weight_gather_extra": (gather_extra, predicted_gather),
    }
    figures, ok = {"tokens_per_micro_batch": ctx.tokens, "activation_checkpointing": ctx.checkpointing}, True
    for name, (measured, formula) in rows.items():
        error = abs(measured - formula) / formula
        figures[name] = {"measured_gb": round(measured / GB, 3), "formula_gb": round(formula / GB, 3),
                         "relative_error": round(error, 4)}
        ok = ok and error <= MEMORY_TOLERANCE
    del model, optimizer
    torch.cuda.empty_cache()
    return CheckResult("peak_memory", "PASS" if ok else "FAIL", figures,
                       f"{ctx.large_size} random, W=1, bf16 compute, AdamW (foreach), "
                       f"activation checkpointing {'on' if ctx.checkpointing else 'off'}; bound {MEMORY_TOLERANCE:.0%}")


def _broadcast_layout(total_bytes: int) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of 0.5B-shaped decoder layers (bf16) adding up to about ``total_bytes``."""
    s = QWEN25["0.5B"]
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    layer = [("self_attn.q_proj.weight", (q, s.hidden)), ("self_attn.k_proj.weight", (kv, s.hidden)),
             ("self_attn.v_proj.weight", (kv, s.hidden)), ("self_attn.o_proj.weight", (s.hidden, q)),
             ("mlp.gate_proj.weight", (s.intermediate, s.hidden)), ("mlp.up_proj.weight", (s.intermediate, s.hidden)),
             ("mlp.down_proj.weight", (s.hidden, s.intermediate)), ("input_layernorm.weight", (s.hidden,))]
    out, size, index = [], 0, 0
    while size < total_bytes:
        for name, shape in layer:
            out.append((f"model.layers.{index}.{name}", shape))
            numel = 1
            for d in shape:
                numel *= d
            size += 2 * numel
        index += 1
    return out


def _tensor_for(name: str, shape, device):
    """Deterministic content from the name alone, so the receiver can check every byte it got."""
    import torch
    import zlib

    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(shape, generator=generator).to(device=device, dtype=torch.bfloat16)


def _broadcast_rank(rank: int, port: int, backend: str, total_bytes: int, bucket_bytes: int, repeats: int,
                    out_path: str) -> None:
    import torch
    import torch.distributed as dist

    result = {}
    try:
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        if backend == "nccl":
            torch.cuda.set_device(rank)
        else:
            # Two ranks share the host's cores: with several threads each, torch's CPU copies were 25x
            # slower here (spinning threads), which would time the contention, not the transfer.
            torch.set_num_threads(1)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=timedelta(seconds=120))
        layout = _broadcast_layout(total_bytes)
        try:
            from horizonrl.learner.weight_gather import gather_buckets
            from horizonrl.protocol.weight_buckets import plan_buckets
            api = "horizonrl.learner.weight_gather.gather_buckets + protocol.weight_buckets.plan_buckets"
        except ImportError:  # an older tree: a local equivalent (one buffer, tensors packed in order)
            gather_buckets = plan_buckets = None
            api = "local equivalent"
        names = [n for n, _ in layout]
        shapes = [list(s) for _, s in layout]
        dtypes = ["bfloat16"] * len(layout)
        named = [(n, _tensor_for(n, s, device)) for n, s in layout] if rank == 0 else []
        plan = plan_buckets(names, dtypes, shapes, bucket_bytes) if plan_buckets else None
        nbytes = sum(b.nbytes for b in plan) if plan else sum(2 * t.numel() for _, t in named)

        def sync():
            if device.type == "cuda":
                torch.cuda.synchronize()

        # The receiver keeps its buffers across versions, as an engine's receiver would; allocating them
        # per version would time the allocator (on the CPU: page faults of fresh memory), not the transfer.
        receive_buffers = [torch.zeros(b.nbytes, dtype=torch.uint8, device=device) for b in plan] if rank else []

        def bucketed() -> list[torch.Tensor]:
            if rank == 0:
                for bucket in gather_buckets(named, plan, device=device, fill=True):
                    dist.broadcast(bucket, src=0)
            else:
                for buffer in receive_buffers:
                    dist.broadcast(buffer, src=0)
            return receive_buffers

        flat = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        timings = {"bucketed_s": [], "raw_s": []}
        received = []
        for _ in range(repeats):
            dist.barrier()
            sync()
            start = time.perf_counter()
            received = bucketed()
            sync()
            timings["bucketed_s"].append(time.perf_counter() - start)
            dist.barrier()
            sync()
            start = time.perf_counter()
            dist.broadcast(flat, src=0)
            sync()
            timings["raw_s"].append(time.perf_counter() - start)
        if rank == 1:  # every byte as the sender made it
            mismatched = []
            for bucket, buffer in zip(plan, received):
                for entry in bucket.entries:
                    got = buffer[entry.offset: entry.offset + entry.nbytes].view(torch.bfloat16).view(entry.shape)
                    if not torch.equal(got, _tensor_for(entry.name, entry.shape, device)):
                        mismatched.append(entry.name)
            result["mismatched"] = mismatched
        best_bucketed, best_raw = min(timings["bucketed_s"]), min(timings["raw_s"])
        result.update(api=api, backend=backend, bytes=nbytes, buckets=len(plan), bucket_bytes=bucket_bytes,
                      bucketed_gb_s=nbytes / best_bucketed / GB, raw_gb_s=nbytes / best_raw / GB,
                      bucketed_s=best_bucketed, raw_s=best_raw)
        dist.barrier()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - reported to the parent
        result["error"] = traceback.format_exc()
    report_and_exit(result, out_path)


def check_bucket_broadcast(ctx: Context) -> CheckResult:
    if ctx.cuda and ctx.gpus < 2:
        raise Skip("NCCL needs 2 GPUs for a sender and a receiver (it rejects two ranks on one device); "
                   "see peak_memory's weight_gather_extra for the gather on one GPU")
    backend = "nccl" if ctx.cuda else "gloo"
    total = (1 << 30) if ctx.cuda else (48 << 20)
    bucket = (256 << 20) if ctx.cuda else (16 << 20)
    port = free_port()
    outputs = [ctx.workdir / f"broadcast_{rank}.json" for rank in range(2)]
    results = run_process_pair([(_broadcast_rank, (rank, port, backend, total, bucket, 3, str(outputs[rank])))
                                for rank in range(2)], outputs)
    if isinstance(results, str):
        return CheckResult("bucket_broadcast", "FAIL", {}, results)
    sender, receiver = results
    figures = {k: sender[k] for k in ("api", "backend", "bytes", "buckets", "bucket_bytes")}
    figures.update(sender_bucketed_gb_s=round(sender["bucketed_gb_s"], 3), sender_raw_gb_s=round(sender["raw_gb_s"], 3),
                   receiver_bucketed_gb_s=round(receiver["bucketed_gb_s"], 3),
                   receiver_raw_gb_s=round(receiver["raw_gb_s"], 3),
                   bucketed_over_raw=round(receiver["bucketed_s"] / receiver["raw_s"], 3),
                   mismatched_tensors=len(receiver["mismatched"]))
    ok = not receiver["mismatched"]
    return CheckResult("bucket_broadcast", "PASS" if ok else "FAIL", figures,
                       "bf16 tensors in 0.5B layer shapes; best of 3; the receiver compared every tensor")


def _ipc_receiver(queue, answers) -> None:
    import torch

    try:
        tensor = queue.get(timeout=60)  # rebuilt from the sender's CUDA-IPC handle: the same device memory
        expected = torch.arange(tensor.numel(), device=tensor.device, dtype=torch.int64).remainder(251).to(torch.uint8)
        same = bool(torch.equal(tensor, expected))
        tensor[:16].fill_(7)  # the sender must see this if the memory is shared
        torch.cuda.synchronize()
        answers.put({"same_bytes": same, "nbytes": tensor.numel()})
        queue.get(timeout=60)  # keep the handle open until the sender has looked
    except Exception:  # noqa: BLE001 - reported to the parent
        answers.put({"error": traceback.format_exc()})


def check_cuda_ipc(ctx: Context) -> CheckResult:
    if not ctx.cuda:
        raise Skip("needs CUDA")
    import torch
    import torch.multiprocessing as tmp

    spawn = tmp.get_context("spawn")
    queue, answers = spawn.Queue(), spawn.Queue()
    receiver = spawn.Process(target=_ipc_receiver, args=(queue, answers))
    receiver.start()
    try:
        nbytes = 256 << 20
        tensor = torch.arange(nbytes, device="cuda", dtype=torch.int64).remainder(251).to(torch.uint8)
        torch.cuda.synchronize()
        start = time.perf_counter()
        queue.put(tensor)
        answer = answers.get(timeout=120)
        handoff_s = time.perf_counter() - start
        if "error" in answer:
            return CheckResult("cuda_ipc", "FAIL", {}, answer["error"][-2000:])
        torch.cuda.synchronize()
        shared = bool((tensor[:16] == 7).all())
        queue.put("done")
        receiver.join(60)
        figures = {"nbytes": nbytes, "receiver_saw_sender_bytes": answer["same_bytes"],
                   "sender_saw_receiver_write": shared, "handoff_and_check_s": round(handoff_s, 4)}
        ok = answer["same_bytes"] and shared
        return CheckResult("cuda_ipc", "PASS" if ok else "FAIL", figures, "torch.multiprocessing CUDA-IPC, one GPU")
    finally:
        if receiver.is_alive():
            receiver.kill()
            receiver.join(10)


def _colocated_sender(port: int, total_bytes: int, bucket_bytes: int, repeats: int, out_path: str) -> None:
    """The learner's side: learner/weight_ipc.py's send_version_over_ipc, the bytes of 0.5B layer shapes."""
    import torch
    import zmq

    from horizonrl.learner.weight_ipc import send_version_over_ipc
    from horizonrl.protocol.messages import WeightLayout
    from horizonrl.protocol.transport import make_socket
    from horizonrl.protocol.weight_buckets import plan_buckets
    from horizonrl.protocol.weights import WeightSyncError

    result = {}
    context = zmq.Context()
    sock = make_socket(context, zmq.PAIR, server=True)
    try:
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
        sock.bind(f"tcp://127.0.0.1:{port}")
        layout = _broadcast_layout(total_bytes)
        named = [(n, _tensor_for(n, shape, device)) for n, shape in layout]
        names, shapes = [n for n, _ in layout], [list(shape) for _, shape in layout]
        dtypes = ["bfloat16"] * len(names)
        plan = plan_buckets(names, dtypes, shapes, bucket_bytes)
        nbytes = sum(bucket.nbytes for bucket in plan)

        def version(number: int) -> WeightLayout:
            return WeightLayout(run_id="gpu-check", version=number, epoch=0, names=names, dtypes=dtypes, shapes=shapes,
                                total_bytes=nbytes)

        seconds = [send_version_over_ipc(sock, named, version(v), bucket_bytes=bucket_bytes, device=device,
                                         timeout_s=120.0) for v in range(repeats)]
        # The reference: one device-to-device copy of the same bytes in one process (what loading costs
        # at least, with no handoff at all).
        source = torch.empty(nbytes, dtype=torch.uint8, device=device)
        target = torch.empty_like(source)
        copies = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            start = time.perf_counter()
            target.copy_(source)
            torch.cuda.synchronize()
            copies.append(time.perf_counter() - start)
        # The receiver has gone (it exits after the last version): the next send must fail, within its bound.
        bound = 3.0
        start = time.perf_counter()
        try:
            send_version_over_ipc(sock, named, version(repeats), bucket_bytes=bucket_bytes, device=device,
                                  timeout_s=bound)
            result["dead_receiver"] = {"raised": False}
        except WeightSyncError as exc:
            result["dead_receiver"] = {"raised": True, "after_s": round(time.perf_counter() - start, 2),
                                       "bound_s": bound, "error": str(exc)}
        result.update(bytes=nbytes, buckets=len(plan), bucket_bytes=bucket_bytes, version_s=seconds,
                      copy_s=min(copies))
    except Exception:  # noqa: BLE001 - reported to the parent
        result["error"] = traceback.format_exc()
    finally:
        sock.close()
        context.term()
    report_and_exit(result, out_path)


def _colocated_receiver(port: int, repeats: int, out_path: str) -> None:
    """The engine's side: actors/weight_ipc.py's stream, each tensor copied into the 'model' (as a loader does)."""
    import torch
    import zmq

    from horizonrl.actors.weight_ipc import MappedBuffer, open_ipc_weight_stream
    from horizonrl.protocol.transport import make_socket

    result = {}
    context = zmq.Context()
    sock = make_socket(context, zmq.PAIR)
    try:
        torch.cuda.set_device(0)
        sock.connect(f"tcp://127.0.0.1:{port}")
        model: dict[str, torch.Tensor] = {}
        mapped = MappedBuffer()  # one mapping per export of the sender's buffer (actors/weight_ipc.py says why)
        for _ in range(repeats):
            stream = open_ipc_weight_stream(sock, run_id="gpu-check", timeout_s=120.0, mapped=mapped)
            for name, tensor in stream:
                if name not in model:
                    model[name] = torch.empty_like(tensor)
                model[name].copy_(tensor)
            stream.finish()
        result["mismatched"] = [name for name, tensor in model.items()
                                if not torch.equal(tensor, _tensor_for(name, tuple(tensor.shape), tensor.device))]
        result["tensors"] = len(model)
        result["mappings_opened"] = mapped.opened  # 1: the sender exported its buffer once
    except Exception:  # noqa: BLE001 - reported to the parent
        result["error"] = traceback.format_exc()
    finally:
        sock.close()
        context.term()
    report_and_exit(result, out_path)


def check_colocated_handoff(ctx: Context) -> CheckResult:
    """The colocated weight path (one GPU): learner/weight_ipc.py -> actors/weight_ipc.py over a real ZeroMQ
    socket and CUDA IPC, 1 GB of bf16 in 256 MiB buckets, every byte checked; then the receiver is gone
    and the sender must fail within its 3 s bound."""
    if not ctx.cuda:
        raise Skip("needs CUDA")
    port = free_port()
    repeats = 3
    outputs = [ctx.workdir / f"colocated_{side}.json" for side in ("sender", "receiver")]
    results = run_process_pair([(_colocated_sender, (port, 1 << 30, 256 << 20, repeats, str(outputs[0]))),
                                (_colocated_receiver, (port, repeats, str(outputs[1])))], outputs)
    if isinstance(results, str):
        return CheckResult("colocated_handoff", "FAIL", {}, results)
    sender, receiver = results
    best = min(sender["version_s"])
    figures = {"bytes": sender["bytes"], "buckets": sender["buckets"], "bucket_bytes": sender["bucket_bytes"],
               "version_s": [round(t, 4) for t in sender["version_s"]],
               "handoff_gb_s": round(sender["bytes"] / best / GB, 2),
               "one_copy_gb_s": round(sender["bytes"] / sender["copy_s"] / GB, 2),
               "handoff_over_one_copy": round(best / sender["copy_s"], 2), "tensors": receiver["tensors"],
               "mismatched_tensors": len(receiver["mismatched"]), "dead_receiver": sender["dead_receiver"],
               "mappings_opened": receiver["mappings_opened"]}
    dead = sender["dead_receiver"]
    # one mapping for the three versions: the sender exported its buffer once (the CUDA-IPC reference count)
    ok = (not receiver["mismatched"] and dead["raised"] and dead["after_s"] <= dead["bound_s"] + 5
          and receiver["mappings_opened"] == 1)
    return CheckResult("colocated_handoff", "PASS" if ok else "FAIL", figures,
                       "learner/weight_ipc.py -> actors/weight_ipc.py, best of 3 versions; every tensor compared")


PROMPT_TOKENS = 48


def _prompt(vocab: int, device):
    import torch

    return (torch.arange(PROMPT_TOKENS, device=device) * 7919 % vocab).unsqueeze(0)


def _colocated_learner(model_dir: str, port: int, fraction: float, out_path: str) -> None:
    """The learner's side: a weight hub with the engine joining through CUDA IPC; version 0, a step, version 1."""
    import torch
    from transformers import AutoModelForCausalLM

    from horizonrl.learner.model import weights_to_send
    from horizonrl.learner.weight_broadcast import WeightHub

    result: dict = {}
    hub = None
    try:
        torch.cuda.set_device(0)
        torch.cuda.set_per_process_memory_fraction(fraction, 0)  # as the learner does when colocated
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda()
        vocab = model.config.vocab_size
        hub = WeightHub("127.0.0.1", port, backend="nccl", timeout_s=120.0, run_id="gpu-check")
        # What the engine should compute: a bf16 model built as the engine builds its own, holding the learner's
        # weights cast to bf16.
        reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda()
        reference_params = dict(reference.named_parameters())

        def publish(version: int) -> dict:
            named = weights_to_send(model.config, model.state_dict())
            stats = hub.publish(version, 0, named, dtype=torch.bfloat16)
            with torch.no_grad():
                for name, parameter in model.named_parameters():
                    reference_params[name].copy_(parameter)
                torch.save(reference(_prompt(vocab, "cuda")).logits.float().cpu(), f"{out_path}.v{version}.pt")
            return stats

        publish(0)
        hub.start()
        deadline = time.monotonic() + 240
        while not hub.members and time.monotonic() < deadline:
            time.sleep(0.2)
        if not hub.members:
            raise RuntimeError(f"the engine did not join within 240 s (hub counters {dict(hub.counters)})")
        member = next(iter(hub.members.values()))
        result["link"] = type(member.link).__name__
        # One AdamW step (fp32 master weights) at a large lr, so that version 1 visibly differs from version 0.
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = torch.randint(0, vocab, (2, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        stats = publish(1)
        result.update(version1=stats, peak_gb=round(torch.cuda.max_memory_allocated() / GB, 3),
                      cap_gb=round(fraction * torch.cuda.get_device_properties(0).total_memory / GB, 1))
        # The engine takes no version after 1 (it exits): version 2 must drop it within the hub's bound, and
        # the learner goes on.
        hub.timeout_s = bound = 3.0
        start = time.perf_counter()
        stats = hub.publish(2, 0, weights_to_send(model.config, model.state_dict()), dtype=torch.bfloat16)
        result["silent_engine"] = {"dropped": stats["dropped"], "after_s": round(time.perf_counter() - start, 2),
                                   "bound_s": bound, "members_left": len(hub.members)}
        result["counters"] = dict(hub.counters)
    except Exception:  # noqa: BLE001 - reported to the parent
        result["error"] = traceback.format_exc()
    finally:
        if hub is not None:
            hub.close()
    report_and_exit(result, out_path)


def _colocated_engine(model_dir: str, port: int, out_path: str) -> None:
    """The engine's side: vllm_worker.py's WeightReceiverExtension, loading into a transformers model."""
    import torch
    from transformers import AutoModelForCausalLM

    from horizonrl.actors.vllm_worker import WeightReceiverExtension

    result: dict = {}
    try:
        torch.cuda.set_device(0)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda()
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.zero_()  # whatever the engine computes from here on came through the hub
        params = dict(model.named_parameters())

        class TransformersWorker(WeightReceiverExtension):
            """vLLM's Worker stand-in: its reload_weights copies each received tensor into the model."""

            rank = 0

            class model_runner:  # noqa: N801 - the attribute path vllm_worker.py reads
                @staticmethod
                def get_model():
                    return model

            def reload_weights(self, weights_iterator, is_checkpoint_format=True):
                loaded = 0
                with torch.no_grad():
                    for name, tensor in weights_iterator:
                        if name in params:
                            params[name].copy_(tensor)
                            loaded += 1
                result.setdefault("loaded_tensors", []).append(loaded)

        worker = TransformersWorker()
        replies = [worker.horizonrl_join_weight_hub("127.0.0.1", port, 0, "gpu-check", 120.0, "cuda_ipc")]
        with torch.no_grad():
            torch.save(model(_prompt(model.config.vocab_size, "cuda")).logits.float().cpu(), f"{out_path}.v0.pt")
        replies.append(worker.horizonrl_receive_weights())
        with torch.no_grad():
            torch.save(model(_prompt(model.config.vocab_size, "cuda")).logits.float().cpu(), f"{out_path}.v1.pt")
        result["replies"] = replies  # WorkerReply wire forms (protocol/worker_replies.py)
        worker._horizonrl_receiver.close()
    except Exception:  # noqa: BLE001 - reported to the parent
        result["error"] = traceback.format_exc()
    report_and_exit(result, out_path)


def check_colocated_training(ctx: Context) -> CheckResult:
    """Colocated mode's weight path as `horizonrl train` wires it, with transformers in vLLM's place."""
    if not ctx.cuda:
        raise Skip("needs CUDA")
    import torch

    model_dir = large_model_dir(ctx.workdir) if ctx.large else tiny_model_dir(ctx.workdir)
    port = free_port()
    outputs = [ctx.workdir / f"colocated_training_{side}.json" for side in ("learner", "engine")]
    results = run_process_pair([(_colocated_learner, (str(model_dir), port, 0.4, str(outputs[0]))),
                                (_colocated_engine, (str(model_dir), port, str(outputs[1])))], outputs)
    if isinstance(results, str):
        return CheckResult("colocated_training", "FAIL", {}, results)
    learner, engine = results
    logits = {side: [torch.load(f"{path}.v{v}.pt") for v in (0, 1)] for side, path in zip(("learner", "engine"),
                                                                                       outputs)}
    differences = [float((logits["engine"][v] - logits["learner"][v]).abs().max()) for v in (0, 1)]
    moved = float((logits["learner"][1] - logits["learner"][0]).abs().max())
    from horizonrl.protocol.worker_replies import WorkerReply

    replies = [WorkerReply.from_wire(reply) for reply in engine["replies"]]
    errors = [reply.error for reply in replies if reply.error]
    figures = {"model": model_dir.name, "link": learner["link"], "engine_replies": engine["replies"],
               "loaded_tensors": engine["loaded_tensors"], "max_abs_logit_diff_v0_v1": differences,
               "logits_moved_by_the_step": moved, "version1_publish": learner["version1"],
               "learner_peak_gb": learner["peak_gb"], "learner_cap_gb": learner["cap_gb"],
               "silent_engine": learner["silent_engine"]}
    silent = learner["silent_engine"]
    ok = (not errors and learner["link"] == "IpcSender" and [r.version for r in replies] == [0, 1]
          and max(differences) <= 1e-3 * max(1.0, moved) and moved > 0
          and silent["dropped"] == 1 and silent["members_left"] == 0 and silent["after_s"] <= silent["bound_s"] + 5)
    return CheckResult("colocated_training", "PASS" if ok else "FAIL", figures,
                       "engine logits equal the learner's bf16 logits at versions 0 and 1" if ok else "; ".join(errors))


class _DeviceDone:
    def wait(self, timeout=None) -> bool:
        return True


class _StreamOrderedGroup:
    """The learner's side of one version for a receiver on this GPU: each broadcast copies the next tensor into the
    receiver's on the stream current at the call, which is where NCCL orders a collective (its stream waits for
    that one)."""

    def __init__(self, tensors) -> None:
        self.pending = list(tensors)

    def broadcast(self, tensors, options) -> _DeviceDone:
        tensors[0].copy_(self.pending.pop(0), non_blocking=True)
        return _DeviceDone()

    def allreduce(self, tensors, options) -> _DeviceDone:
        tensors[0].fill_(1)
        return _DeviceDone()


def _staged_receive_while_busy(own_stream: bool, packed, busy_steps: int) -> dict:
    """Queue ``busy_steps`` matmuls on the default stream (an engine's generation step), then receive ``packed``
    in host memory from a thread; how long the receive took and how long the default stream's work did."""
    import threading

    import torch

    from horizonrl.actors import weight_receiver
    from horizonrl.actors.weight_receiver import WeightReceiver

    device = torch.device("cuda", 0)
    header = torch.tensor([len(packed.layout_bytes), packed.bucket_bytes], dtype=torch.int64, device=device)
    layout = torch.frombuffer(bytearray(packed.layout_bytes), dtype=torch.uint8).to(device)
    sources = [header, layout, *(bucket.to(device) for bucket in packed.buckets)]
    receiver = WeightReceiver(1, "nccl", 60.0, _StreamOrderedGroup(sources), store=None, stage_in_host=True)
    receiver.formed = True  # no communicator to form: the stand-in group has none
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    out: dict = {}

    def receive() -> None:
        torch.cuda.set_device(device)
        start = time.perf_counter()
        if own_stream:
            _, named = weight_receiver.receive_weights(receiver, in_host=True)
        else:  # the code before: the default stream, a synchronous copy
            _, named = weight_receiver._receive_whole(receiver, True, None)
        out["receive_s"] = time.perf_counter() - start
        out["named"] = named

    start = time.perf_counter()
    for _ in range(busy_steps):
        a = (a @ a).clamp_(-1, 1)
    thread = threading.Thread(target=receive)
    thread.start()
    thread.join(120)
    torch.cuda.current_stream(device).synchronize()
    out["busy_s"] = time.perf_counter() - start
    return out


def check_staging_stream(ctx: Context) -> CheckResult:
    """Item 2 of issue 56: a staged receive must not wait behind the engine's generation on the default stream."""
    if not ctx.cuda:
        raise Skip("needs CUDA")
    import torch

    from horizonrl.learner.weight_broadcast import WeightHub

    named = [(f"layer.{i}.weight", torch.randn(2048, 2048, dtype=torch.bfloat16)) for i in range(16)]  # 128 MiB
    hub = WeightHub("127.0.0.1", 0, backend="gloo", timeout_s=5, run_id="gpu-check", bucket_bytes=32 << 20)
    try:
        packed = hub.pack(1, named)
    finally:
        hub.close()
    # About 1.5 s of matmuls on this GPU: time 20 of them first.
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        a = (a @ a).clamp_(-1, 1)
    torch.cuda.synchronize()
    steps = max(20, int(20 * 1.5 / (time.perf_counter() - start)))
    runs = {mode: _staged_receive_while_busy(mode == "own_stream", packed, steps) for mode in ("own_stream", "default")}
    exact = all(torch.equal(got, sent) for mode in runs for (_, got), (_, sent) in zip(runs[mode]["named"], named))
    figures = {mode: {"receive_s": round(r["receive_s"], 3), "default_stream_busy_s": round(r["busy_s"], 3)}
               for mode, r in runs.items()}
    figures.update(buckets=len(packed.plan), bytes=packed.nbytes, busy_steps=steps, exact=exact)
    own, default = runs["own_stream"], runs["default"]
    ok = exact and own["receive_s"] < 0.5 * own["busy_s"] and default["receive_s"] >= 0.8 * default["busy_s"]
    return CheckResult("staging_stream", "PASS" if ok else "FAIL", figures,
                       "the staged receive overlaps the default stream's work; on the default stream it waited")


CHECKS: list[Callable[[Context], CheckResult]] = [
    check_dtype_policy, check_mixed_precision_step, check_activation_formula, check_loss_parity, check_peak_memory,
    check_bucket_broadcast, check_cuda_ipc, check_colocated_handoff, check_colocated_training, check_staging_stream,
]


def run_checks(ctx: Context, checks: list[Callable[[Context], CheckResult]]) -> list[CheckResult]:
    results = []
    for check in checks:
        name = check.__name__.removeprefix("check_")
        start = time.perf_counter()
        try:
            result = check(ctx)
        except Skip as reason:
            result = CheckResult(name, "SKIPPED", note=str(reason))
        except Exception:  # noqa: BLE001 - one failing check must not hide the others
            result = CheckResult(name, "FAIL", note=traceback.format_exc()[-3000:])
        result.figures["seconds"] = round(time.perf_counter() - start, 2)
        print(f"{result.name:22s} {result.status:8s} {result.note.splitlines()[-1] if result.note else ''}", flush=True)
        results.append(result)
    return results


def print_table(results: list[CheckResult]) -> None:
    print("\n| check | status | figures |\n|---|---|---|")
    for result in results:
        figures = json.dumps(result.figures, default=str)
        print(f"| {result.name} | {result.status} | {figures if len(figures) < 400 else figures[:400] + '…'} |")


def describe_device(cuda: bool) -> dict:
    import torch

    out = {"torch": torch.__version__, "python": platform.python_version(), "host_cpus": os.cpu_count()}
    if cuda:
        out.update(gpu=torch.cuda.get_device_name(0), gpus=torch.cuda.device_count(),
                   gpu_memory_gb=round(torch.cuda.get_device_properties(0).total_memory / GB, 1),
                   cuda=torch.version.cuda)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="run on the CPU; checks that need CUDA are SKIPPED")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--tokens", type=int, default=512,
                        help="padded tokens per micro-batch of the large model's steps")
    parser.add_argument("--no-large", action="store_true", help="leave out the large random model")
    parser.add_argument("--large-size", default="0.5B", choices=["0.5B", "1.5B", "7B"],
                        help="the Qwen2.5 shape of the large random model (7B: ~28 GB on disk, minutes to build)")
    parser.add_argument("--checkpointing", action="store_true", help="peak_memory with activation checkpointing")
    parser.add_argument("--only", nargs="*", help="run only these checks (names as printed)")
    parser.add_argument("--sizing", action="store_true", help="print the sizing table (docs/gpu.md) and exit")
    parser.add_argument("--workdir", type=Path, help="where the models are written (default: a temporary directory)")
    args = parser.parse_args(argv)
    if args.sizing:
        print(sizing_table())
        return 0

    import torch

    cuda = not args.cpu
    if cuda and not torch.cuda.is_available():
        print("no CUDA device here: run with --cpu for the CPU checks", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as scratch:
        workdir = args.workdir or Path(scratch)
        workdir.mkdir(parents=True, exist_ok=True)
        ctx = Context(device="cuda" if cuda else "cpu", tokens=args.tokens, large=not args.no_large, workdir=workdir,
                      gpus=torch.cuda.device_count() if cuda else 0, large_size=args.large_size,
                      checkpointing=args.checkpointing)
        checks = [c for c in CHECKS if not args.only or c.__name__.removeprefix("check_") in args.only]
        results = run_checks(ctx, checks)
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    print_table(results)
    failed = [r.name for r in results if r.status == "FAIL"]
    report = {"device": describe_device(cuda), "mode": "cuda" if cuda else "cpu",
              "checks": [asdict(r) for r in results], "failed": failed}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1, default=str))
    counts = {status: sum(r.status == status for r in results) for status in ("PASS", "SKIPPED", "FAIL")}
    print(f"\n{counts['PASS']} passed, {counts['SKIPPED']} skipped, {counts['FAIL']} failed"
          + (f": {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # without finalization: gloo's threads can abort a process that finished its work
