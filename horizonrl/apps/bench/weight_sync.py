"""Part 4 — weight sync: time per broadcast, and bytes/s against the link's limit.

One sender process (the learner's side: rank 0) and K receiver processes (the engines'
side, default 2 like ``rollout.num_actors``) on loopback. For each model they run the
project's own weight hub (:class:`horizonrl.learner.weight_broadcast.WeightHub`: one two-rank
group per engine, the sends to all engines at once, each in its own thread) and
:func:`~horizonrl.actors.weight_receiver.receive_weights`, and — as the baseline — a raw
``broadcast`` of one same-size flat ``uint8`` tensor on one plain gloo process group of all
1 + K processes (what a fixed group can do at best: no packing, no layout, no ack, a receive
buffer allocated once and reused; it is also what the hub's per-engine groups replaced, so
the ratio is what elastic membership costs). A third row, ``raw, fresh recv buffer``, is the
same raw broadcast into a buffer allocated for each broadcast: on a CPU machine first touching
fresh pages inside the socket receive cost 2-3x (kept to show what the reuse buys).

Each repeat measures both back to back (order alternating), every broadcast starting from a
barrier so all receivers wait from the same moment. Per broadcast:

- sender: ``total_s`` = ``pack_s`` (copy every tensor into the hub's buckets, ``learner.weight_bucket_mb``
  each) + ``send_s`` (header, layout, the buckets, acknowledgement, to every engine), as ``WeightHub.send``
  reports them;
- receivers: seconds inside ``receive_weights``; the slowest receiver counts (that is when
  every engine has the new weights), and bytes/s = payload bytes / that time.

Ratio per repeat: horizonrl bytes/s ÷ raw bytes/s.

Not measured here: loading the received tensors into a live vLLM engine (``reload_weights``),
which the real actor also stalls for. The stall share printed here is *derived*:
``receive_s / (receive_s + step_interval_s)`` for an assumed learner step interval; the
measured share comes from the actors' ``weight_stall_s`` counter in the training part.

Run alone: ``python -m horizonrl.apps.bench.weight_sync [--quick] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import os
import queue
import statistics
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from horizonrl.apps.bench.report import (
    alternate,
    make_result,
    paired_ratio,
    print_table,
    progress,
    summarize,
    write_results,
)

PART = "weight_sync"
HOST = "127.0.0.1"
RAW_STORE_PREFIX = "horizonrl-bench-raw"
RUN_ID = "bench-weight-sync"
KINDS = ("horizonrl", "raw", "raw_fresh")
LABELS = {"horizonrl": "horizonrl", "raw": "raw", "raw_fresh": "raw, fresh recv buffer"}


@dataclass(frozen=True)
class ModelSpec:
    """A random model of a given shape (Qwen2, or Llama for SmolLM2's); ``tiny`` is the project's tiny model (vocab of
    the signpost cache)."""

    name: str
    architecture: str = "qwen2"
    hidden: int = 0
    layers: int = 0
    intermediate: int = 0
    heads: int = 0
    kv_heads: int = 0
    vocab: int = 0
    broadcasts_per_repeat: int = 1  # small models: several broadcasts per repeat, their mean counts


MODELS = {
    "tiny": ModelSpec("tiny", broadcasts_per_repeat=10),
    # ~25M parameters (tied embeddings): 16k vocab, 6 layers of 512.
    "25M": ModelSpec("25M", hidden=512, layers=6, intermediate=1408, heads=8, kv_heads=2, vocab=16000),
    # ~98M parameters (tied embeddings): 32k vocab, 12 layers of 768.
    "100M": ModelSpec("100M", hidden=768, layers=12, intermediate=2048, heads=12, kv_heads=2, vocab=32000),
    # SmolLM2-135M-Instruct's shape (its config.json: Llama, 134.5M parameters, tied embeddings, 49,152-token
    # vocabulary): the bytes a SmolLM2 run's every weight update sends. The values are random: the time does not
    # depend on them, and the packaged model need not be imported for this part.
    "smollm2": ModelSpec("smollm2", architecture="llama", hidden=576, layers=30, intermediate=1536, heads=9,
                         kv_heads=3, vocab=49152),
}
TINY_VOCAB = 342  # the vocabulary of .cache/tiny-signpost, the tests' tiny model


def run(quick: bool, out_dir: Path | None = None, *, models: list[str] | None = None, repeats: int | None = None,
        receivers: int = 2, dtype: str = "float32", step_interval_s: float = 10.0, timeout_s: float = 120.0,
        sender_threads: int | None = None) -> dict:
    """Measure every model in ``models``; returns the part's result (see :mod:`horizonrl.apps.bench.report`).

    ``sender_threads`` defaults to what the CPU learner gives itself (cores / (learner ranks +
    actors), at least 1). More torch threads than free cores make the many small copies of
    packing wait on each other: on a loaded 2-core machine 2 threads packed the tiny model
    ~500x slower than 1 thread (80 ms vs 0.15 ms).

    ``timeout_s`` bounds every collective and every wait for a process; the whole run is
    bounded by a deadline derived from it.
    """
    models = models or (["tiny", "25M"] if quick else ["tiny", "100M"])
    repeats = repeats or (3 if quick else 5)
    unknown = [name for name in models if name not in MODELS]
    if unknown:
        raise ValueError(f"unknown model(s) {unknown} for the weight sync benchmark; choose from {', '.join(MODELS)}")
    specs = [MODELS[name] for name in models]
    world_size = receivers + 1
    if sender_threads is None:
        sender_threads = max(1, (os.cpu_count() or 1) // world_size)  # as horizonrl/learner/main.py, one rank
    settings = {"quick": quick, "models": models, "repeats": repeats, "receivers": receivers, "dtype": dtype,
                "sender_torch_threads": sender_threads, "receiver_torch_threads": 1, "backend": "gloo", "host": HOST,
                "step_interval_s (assumed, for the derived stall share)": step_interval_s,
                "broadcasts_per_repeat": {s.name: s.broadcasts_per_repeat for s in specs}}
    progress(PART, f"{receivers} receivers, models {models}, {repeats} repeats, {dtype}")

    from horizonrl.protocol.transport import free_port

    port = free_port(HOST)
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    args = (port, world_size, [asdict(s) for s in specs], repeats, dtype, timeout_s, results)
    procs = [ctx.Process(target=_sender_main, args=(*args, sender_threads), name="bench-weight-sender", daemon=True)]
    procs += [ctx.Process(target=_receiver_main, args=(rank, *args), name=f"bench-weight-receiver-{rank}",
                          daemon=True) for rank in range(1, world_size)]
    try:
        progress(PART, f"starting {len(procs)} processes (1 sender, {receivers} receivers)")
        for proc in procs:
            proc.start()
        reports = _collect(results, procs, world_size, deadline=time.monotonic() + timeout_s * (2 + len(specs)))
        for proc in procs:
            proc.join(timeout=timeout_s)
    finally:
        _end(procs)

    sender = reports[0]
    rows, ratios = [], {}
    for spec in specs:
        rows_, ratio = _rows_for(spec.name, sender, [reports[r] for r in range(1, world_size)], step_interval_s)
        rows += rows_
        ratios.update(ratio)
    settings["models_built"] = {name: {k: v for k, v in info.items() if k != "checksums"}
                                for name, info in sender["models"].items()}
    result = make_result(PART, rows, ratios, settings, chart={"metric": "MB_per_s", "ylabel": "MB/s (slowest receiver)",
                                                              "log": True})
    if out_dir is not None:  # a folder of its own, so parts sharing one out_dir do not overwrite each other
        paths = write_results([result], Path(out_dir) / PART)
        progress(PART, f"wrote {paths['json']} and {paths['chart']}")
    return result


# ------------------------------------------------------------------------- results into rows


def _rows_for(model: str, sender: dict, receivers: list[dict], step_interval_s: float
              ) -> tuple[list[dict], dict[str, dict]]:
    info = sender["models"][model]
    nbytes = info["bytes"]
    per_kind: dict[str, dict[str, list[float]]] = {}
    for kind in KINDS:
        # [repeat][broadcast] -> seconds; the slowest receiver of each broadcast, then the mean over broadcasts.
        sends = sender["timings"][model][kind]
        recvs = [r["timings"][model][kind] for r in receivers]
        receive = [statistics.mean(max(r[i][j] for r in recvs) for j in range(len(sends[i])))
                   for i in range(len(sends))]
        per_kind[kind] = {
            "receive_s": receive,
            "send_s": [statistics.mean(b["send_s"] for b in rep) for rep in sends],
            "total_s": [statistics.mean(b["total_s"] for b in rep) for rep in sends],
            "pack_s": [statistics.mean(b["pack_s"] for b in rep) for rep in sends],
            "bytes_per_s": [nbytes / s for s in receive],
        }
    rows = []
    for kind in KINDS:
        m = per_kind[kind]
        row: dict[str, Any] = {"label": f"{model} / {LABELS[kind]}", "MB": nbytes / 1e6}
        if kind == "horizonrl":
            row["tensors"] = info["tensors"]
            row["pack_ms"] = _ms(m["pack_s"])
            row["send_ms"] = _ms(m["send_s"])
        row["sender_total_ms"] = _ms(m["total_s"])
        row["receive_ms"] = _ms(m["receive_s"])
        row["MB_per_s"] = summarize([b / 1e6 for b in m["bytes_per_s"]])
        if kind == "horizonrl":
            row[f"stall_share@{step_interval_s:g}s (derived)"] = summarize(
                [s / (s + step_interval_s) for s in m["receive_s"]])
        rows.append(row)
    checks = [r["checks"][model] for r in receivers]
    expected = info["checksums"]
    rows[0]["received_ok"] = all(c["checksums"] == expected and c["versions_in_order"] for c in checks)
    ours = per_kind["horizonrl"]["bytes_per_s"]
    return rows, {f"{model}: horizonrl / raw MB/s": paired_ratio(ours, per_kind["raw"]["bytes_per_s"]),
                  f"{model}: horizonrl / raw-fresh MB/s": paired_ratio(ours, per_kind["raw_fresh"]["bytes_per_s"])}


def _ms(seconds: list[float]) -> dict:
    return summarize([s * 1e3 for s in seconds])


# ------------------------------------------------------------------------------ the processes


def _sender_main(port: int, world_size: int, specs: list[dict], repeats: int, dtype: str, timeout_s: float,
                 results: mp.Queue, threads: int) -> None:
    """Rank 0: builds each model, then broadcasts it (and the raw buffer) on the schedule every rank follows."""
    try:
        import torch

        torch.set_num_threads(threads)

        from horizonrl.learner.weight_broadcast import WeightHub

        hub = WeightHub(HOST, port, backend="gloo", timeout_s=timeout_s, run_id=RUN_ID)
        hub.pack(0, [("placeholder", torch.zeros(1))])  # what a joiner receives first
        hub.start()
        deadline = time.monotonic() + timeout_s
        while len(hub.members) < world_size - 1:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world_size - 1 - len(hub.members)} receivers did not join the hub")
            time.sleep(0.05)
        raw_group = _raw_group(hub.store, 0, world_size, timeout_s)
        report: dict[str, Any] = {"rank": 0, "models": {}, "timings": {}}
        version = 0
        for spec in [ModelSpec(**s) for s in specs]:
            start = time.perf_counter()
            named = _build_weights(spec, getattr(torch, dtype))
            build_s = time.perf_counter() - start
            megabytes = _payload_bytes(named) / 1e6
            progress(PART, f"{spec.name}: built {megabytes:.1f} MB in {build_s:.1f} s; broadcasting")
            raw = torch.ones(_payload_bytes(named), dtype=torch.uint8)  # touched, so no page faults while sending
            timings: dict[str, list[list[dict]]] = {kind: [] for kind in KINDS}
            for repeat in range(-1, repeats):  # repeat -1 warms both paths up and is not reported
                for kind in alternate(max(repeat, 0), KINDS):
                    broadcasts = []
                    for _ in range(spec.broadcasts_per_repeat):
                        _barrier(raw_group, timeout_s)
                        if kind == "horizonrl":
                            version += 1
                            broadcasts.append(hub.send(hub.pack(version, named)))
                        else:
                            begin = time.perf_counter()
                            _raw_broadcast(raw_group, raw, timeout_s)
                            elapsed = time.perf_counter() - begin
                            broadcasts.append({"pack_s": 0.0, "send_s": elapsed, "total_s": elapsed})
                    if repeat >= 0:
                        timings[kind].append(broadcasts)
                done = "warm-up" if repeat < 0 else f"repeat {repeat + 1}/{repeats}"
                progress(PART, f"{spec.name}: {done} done")
            report["timings"][spec.name] = timings
            report["models"][spec.name] = {
                "bytes": raw.numel(), "tensors": len(named), "parameters": sum(t.numel() for _, t in named),
                "build_s": round(build_s, 2), "checksums": _checksums(named)}
            del named, raw
        _barrier(raw_group, timeout_s)  # everyone is done before anyone tears the groups down
        results.put(report)
        raw_group.shutdown()
        hub.close()
    except BaseException:
        results.put({"rank": 0, "error": traceback.format_exc()})
        raise


def _receiver_main(rank: int, port: int, world_size: int, specs: list[dict], repeats: int, dtype: str,
                   timeout_s: float, results: mp.Queue) -> None:
    """Ranks 1..K: receive on the sender's schedule; each broadcast timed from the shared barrier."""
    try:
        import torch

        from horizonrl.actors.weight_receiver import join_weight_hub, receive_weights

        torch.set_num_threads(1)  # as in a vLLM CPU worker
        group = join_weight_hub(HOST, port, actor=rank - 1, run_id=RUN_ID, timeout_s=timeout_s)
        receive_weights(group)  # the hub's answer to the join
        raw_group = _raw_group(group.store, rank, world_size, timeout_s)
        report: dict[str, Any] = {"rank": rank, "timings": {}, "checks": {}}
        last_version = 0
        for spec in [ModelSpec(**s) for s in specs]:
            timings: dict[str, list[list[float]]] = {kind: [] for kind in KINDS}
            raw = None
            in_order, named = True, []
            for repeat in range(-1, repeats):
                for kind in alternate(max(repeat, 0), KINDS):
                    seconds = []
                    for _ in range(spec.broadcasts_per_repeat):
                        if kind == "horizonrl":
                            named = []  # free the previous version's tensors first, as an engine does once loaded
                        _barrier(raw_group, timeout_s)
                        begin = time.perf_counter()
                        if kind == "horizonrl":
                            layout, named = receive_weights(group)
                            version = layout.version
                            seconds.append(time.perf_counter() - begin)
                            in_order &= version == last_version + 1
                            last_version = version
                            if raw is None:  # the raw baseline moves exactly the same number of bytes
                                raw = torch.empty(_payload_bytes(named), dtype=torch.uint8)
                                raw.fill_(0)
                        elif kind == "raw":
                            _raw_broadcast(raw_group, raw, timeout_s)
                            seconds.append(time.perf_counter() - begin)
                        else:
                            _raw_broadcast(raw_group, torch.empty(raw.numel(), dtype=torch.uint8), timeout_s)
                            seconds.append(time.perf_counter() - begin)
                    if repeat >= 0:
                        timings[kind].append(seconds)
            report["timings"][spec.name] = timings
            report["checks"][spec.name] = {"checksums": _checksums(named), "versions_in_order": in_order}
            del named, raw
        _barrier(raw_group, timeout_s)
        results.put(report)
        raw_group.shutdown()
        group.close()
    except BaseException:
        results.put({"rank": rank, "error": traceback.format_exc()})
        raise


def _build_weights(spec: ModelSpec, dtype) -> list:
    """The tensors the learner would send for a random model of ``spec``'s shape (``weights_to_send``)."""
    import torch

    from horizonrl.learner.model import weights_to_send

    if spec.name == "tiny":
        from horizonrl.apps.tiny_model import build_model

        model = build_model(TINY_VOCAB)
    else:
        # Built on the meta device and filled directly: Hugging Face's initialisation of ~100M
        # parameters takes several seconds and the values do not matter here.
        model = _model_on_meta(spec)
        model = model.to_empty(device="cpu")
        model.tie_weights()
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for param in model.parameters():
                param.uniform_(-0.02, 0.02, generator=generator)
    model = model.to(dtype)
    return weights_to_send(model.config, model.state_dict())


def _model_on_meta(spec: ModelSpec):
    """A model of ``spec``'s shape on the meta device: its parameters have shapes and no storage."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_class, model_class = {"qwen2": (Qwen2Config, Qwen2ForCausalLM),
                                 "llama": (LlamaConfig, LlamaForCausalLM)}[spec.architecture]
    config = config_class(vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
                          num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
                          num_key_value_heads=spec.kv_heads, head_dim=spec.hidden // spec.heads,
                          max_position_embeddings=4096, tie_word_embeddings=True)
    with torch.device("meta"):
        return model_class(config)


def _payload_bytes(named: list) -> int:
    from horizonrl.protocol.weights import layout_offsets

    return layout_offsets([t.numel() * t.element_size() for _, t in named])[1]


def _checksums(named: list) -> list:
    """Name and hash of the bytes of the first and last tensor: a cheap check that receivers got what was sent."""
    import torch

    def digest(tensor) -> str:
        raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
        return hashlib.blake2b(raw.data, digest_size=16).hexdigest()

    return [[name, digest(tensor)] for name, tensor in (named[0], named[-1])] if named else []


def _raw_group(store, rank: int, world_size: int, timeout_s: float):
    """One plain gloo group of all the processes, on the hub's store under another prefix."""
    from datetime import timedelta

    import torch.distributed as dist

    return dist.ProcessGroupGloo(dist.PrefixStore(RAW_STORE_PREFIX, store), rank, world_size,
                                 timedelta(seconds=timeout_s))


def _raw_broadcast(raw_group, tensor, timeout_s: float) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    raw_group.broadcast([tensor], options).wait(timedelta(seconds=timeout_s))


def _barrier(raw_group, timeout_s: float) -> None:
    from datetime import timedelta

    raw_group.barrier().wait(timedelta(seconds=timeout_s))


def _collect(results: mp.Queue, procs: list, count: int, deadline: float) -> dict[int, dict]:
    """One report per rank; fails at once on a child's error or death, and at the deadline."""
    reports: dict[int, dict] = {}
    while len(reports) < count:
        try:
            report = results.get(timeout=1.0)
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"{dead[0].name} (pid {dead[0].pid}) exited with {dead[0].exitcode}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"weight-sync benchmark: {count - len(reports)} process(es) did not report in time")
            continue
        if "error" in report:
            raise RuntimeError(f"weight-sync benchmark rank {report['rank']} failed:\n{report['error']}")
        reports[report["rank"]] = report
        progress(PART, f"rank {report['rank']} done")
    return reports


def _end(procs: list) -> None:
    """End every process this benchmark started, by pid: SIGTERM, then SIGKILL."""
    for proc in procs:
        if proc.pid is not None and proc.is_alive():
            proc.terminate()
    for proc in procs:
        if proc.pid is not None:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {getattr(__spec__, 'name', __name__)}",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny + ~25M model, 3 repeats (full: tiny + ~100M, 5)")
    parser.add_argument("--out", type=Path, default=None, help="write results.json and chart.png into OUT/weight_sync/")
    parser.add_argument("--models", default=None, help=f"comma-separated, of {','.join(MODELS)}")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--receivers", type=int, default=2, help="engines receiving (rollout.num_actors)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--step-interval-s", type=float, default=10.0,
                        help="assumed learner step interval for the derived stall share")
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument("--sender-threads", type=int, default=None,
                        help="torch threads of the sender (default: as the CPU learner, cores / (1 + receivers))")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        result = run(args.quick, args.out, models=args.models.split(",") if args.models else None,
                     repeats=args.repeats, receivers=args.receivers, dtype=args.dtype,
                     step_interval_s=args.step_interval_s, timeout_s=args.timeout_s, sender_threads=args.sender_threads)
    except ValueError as error:
        parser.error(str(error))
    print_table(result)
    print(f"({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
