"""Token-budget micro-batches (batching.pack_micro_batches) and activation checkpointing.

Packing: each micro-batch holds at most ``max_tokens`` padded tokens (rows × longest row) and at
most ``micro_batch_size`` rows; a trajectory longer than the budget is a micro-batch alone; every
trajectory is in exactly one micro-batch and all ranks agree on the count.

Activation checkpointing must change memory, not numbers: one FSDP2 step (1 gloo rank, tiny model)
with it gives the same gradients as without, and its decoder layers really ran twice (the recompute).
"""

from __future__ import annotations

import multiprocessing as mp
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from horizonrl.learner.batching import Sample, micro_batches_for_rank, pack_micro_batches
from horizonrl.protocol.transport import free_port

from learner_fixtures import build_tiny_model, groups


def _sample(length: int, tag: int) -> Sample:
    mask = torch.ones(length)
    mask[0] = 0
    return Sample(token_ids=torch.full((length,), tag), loss_mask=mask, behaviour_logprobs=torch.zeros(length),
                  advantage=1.0)


def _padded(chunk: list[Sample]) -> int:
    return len(chunk) * max(s.num_tokens for s in chunk)


def test_packing_respects_the_token_budget_and_keeps_every_sample():
    lengths = [50, 40, 30, 30, 20, 10, 10, 5]
    samples = [_sample(n, i) for i, n in enumerate(lengths)]
    chunks = pack_micro_batches(samples, max_sequences=16, max_tokens=100)
    assert [[s.num_tokens for s in chunk] for chunk in chunks] == [[50, 40], [30, 30, 20], [10, 10, 5]]
    assert all(_padded(chunk) <= 100 for chunk in chunks)
    assert [int(s.token_ids[0]) for chunk in chunks for s in chunk] == list(range(len(lengths)))


def test_a_trajectory_longer_than_the_budget_goes_alone():
    samples = [_sample(n, i) for i, n in enumerate([10, 300, 10, 10])]
    chunks = pack_micro_batches(samples, max_sequences=16, max_tokens=64)
    assert [[s.num_tokens for s in chunk] for chunk in chunks] == [[10], [300], [10, 10]]


def test_the_row_cap_still_applies_and_no_budget_is_rows_only():
    samples = [_sample(4, i) for i in range(7)]
    assert [len(c) for c in pack_micro_batches(samples, max_sequences=3, max_tokens=1000)] == [3, 3, 1]
    assert [len(c) for c in pack_micro_batches(samples, max_sequences=3)] == [3, 3, 1]
    assert [len(c) for c in pack_micro_batches(samples, max_sequences=16, max_tokens=8)] == [2, 2, 2, 1]


def test_every_rank_runs_the_same_number_of_micro_batches():
    samples = [_sample(n, i) for i, n in enumerate([90, 80, 12, 11, 10, 9, 8, 7, 6])]
    per_rank = [micro_batches_for_rank(samples, rank, 2, micro_batch_size=16, max_tokens=100) for rank in range(2)]
    assert len(per_rank[0]) == len(per_rank[1])
    for micro in per_rank:
        assert all(mb.input_ids.numel() <= 100 or mb.num_sequences == 1 for mb in micro)
    assert sum(mb.num_sequences for micro in per_rank for mb in micro) == len(samples)


def _grads(rank: int, port: int, model_dir: str, out_dir: str) -> None:
    from safetensors.torch import save_file
    import torch.distributed as dist

    from horizonrl.core.precision import resolve_precision
    from horizonrl.core.runtime import exit_skipping_finalization
    from horizonrl.learner.batching import samples_from_batch
    from horizonrl.learner.model import build_sharded_model
    from horizonrl.learner.algorithm import LossSettings, UpdateSettings, train_on_batch
    from horizonrl.protocol import Batch

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=1,
                            timeout=timedelta(seconds=60))
    try:
        policy = resolve_precision("float32", "float32", "auto", None, learner_on_cuda=False, engine_on_gpu=False,
                                   flash_attn_installed=False)
        samples, _ = samples_from_batch(Batch(run_id="test-run", request_id=1, groups=groups()), True, "grpo")
        out = {}
        for checkpointing in (False, True):
            model = build_sharded_model(model_dir, kind="policy", policy=policy, device=torch.device("cpu"),
                                        activation_checkpointing=checkpointing)
            calls = []
            # a pre-hook: the recompute stops early, once the last saved tensor is back, before the layer ends
            model.model.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
            optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
            train_on_batch(model, optimizer, samples, rank=0, world_size=1, settings=LossSettings(),
                           update=UpdateSettings(micro_batch_size=3, max_tokens_per_micro_batch=60),
                           device=torch.device("cpu"))
            tag = "ac" if checkpointing else "plain"
            out.update({f"{tag}/{name}": p.grad.full_tensor() for name, p in model.named_parameters()})
            out[f"{tag}/mlp_calls"] = torch.tensor(len(calls))
        save_file({k: v.contiguous() for k, v in out.items()}, str(Path(out_dir) / "grads.safetensors"))
    finally:
        dist.destroy_process_group()
    exit_skipping_finalization(0)


@pytest.mark.slow
def test_activation_checkpointing_gives_the_same_gradients(tmp_path):
    from safetensors.torch import load_file

    model_dir = build_tiny_model(tmp_path / "model")
    process = mp.get_context("spawn").Process(target=_grads, args=(0, free_port(), str(model_dir), str(tmp_path)))
    process.start()
    try:
        process.join(180)
        assert process.exitcode == 0
    finally:
        if process.is_alive():
            process.kill()
            process.join(10)
    grads = load_file(str(tmp_path / "grads.safetensors"))
    plain_calls, ac_calls = int(grads.pop("plain/mlp_calls")), int(grads.pop("ac/mlp_calls"))
    assert plain_calls > 0 and ac_calls == 2 * plain_calls  # each micro-batch's layer ran again in backward
    names = [key.split("/", 1)[1] for key in grads if key.startswith("plain/")]
    assert names
    for name in names:
        plain, ac = grads[f"plain/{name}"], grads[f"ac/{name}"]
        assert float(plain.abs().max()) > 0, name
        torch.testing.assert_close(ac, plain, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
