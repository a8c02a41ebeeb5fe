"""One learner step on W=2 FSDP2 ranks (gloo) equals the same step on W=1.

What is compared, and why it is deterministic enough to compare: the two runs sum the same
per-token terms in a different order (each rank's micro-batches, then a reduce-scatter), so their
gradients differ by float32 rounding, ~1e-7 of the gradient's scale. With SGD the update is
−lr · clip · g, so the updates agree to that relative precision, and a sharding bug (a rank whose
loss normaliser is wrong, a micro-batch counted twice, the ×W correction missing) changes them by
O(1) — ``test_the_check_catches_a_wrong_normaliser_on_one_rank`` plants one and checks that the
comparison fails. Adam is checked separately where it is meaningful: Adam's first update is
≈ −lr · sign(g), so on elements whose gradient is rounding noise (|g| ~ 1e-9, far below Adam's
ε = 1e-8) it is noise of size lr; it is compared only where |g| stands well above that noise.
"""

from __future__ import annotations

import json
import multiprocessing as mp
from datetime import timedelta
from pathlib import Path

import pytest

from horizonrl.protocol import Batch
from horizonrl.protocol.transport import free_port

from learner_fixtures import build_tiny_model, groups

pytestmark = pytest.mark.slow

MICRO_BATCH_SIZE = 3  # 7 trainable trajectories: W=1 runs 3 micro-batches; W=2 shares 4 + 3, so one rank pads with an empty one
SGD_LR = 0.5
ADAM_LR = 1e-3


