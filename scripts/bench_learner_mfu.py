"""The learner's efficiency against this machine's own matmul peak, measured in one run.

    python scripts/bench_learner_mfu.py [--model DIR] [--config configs/smollm2_babyai.yaml] [--threads 2]
        [--repeats 3] [--variants padded,packed,...] [--json OUT.json]

1. **Matmul peak** (a process of its own, ``--threads`` torch threads): ``torch.matmul`` in bfloat16 and float32 at a
   large square (2048³) and at the model's own shapes — every matmul of one decoder layer's forward and backward
   (X·W, dY·Wᵀ, Xᵀ·dY for q/k/v/o and the MLP) at ``--tokens`` rows, and the output layer at the loss positions —
   in TFLOP/s. The peak at the model's shapes is their FLOPs over their summed time.
2. **The learner** on the model (default SmolLM2-135M-Instruct), built as the RL learner builds it (FSDP2 on one
   gloo rank, float32 master weights, ``learner.compute_dtype`` from the config), one real learner step
   (``train_on_batch``: GRPO's clipped loss, AdamW) on the config's real batches: ``learner.groups_per_step`` groups
   of ``rollout.n`` episodes of its environments at its turn budget (random-policy episodes, laid out token for
   token as the actor lays them out: multi-turn, loss on the replies only, lengths as they come), each variant in a
   fresh process, alternating, ``--repeats`` times, timed after one untimed step. Tokens/s counts real tokens (not
   padding); MFU = useful FLOPs (core/model_shape.py ``training_flops``) / seconds / the bf16 (or fp32, with fp32
   compute) matmul peak at the model's shapes measured in step 1.

Variants (``--variants``; each is a way the learner can run, the first is today's default):
    padded      micro-batches of ``learner.micro_batch_size`` trajectories, each padded to its longest
    tokens      micro-batches capped at ``--max-tokens`` padded tokens (``learner.max_tokens_per_micro_batch``)
    packed      trajectories packed end to end into rows of ``--max-tokens`` (``learner.pack_tokens``)
    lora        the padded learner training rank-16 adapters only (``learner.lora``; frozen weights: fewer FLOPs)
    checkpoint  padded, with activation checkpointing (recomputation is not useful FLOPs: MFU drops by design)
    compile     padded, each decoder layer torch.compiled (``learner.compile``; compiled during the untimed step)
    packed-compile  both

Prints the peaks, a table per variant (seconds per step, tokens/s, MFU, peak resident memory), and the ratios to
the first variant; ``--json`` writes every measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIANTS = {
    "padded": [],
    "tokens": ["learner.max_tokens_per_micro_batch={max_tokens}"],
    "packed": ["learner.pack_tokens={max_tokens}"],
    "lora": ["learner.lora.rank=16"],
    "checkpoint": ["learner.activation_checkpointing=true"],
    "compile": ["learner.compile=true"],
    "packed-compile": ["learner.pack_tokens={max_tokens}", "learner.compile=true"],
}
SQUARE = 2048


# ---------------------------------------------------------------------------- 1. the matmul peak


def timed_matmul(a, b, repeats: int) -> float:
    """Median seconds of ``a @ b`` after two untimed runs."""
    import torch

    for _ in range(2):
        torch.matmul(a, b)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.matmul(a, b)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def model_matmuls(shape, tokens: int, loss_tokens: int) -> list[tuple[int, int, int]]:
    """(m, k, n) of every matmul of one decoder layer's forward and backward at ``tokens`` rows, and of the output
    layer's at ``loss_tokens`` rows: forward X(T×in)·W(in×out), input gradient dY(T×out)·Wᵀ(out×in), weight
    gradient Xᵀ(in×T)·dY(T×out)."""
    from horizonrl.core.memory_plan import linear_shapes

    out = []
    for rows, (fan_in, fan_out) in [(tokens, s) for s in linear_shapes(shape).values()] + \
            [(loss_tokens, (shape.hidden, shape.vocab))]:
        out += [(rows, fan_in, fan_out), (rows, fan_out, fan_in), (fan_in, rows, fan_out)]
    return out


def matmul_peaks(args) -> dict:
    import torch

    from horizonrl.core.model_shape import ModelShape

    torch.set_num_threads(args.threads)
    shape = ModelShape.from_hf_config(json.loads((Path(args.model) / "config.json").read_text()))
    result = {}
    for name in ("bfloat16", "float32"):
        dtype = getattr(torch, name)
        a = torch.randn(SQUARE, SQUARE, dtype=dtype)
        square = 2 * SQUARE ** 3 / timed_matmul(a, a.clone(), args.matmul_repeats) / 1e12
        flops, seconds, per_shape = 0.0, 0.0, []
        for m, k, n in model_matmuls(shape, args.tokens, max(1, args.tokens // 8)):
            t = timed_matmul(torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype), args.matmul_repeats)
            flops += 2 * m * k * n
            seconds += t
            per_shape.append({"m": m, "k": k, "n": n, "tflops": 2 * m * k * n / t / 1e12})
        result[name] = {"square_tflops": square, "model_tflops": flops / seconds / 1e12, "shapes": per_shape}
    return result


# ---------------------------------------------------------------------------- 2. the learner


def demo_samples(config, seed: int):
    """``groups_per_step`` groups of ``n`` random-policy episodes of the config's environments as learner samples,
    laid out as the actor lays out an episode (offline_data.conversation_ids), with GRPO-like advantages ±1."""
    import torch
    from transformers import AutoTokenizer

    from horizonrl.apps.warmup_data import warmup_records
    from horizonrl.core.agentgym_records import parse_conversation
    from horizonrl.core.chat import ChatTokenizer
    from horizonrl.learner.batching import Sample
    from horizonrl.learner.offline_data import conversation_ids

    chat = ChatTokenizer(AutoTokenizer.from_pretrained(config.model.path))
    groups, n = config.learner.groups_per_step, config.rollout.n
    records = warmup_records(config, max(1, -(-groups * n // len(config.envs))), seed)[: groups * n]
    samples = []
    for index, record in enumerate(records):
        conversation = parse_conversation(record["conversations"], f"episode {index}")
        ids, mask = conversation_ids(chat, conversation, config.rollout.system_prompt)
        ids, mask = ids[: config.rollout.max_context_tokens], mask[: config.rollout.max_context_tokens]
        loss_mask = torch.tensor(mask, dtype=torch.float32)
        loss_mask[0] = 0
        samples.append(Sample(token_ids=torch.tensor(ids), loss_mask=loss_mask,
                              behaviour_logprobs=torch.full((len(ids),), -1.0) * loss_mask,
                              advantage=1.0 if index % 2 else -1.0, group=index // n))
    return samples


def learner_run(args) -> dict:
    """One variant: the model built as the learner builds it, one untimed then one timed learner step."""
    import torch
    import torch.distributed as dist

    from horizonrl.core.config import load_config
    from horizonrl.core.model_shape import ModelShape
    from horizonrl.learner.main import build_trainables
    from horizonrl.learner.algorithm import AlgorithmSettings, train_on_batch
    from horizonrl.protocol.transport import free_port

    overrides = [o.format(max_tokens=args.max_tokens) for o in VARIANTS[args.child]]
    config = load_config(args.config, [f"model.path={args.model}", *overrides])
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        tr = build_trainables(config, torch.device("cpu"))
        samples = demo_samples(config, seed=0)
        base_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        algorithm = AlgorithmSettings.from_config(config)
        settings, update = algorithm.loss, algorithm.update
        seconds, profile = [], ""
        for step in range(2):
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) \
                if args.profile and step == 1 else None
            start = time.perf_counter()
            with profiler if profiler is not None else contextlib.nullcontext():
                train_on_batch(tr.model, tr.optimizer, samples, rank=0, world_size=1, settings=settings,
                               update=update, device=torch.device("cpu"))
            seconds.append(time.perf_counter() - start)
            if profiler is not None:
                profile = profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    finally:
        dist.destroy_process_group()
    shape = ModelShape.from_hf_config(json.loads((Path(args.model) / "config.json").read_text()))
    lengths = [s.num_tokens for s in samples]
    loss_tokens = [s.num_loss_tokens for s in samples]
    flops = sum(shape.training_flops(n, k, frozen_weights=config.learner.lora is not None)
                for n, k in zip(lengths, loss_tokens))
    return {"seconds": seconds[-1], "first_seconds": seconds[0], "tokens": sum(lengths),
            "loss_tokens": sum(loss_tokens), "sequences": len(samples), "flops": flops,
            "longest": max(lengths), "shortest": min(lengths), "compute_dtype": config.learner.compute_dtype,
            "peak_gb": peak_kb / 1e6, "step_gb": (peak_kb - base_kb) / 1e6, "profile": profile}


# ---------------------------------------------------------------------------- the run


def run_child(args: list[str]) -> dict | None:
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        print(out.stderr[-3000:], file=sys.stderr)
        return None
    return json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[7:])


def spread(values: list[float], digits: int, unit: str = "") -> str:
    return (f"{statistics.median(values):.{digits}f}{unit} [{min(values):.{digits}f}-"
            f"{max(values):.{digits}f}{unit}]")


def report(args, peaks: dict, runs: dict[str, list[dict]]) -> dict:
    """The table (printed) and what --json keeps."""
    first = runs[args.variants[0]][0]
    compute = "float32" if first["compute_dtype"] in ("float32", "auto") else "bfloat16"
    peak = peaks[compute]["model_tflops"]
    print(f"\nmatmul peak, {args.threads} threads (TFLOP/s): bf16 {peaks['bfloat16']['square_tflops']:.3f} at "
          f"{SQUARE}³, {peaks['bfloat16']['model_tflops']:.3f} at the model's shapes; fp32 "
          f"{peaks['float32']['square_tflops']:.3f} / {peaks['float32']['model_tflops']:.3f}")
    print(f"learner step: {first['sequences']} episodes, {first['tokens']} tokens ({first['shortest']}-"
          f"{first['longest']} a sequence), {first['loss_tokens']} loss tokens; compute {compute}; MFU against "
          f"the {compute} peak at the model's shapes ({peak:.3f} TFLOP/s); {args.repeats} repeats (median [min-max])")
    print("| variant | s per learner step | tokens/s | MFU | peak GB |\n|---|---|---|---|---|")
    summary = {}
    for name in args.variants:
        rows = runs[name]
        tflops = [r["flops"] / r["seconds"] / 1e12 for r in rows]
        mfu = [t / peak for t in tflops]
        tokens_s = [r["tokens"] / r["seconds"] for r in rows]
        print(f"| {name} | {spread([r['seconds'] for r in rows], 1)} | {spread(tokens_s, 0)} | "
              f"{spread([100 * m for m in mfu], 1, '%')} | {statistics.median(r['peak_gb'] for r in rows):.2f} |")
        summary[name] = {"mfu": mfu, "tokens_per_s": tokens_s, "achieved_tflops": tflops}
    base = args.variants[0]
    for name in args.variants[1:]:
        ratios = [b["seconds"] / v["seconds"] for b, v in zip(runs[base], runs[name])]
        print(f"{name}: {spread(ratios, 2, 'x')} the speed of {base}")
        summary[name]["speed_over_first"] = ratios
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="Hugging Face model directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--config", default=str(REPO / "configs" / "smollm2_babyai.yaml"),
                        help="the run whose batches and learner settings are measured")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", default="padded,packed",
                        help=f"comma-separated, the first the baseline: {', '.join(VARIANTS)}")
    parser.add_argument("--max-tokens", type=int, default=4096, help="the tokens and packed variants' row budget")
    parser.add_argument("--tokens", type=int, default=4096, help="rows of the model-shape matmuls")
    parser.add_argument("--matmul-repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--profile", action="store_true",
                        help="instead: one learner step of each variant under torch.profiler, its top operators")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(matmul_peaks(args) if args.child == "matmul" else learner_run(args)), flush=True)
        from horizonrl.core.runtime import exit_skipping_finalization

        exit_skipping_finalization(0)  # a child that ran gloo collectives can abort at finalization after its work
    args.variants = args.variants.split(",")
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    if args.model is None:
        from horizonrl.apps.model_import import ensure_imported

        args.model = str(ensure_imported(REPO / ".cache" / "smollm2", packaged="smollm2"))
    common = [__file__, "--model", args.model, "--config", args.config, "--threads", str(args.threads),
              "--max-tokens", str(args.max_tokens), "--tokens", str(args.tokens),
              "--matmul-repeats", str(args.matmul_repeats)]
    if args.profile:  # where a step's time goes (the timed step, profiled: slower than unprofiled)
        for name in args.variants:
            result = run_child([*common, "--profile", "--child", name])
            if result is None:
                return 1
            print(f"{name}: {result['seconds']:.1f} s profiled\n{result['profile']}", flush=True)
        return 0
    peaks = run_child([*common, "--child", "matmul"])
    if peaks is None:
        return 1
    runs: dict[str, list[dict]] = {name: [] for name in args.variants}
    for repeat in range(args.repeats):
        for name in (args.variants if repeat % 2 == 0 else args.variants[::-1]):
            result = run_child([*common, "--child", name])
            if result is None:
                return 1
            runs[name].append(result)
            print(f"repeat {repeat + 1}/{args.repeats} {name}: {result['seconds']:.1f} s, "
                  f"{result['tokens'] / result['seconds']:.0f} tokens/s, peak {result['peak_gb']:.2f} GB", flush=True)
    peaks_after = run_child([*common, "--child", "matmul"])  # the machine may have changed meanwhile
    summary = report(args, peaks, runs)
    if peaks_after is not None:
        print(f"matmul peak at the model's shapes after the learner runs: bf16 "
              f"{peaks_after['bfloat16']['model_tflops']:.3f}, fp32 {peaks_after['float32']['model_tflops']:.3f}")
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k not in ("child", "json")}
        args.json.write_text(json.dumps({"settings": settings, "peaks": peaks, "peaks_after": peaks_after, "runs": runs,
                                         "summary": summary}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
