"""Does sending only what changed (bf16 deltas) pay? Measured, not guessed.

    python scripts/bench_weight_deltas.py [--hidden 512] [--layers 8] [--steps 5] [--lrs 1e-6,1e-5,1e-4,6e-4]
                                          [--device cuda]

The engines run in bf16 while the learner keeps fp32 master weights (core/precision.py), so what an
engine receives each version is ``bf16(master)``. An element of that changes only when its master
weight crossed a bf16 rounding boundary (bf16 keeps 8 significant bits: about 0.4 % of the value),
so at small learning rates most of a version may be unchanged. This script measures how much: a
randomly initialised Qwen2-shaped model (no download) takes real AdamW steps (fp32 master weights,
grad clip 1.0, a language-model loss on random tokens) at each learning rate, and after every step
the bf16 cast is compared with the previous version's:

- changed elements (share), and tensors with no changed element;
- bytes of a sparse delta (int32 index + bf16 value per changed element: 6 bytes) and of a dense
  per-tensor one (only the tensors with a change, whole) against the full version (2 bytes each);
- the time to build the sparse delta (compare, nonzero, gather) and to apply it on the receiver
  (index_put), and the transfer time it would save at ``--link-gbps`` (default 2.7 GB/s: what the
  weight hub measured over gloo on this machine, docs/benchmarks.md) or at NVLink-class 100 GB/s.

Prints a table per learning rate (medians over the steps after the first) and what it saves.
``--device cuda`` trains, builds and applies on the GPU (timings synchronised), which is where the
learner and the engines would do it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def build(hidden: int, layers: int, vocab: int, seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                         num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 128),
                         max_position_embeddings=512, tie_word_embeddings=True)
    return Qwen2ForCausalLM(config).float()


def bf16_version(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().to(torch.bfloat16).clone() for name, p in model.named_parameters()}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compare(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> dict[str, float]:
    """What a delta from ``old`` to ``new`` would carry, and what building and applying it costs."""
    elements = changed = dense_bytes = 0
    device = next(iter(new.values())).device
    _synchronize(device)
    start = time.perf_counter()
    deltas = {}
    for name, tensor in new.items():
        flat_new, flat_old = tensor.view(-1), old[name].view(-1)
        # Bit patterns, not values: -0.0 vs 0.0 and NaNs count as they travel.
        index = torch.nonzero(flat_new.view(torch.int16) != flat_old.view(torch.int16)).view(-1)
        deltas[name] = (index.to(torch.int32), flat_new[index])
    _synchronize(device)
    build_s = time.perf_counter() - start
    receiver = {name: tensor.clone().view(-1) for name, tensor in old.items()}  # its copy of the previous version
    _synchronize(device)
    start = time.perf_counter()
    for name, (index, values) in deltas.items():
        receiver[name][index.long()] = values
    _synchronize(device)
    apply_s = time.perf_counter() - start
    for name, (index, _) in deltas.items():
        assert torch.equal(receiver[name].view(torch.int16), new[name].view(-1).view(torch.int16)), name
        elements += new[name].numel()
        changed += index.numel()
        dense_bytes += new[name].numel() * 2 if index.numel() else 0
    return {"changed_share": changed / elements, "tensors_unchanged": sum(not d[0].numel() for d in deltas.values()),
            "tensors": len(deltas), "full_bytes": elements * 2, "sparse_bytes": changed * 6,
            "dense_per_tensor_bytes": dense_bytes, "build_s": build_s, "apply_s": apply_s}


def run(lr: float, args) -> list[dict[str, float]]:
    device = torch.device(args.device)
    model = build(args.hidden, args.layers, args.vocab).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    previous = bf16_version(model)
    rows = []
    generator = torch.Generator().manual_seed(1)
    for _ in range(args.steps):
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator).to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        current = bf16_version(model)
        rows.append(compare(previous, current))
        previous = current
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--lrs", default="1e-6,1e-5,1e-4,6e-4")
    p.add_argument("--link-gbps", type=float, default=2.7)
    p.add_argument("--device", default="cpu", help="where the model trains and the deltas are built and applied")
    args = p.parse_args()
    links = {f"a {args.link_gbps:g} GB/s link": args.link_gbps * 1e9, "NVLink-class (100 GB/s)": 100e9}
    where = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "CPU"
    print(f"model: Qwen2 shape, hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; "
          f"{args.steps} AdamW steps per learning rate (medians over steps 2..{args.steps}); on {where}")
    header = ("lr", "changed", "unchanged tensors", "sparse / full bytes", "dense-per-tensor / full",
              "build+apply s", *(f"full send s ({k})" for k in links))
    print(" | ".join(header))
    verdicts = []
    for lr in (float(x) for x in args.lrs.split(",")):
        rows = run(lr, args)[1:] or run(lr, args)
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        full = med["full_bytes"]
        sends = [full / rate for rate in links.values()]
        print(" | ".join([f"{lr:g}", f"{med['changed_share']:.2%}",
                          f"{med['tensors_unchanged']:.0f}/{med['tensors']:.0f}",
                          f"{med['sparse_bytes'] / full:.3f}", f"{med['dense_per_tensor_bytes'] / full:.3f}",
                          f"{med['build_s'] + med['apply_s']:.3f}", *(f"{s:.4f}" for s in sends)]))
        saved = [s * (1 - med["sparse_bytes"] / full) for s in sends]
        verdicts.append((lr, med["sparse_bytes"] / full, med["build_s"] + med["apply_s"], saved))
    print()
    for lr, share, cost, saved in verdicts:
        print(f"lr {lr:g}: a sparse delta is {share:.1%} of the bytes of a full version; "
              + ", ".join(f"{s * 1e3:+.1f} ms of transfer saved over {n}" for n, s in zip(links, saved))
              + f"; building and applying it took {cost * 1e3:.0f} ms on {where}")
    print("(with staged receives and background sends the transfer is off the engine's and the learner's critical "
          "path; vLLM's reload takes whole tensors, so a delta would be applied to a full copy first)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