def _one_step(rank: int, world_size: int, port: int, model_dir: str, out_dir: str, variant: str, optimizer: str,
              planted_bug: bool) -> None:
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    from horizonrl.core.runtime import exit_skipping_finalization
    from horizonrl.learner.batching import samples_from_batch
    from horizonrl.learner.model import gather_full_state_dict, load_critic, load_model, load_reference, shard_model, weights_to_send
    from horizonrl.learner.policy_loss import ClipSettings
    from horizonrl.learner.algorithm import AdvantageSettings, LossSettings, UpdateSettings, train_on_batch

    torch.manual_seed(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    try:
        cpu = torch.device("cpu")

        def make_optimizer(params):
            return torch.optim.SGD(params, lr=SGD_LR) if optimizer == "sgd" else torch.optim.AdamW(params, lr=ADAM_LR)

        model = shard_model(load_model(model_dir, "float32", cpu), "cpu")
        estimator, extra = "grpo", {}
        settings = LossSettings(temperature=0.8, clip=ClipSettings(0.2, 0.2))
        steps = 1
        if variant == "gae_kl_entropy":
            # the critic, the frozen reference, asymmetric clip, entropy bonus, seq-mean, and a second
            # step (the critic has learned, the KL is no longer 0): all under FSDP
            estimator, steps = "gae", 2
            critic = shard_model(load_critic(model_dir, "float32", cpu), "cpu")
            extra = dict(
                advantage=AdvantageSettings("gae", gamma=0.95, lam=0.9),
                reference=shard_model(load_reference(model_dir, "float32", cpu), "cpu"),
                critic=critic, critic_optimizer=make_optimizer(critic.parameters()),
            )
            settings = LossSettings(temperature=0.8, clip=ClipSettings(0.1, 0.3), loss_agg_mode="seq-mean-token-mean",
                                    entropy_coeff=0.01, kl_loss_coef=0.1, kl_loss_type="low_var_kl")
        elif variant == "reinforce_plus_plus":
            estimator, extra = variant, dict(advantage=AdvantageSettings(variant, gamma=0.99))
        optim = make_optimizer(model.parameters())
        samples, accounting = samples_from_batch(Batch(run_id="test-run", request_id=1, groups=groups()), True, estimator)
        assert accounting.failed == {"environment": 1} and len(samples) == 7
        if planted_bug and rank == 1:
            # A sharding bug: this rank's copy of the step counts 3 loss tokens fewer, so its loss
            # normaliser (the step's token count N) is not the other rank's.
            samples[-1].loss_mask = samples[-1].loss_mask.clone()
            samples[-1].loss_mask[-3:] = 0
        for step in range(1, steps + 1):
            metrics = train_on_batch(model, optim, samples, rank=rank, world_size=world_size, settings=settings,
                                     update=UpdateSettings(micro_batch_size=MICRO_BATCH_SIZE, grad_clip=1.0),
                                     device=cpu, **extra)
            # the weights after every update (each update is compared on its own), the gradient of the last
            state_dict = gather_full_state_dict(model)
            if rank == 0:
                save_file({k: v.contiguous() for k, v in weights_to_send(model.config, state_dict)},
                          str(Path(out_dir) / f"weights_{step}.safetensors"))
        grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
        if rank == 0:
            save_file({k: v.contiguous() for k, v in grads.items()}, str(Path(out_dir) / "grads.safetensors"))
            (Path(out_dir) / "metrics.json").write_text(json.dumps(metrics))
        dist.barrier()  # tear down together: rank 0 has written its files
    finally:
        dist.destroy_process_group()
    # As the learner does: leave without interpreter finalization, where gloo's threads can abort
    # a process that finished its work (1 run in ~50 here, under load).
    exit_skipping_finalization(0)


def _run(world_size: int, model_dir: Path, out_dir: Path, variant: str = "grpo", optimizer: str = "sgd",
         planted_bug: bool = False) -> dict:
    out_dir.mkdir()
    ctx = mp.get_context("spawn")
    port = free_port()
    processes = [ctx.Process(target=_one_step, args=(rank, world_size, port, str(model_dir), str(out_dir), variant,
                                                     optimizer, planted_bug)) for rank in range(world_size)]
    for process in processes:
        process.start()
    try:
        for process in processes:
            process.join(180)
        assert all(process.exitcode == 0 for process in processes), [process.exitcode for process in processes]
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join(10)
    from safetensors.torch import load_file

    steps = sorted(out_dir.glob("weights_*.safetensors"), key=lambda path: int(path.stem.split("_")[1]))
    return {"steps": [load_file(str(path)) for path in steps], "weights": load_file(str(steps[-1])),
            "grads": load_file(str(out_dir / "grads.safetensors")), "metrics": json.loads((out_dir / "metrics.json").read_text())}


def assert_same_sgd_step(one: dict, two: dict, initial: dict) -> None:
    """W=2 made the same updates as W=1: gradients and each update's weight change agree to float32
    rounding of their scale.

    Each update is compared against its own scale: the net change over two updates can nearly cancel
    for a tensor (step 1 moves it one way, step 2 back), and then the rounding of the two updates,
    each of full size, is not small next to their sum. An update is read as a difference of float32
    weights, so it is known to the weights' resolution only: w + u is rounded to ulp(w) (a norm's
    weights are ≈ 1, ulp 1.2e-7, and their updates can be ~1e-4), hence 2 ulp of the largest weight
    on top of the relative 1e-4."""
    import torch

    ulp = torch.finfo(torch.float32).eps
    assert len(one["steps"]) == len(two["steps"])
    for step, (after_one, after_two) in enumerate(zip(one["steps"], two["steps"]), start=1):
        previous_one = initial if step == 1 else one["steps"][step - 2]
        previous_two = initial if step == 1 else two["steps"][step - 2]
        for name in initial:
            update_one, update_two = after_one[name] - previous_one[name], after_two[name] - previous_two[name]
            scale = float(update_one.abs().max())
            assert scale > 0, f"{name} did not change in update {step}"
            resolution = 2 * ulp * float(previous_one[name].abs().max())
            torch.testing.assert_close(update_two, update_one, rtol=0, atol=1e-4 * scale + resolution,
                                       msg=lambda m: f"update {step}, {name}: {m}")
    for name, grad in one["grads"].items():
        scale = float(grad.abs().max())
        torch.testing.assert_close(two["grads"][name], grad, rtol=0, atol=1e-4 * scale, msg=lambda m: f"{name}: {m}")
    for key, value in one["metrics"].items():
        assert two["metrics"][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.mark.parametrize("variant", ["grpo", "reinforce_plus_plus", "gae_kl_entropy"])
def test_two_ranks_equal_one(tmp_path, model_dir, variant):
    from safetensors.torch import load_file

    one = _run(1, model_dir, tmp_path / "w1", variant)
    two = _run(2, model_dir, tmp_path / "w2", variant)
    if variant == "gae_kl_entropy":
        assert one["metrics"]["loss/kl_ref"] > 0 and "loss/value" in one["metrics"]
        assert one["metrics"]["grad/critic_norm"] > 0
    initial = load_file(str(model_dir / "model.safetensors"))
    assert set(one["weights"]) >= set(initial)
    assert_same_sgd_step(one, two, initial)


def test_the_check_catches_a_wrong_normaliser_on_one_rank(tmp_path, model_dir):
    from safetensors.torch import load_file

    one = _run(1, model_dir, tmp_path / "w1")
    buggy = _run(2, model_dir, tmp_path / "w2", planted_bug=True)
    # it fails where it should: the first update's weights are not close (not an earlier assert of the check)
    with pytest.raises(AssertionError, match=r"update 1, \S+: Tensor-likes are not close"):
        assert_same_sgd_step(one, buggy, load_file(str(model_dir / "model.safetensors")))


def test_adam_update_agrees_where_the_gradient_is_signal(tmp_path, model_dir):
    import torch
    from safetensors.torch import load_file

    one = _run(1, model_dir, tmp_path / "w1", optimizer="adam")
    two = _run(2, model_dir, tmp_path / "w2", optimizer="adam")
    initial = load_file(str(model_dir / "model.safetensors"))
    compared = 0
    for name, before in initial.items():
        grad = one["grads"][name]
        signal = grad.abs() > 1e-4 * float(grad.abs().max())  # >= 1e3 x the rounding noise of the reduction
        update_one, update_two = one["weights"][name] - before, two["weights"][name] - before
        torch.testing.assert_close(update_two[signal], update_one[signal], rtol=0, atol=1e-2 * ADAM_LR, msg=name)
        compared += int(signal.sum())
    assert compared > 0.5 * sum(t.numel() for t in initial.values())  # most of the model is compared
