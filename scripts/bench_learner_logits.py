"""A learner micro-batch's forward and backward with the output layer at every position, against only at the
positions that predict a loss token (``learner/model.py``'s ``loss_token_logits``), side by side.

    python scripts/bench_learner_logits.py [--model DIR] [--batch 8] [--length 1024] [--replies 3]
        [--reply-tokens 8] [--compute-dtype bfloat16] [--repeats 3] [--threads 2] [--compare ways|dtypes]

``--compare dtypes`` measures the learner's way (*kept*) with float32 compute against bf16 autocast instead
(``learner.compute_dtype``: the master weights are float32 either way), side by side, with tokens/s.

With a 49,152-token vocabulary (SmolLM2) the (B, T, V) logits and their gradient are most of a step's memory,
and the output layer a fifth of its arithmetic, while an agent's replies are a small part of each sequence.
Each measurement runs in a fresh process (so that its peak resident memory is its own), the two ways
alternating, ``--repeats`` times each: the model loaded in float32 (the learner's master weights), the
forward and backward of the policy-gradient loss's logprobs and entropy under CPU autocast in
``--compute-dtype`` (the learner's ``learner.compute_dtype``), timed after one untimed pass. Each sequence has
``--replies`` replies of ``--reply-tokens`` loss tokens at different places in different rows, as a multi-turn
episode has. Before timing, the first process of each pair checks that both ways give the same loss and
gradient (exits 1 if not).

Prints seconds per forward+backward and the peak resident memory above the loaded model (median and range),
and the ratios full / kept. Default model: SmolLM2-135M-Instruct (``horizonrl make-model smollm2``, imported
into .cache/ on first use).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WAYS = ("full", "kept")


def loss_mask(batch: int, length: int, replies: int, reply_tokens: int, seed: int = 0):
    """(B, T) with ``replies`` runs of ``reply_tokens`` ones per row, placed differently in every row."""
    import numpy as np
    import torch

    rng = np.random.default_rng(seed)
    mask = torch.zeros(batch, length)
    slot = length // replies
    for row in range(batch):
        for r in range(replies):
            start = r * slot + int(rng.integers(slot // 4, slot - reply_tokens))
            mask[row, start:start + reply_tokens] = 1
    return mask


def step(model, ids, selected, way: str, dtype):
    """One forward and backward of the logprobs and entropy at the loss tokens; the loss."""
    import torch

    from horizonrl.learner.model import loss_token_logits
    from horizonrl.learner.policy_loss import token_logprobs_and_entropy

    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        if way == "full":  # what the learner did before: every position's logits, then the loss rows
            logits = model(input_ids=ids, use_cache=False).logits[:, :-1][selected]
        else:
            logits = loss_token_logits(model, ids, selected)
    logprobs, entropy = token_logprobs_and_entropy(logits, ids[:, 1:][selected], temperature=1.0)
    loss = -(logprobs.sum() + 0.01 * entropy.sum()) / max(int(selected.sum()), 1)
    loss.backward()
    return float(loss.detach())


def child(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.train()
    dtype = getattr(torch, args.compute_dtype)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.length))
    selected = loss_mask(args.batch, args.length, args.replies, args.reply_tokens)[:, 1:].bool()
    result = {}
    if args.check:  # both ways, same loss and gradient (a process of its own: it would spoil the peak)
        grads = {}
        for way in WAYS:
            model.zero_grad(set_to_none=True)
            result[f"loss_{way}"] = step(model, ids, selected, way, dtype)
            grads[way] = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        result["grad_max_abs_diff"] = float((grads["full"] - grads["kept"]).abs().max())
        result["grad_max_abs"] = float(grads["full"].abs().max())
        return result
    base_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    step(model, ids, selected, args.child, dtype)  # untimed: the allocator's first pass
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    step(model, ids, selected, args.child, dtype)
    result["seconds"] = time.perf_counter() - start
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result["extra_gb"] = (peak_kb - base_kb) / 1e6  # ru_maxrss is in KiB on Linux
    result["peak_gb"] = peak_kb / 1e6
    return result


def run_child(args: list[str]) -> dict | None:
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        print(out.stderr[-3000:], file=sys.stderr)
        return None
    return json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[7:])


DTYPES = ("float32", "bfloat16")


def spread(values: list[float], digits: int, unit: str = "") -> str:
    """'median [min-max]' of ``values``."""
    return (f"{statistics.median(values):.{digits}f}{unit} [{min(values):.{digits}f}-"
            f"{max(values):.{digits}f}{unit}]")


def compare_dtypes(args, common: list[str]) -> int:
    """The learner's way (kept) with float32 compute against bf16 autocast, alternating, each a fresh process."""
    tokens = args.batch * args.length
    runs: dict[str, list[dict]] = {dtype: [] for dtype in DTYPES}
    for repeat in range(args.repeats):
        for dtype in (DTYPES if repeat % 2 == 0 else DTYPES[::-1]):  # alternate which goes first
            result = run_child([*common, "--compute-dtype", dtype, "--child", "kept"])  # the later flag wins
            if result is None:
                return 1
            result["tokens_per_s"] = tokens / result["seconds"]
            runs[dtype].append(result)
            print(f"repeat {repeat + 1}/{args.repeats} {dtype}: {result['seconds']:.1f} s "
                  f"({result['tokens_per_s']:.0f} tokens/s), +{result['extra_gb']:.2f} GB", flush=True)
    print(f"\n{args.batch} x {args.length} tokens, forward + backward, output layer at the loss positions only, "
          f"{args.threads} threads, {args.repeats} repeats (median [min-max])")
    print("| compute | s per forward+backward | tokens/s | GB above the model |\n|---|---|---|---|")
    for dtype in DTYPES:
        column = {key: [r[key] for r in runs[dtype]] for key in ("seconds", "tokens_per_s", "extra_gb")}
        print(f"| {dtype} | {spread(column['seconds'], 1)} | {spread(column['tokens_per_s'], 0)} | "
              f"{spread(column['extra_gb'], 2)} |")
    speedup = [f["seconds"] / b["seconds"] for f, b in zip(runs["float32"], runs["bfloat16"])]
    print(f"float32 / bfloat16 time: {spread(speedup, 2, 'x')}")
    if args.json:
        args.json.write_text(json.dumps({
            "settings": {k: v for k, v in vars(args).items() if k not in ("child", "check", "json")},
            "runs": runs, "ratios": {"time_float32_over_bfloat16": speedup}}, indent=1) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="Hugging Face model directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--replies", type=int, default=3)
    parser.add_argument("--reply-tokens", type=int, default=8)
    parser.add_argument("--compute-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--compare", choices=["ways", "dtypes"], default="ways",
                        help="ways: full vs kept logits (default); dtypes: kept in float32 vs bfloat16 compute")
    parser.add_argument("--json", type=Path, help="also write the check, every measurement and the ratios here")
    parser.add_argument("--child", choices=WAYS, help=argparse.SUPPRESS)
    parser.add_argument("--check", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return 0
    if args.model is None:
        from horizonrl.apps.model_import import ensure_imported

        args.model = str(ensure_imported(REPO / ".cache" / "smollm2", packaged="smollm2"))
    runs: dict[str, list[dict]] = {way: [] for way in WAYS}
    common = [__file__, "--model", args.model, "--batch", str(args.batch),
              "--length", str(args.length), "--replies", str(args.replies), "--reply-tokens",
              str(args.reply_tokens), "--compute-dtype", args.compute_dtype, "--threads", str(args.threads)]
    if args.compare == "dtypes":
        return compare_dtypes(args, common)
    check = run_child([*common, "--child", "kept", "--check"])
    if check is None:
        return 1
    # bf16 autocast rounds the two ways' matmuls differently; float32 agrees to rounding
    tolerance = 1e-3 if args.compute_dtype == "float32" else 5e-2
    diff = check["grad_max_abs_diff"] / max(check["grad_max_abs"], 1e-12)
    print(f"check: loss {check['loss_full']:.5f} (full) vs {check['loss_kept']:.5f} (kept); largest gradient "
          f"difference {diff:.2e} of the largest gradient", flush=True)
    if abs(check["loss_full"] - check["loss_kept"]) > tolerance * max(1.0, abs(check["loss_full"])) or diff > tolerance:
        print("the two ways disagree", file=sys.stderr)
        return 1
    for repeat in range(args.repeats):
        for way in (WAYS if repeat % 2 == 0 else WAYS[::-1]):  # alternate which goes first
            result = run_child([*common, "--child", way])
            if result is None:
                return 1
            runs[way].append(result)
            print(f"repeat {repeat + 1}/{args.repeats} {way}: {result['seconds']:.1f} s, "
                  f"+{result['extra_gb']:.2f} GB (peak {result['peak_gb']:.2f} GB)", flush=True)
    selected = int(loss_mask(args.batch, args.length, args.replies, args.reply_tokens)[:, 1:].bool().any(0).sum())
    print(f"\n{args.batch} x {args.length} tokens, {args.replies} x {args.reply_tokens} loss tokens a row: the output "
          f"layer at {selected} of {args.length - 1} positions; compute {args.compute_dtype}, {args.threads} threads, "
          f"{args.repeats} repeats (median [min-max])")
    print("| way | s per forward+backward | GB above the model | peak GB |\n|---|---|---|---|")
    for way in WAYS:
        column = {key: [r[key] for r in runs[way]] for key in ("seconds", "extra_gb", "peak_gb")}
        print(f"| {way} | {spread(column['seconds'], 1)} | {spread(column['extra_gb'], 2)} | "
              f"{statistics.median(column['peak_gb']):.2f} |")
    ratios_s = [f["seconds"] / k["seconds"] for f, k in zip(runs["full"], runs["kept"])]
    ratios_m = [f["extra_gb"] / max(k["extra_gb"], 1e-3) for f, k in zip(runs["full"], runs["kept"])]
    print(f"full / kept: time {spread(ratios_s, 2, 'x')}, memory above the model {spread(ratios_m, 2, 'x')}")
    if args.json:
        args.json.write_text(json.dumps({
            "settings": {k: v for k, v in vars(args).items() if k not in ("child", "check", "json")},
            "output_layer_positions": selected, "check": check, "runs": runs,
            "ratios": {"time_full_over_kept": ratios_s, "memory_full_over_kept": ratios_m}}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
