"""One learner step's optimizer updates (``train_on_batch``) on the tiny model, in one process (gloo, W=1).

The FSDP-sharded equivalent (W=2 vs W=1) is tests/learner/test_learner_fsdp_step.py.
"""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist

from horizonrl.learner.batching import samples_from_batch
from horizonrl.learner.policy_loss import ClipSettings
from horizonrl.learner.algorithm import LossSettings, UpdateSettings, train_on_batch
from horizonrl.protocol import Batch
from horizonrl.protocol.transport import free_port

from learner_fixtures import build_tiny_model, trajectory


@pytest.fixture(scope="module")
def process_group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


def _model(model_dir):
    from horizonrl.learner.model import load_model

    return load_model(str(model_dir), "float32", torch.device("cpu"))


def _groups(seed: int, count: int, rewards=(1.0, 0.0, 0.0, 1.0)) -> list:
    rng = np.random.default_rng(seed)
    return [[trajectory(rng, f"g{k}", i, r, 18) for i, r in enumerate(rewards)] for k in range(count)]


def _step(model, optimizer, groups, *, settings: LossSettings, update: UpdateSettings) -> dict:
    samples, _ = samples_from_batch(Batch(run_id="test-run", request_id=1, groups=groups), True)
    return train_on_batch(model, optimizer, samples, rank=0, world_size=1, settings=settings, update=update,
                          device=torch.device("cpu"))


def test_decoupled_ppo_clips_later_updates_against_the_policy_before_the_first(process_group, model_dir):
    """With one update per step π_prox = π_θ and the clip cannot act; with several it must."""
    settings = LossSettings(temperature=1.0, clip=ClipSettings(0.2, 0.2, decoupled=True))
    model = _model(model_dir)
    single = _step(model, torch.optim.AdamW(model.parameters(), lr=1e-2), _groups(0, 2),
                   settings=settings, update=UpdateSettings(ppo_epochs=1))
    assert single["learner/updates"] == 1 and single["ratio/clip_fraction"] == 0.0

    model = _model(model_dir)
    several = _step(model, torch.optim.AdamW(model.parameters(), lr=1e-2), _groups(0, 2),
                    settings=settings, update=UpdateSettings(ppo_epochs=3, ppo_mini_batch_size=1))
    assert several["learner/updates"] == 6  # 3 epochs x 2 mini-batches of one group
    assert several["ratio/clip_fraction"] > 0.05


def test_zero_signal_groups_do_not_dilute_the_update(process_group, model_dir):
    """A batch with an equal-reward group updates the policy exactly as the batch without it: it is
    not in the token normaliser and gets neither the entropy bonus nor the update's other terms."""
    settings = LossSettings(temperature=1.0, clip=ClipSettings(0.2, 0.2), entropy_coeff=0.05)
    informative = _groups(1, 1)
    equal = _groups(2, 1, rewards=(1.0, 1.0, 1.0, 1.0))
    after = []
    for groups in (informative + equal, informative):
        model = _model(model_dir)
        metrics = _step(model, torch.optim.SGD(model.parameters(), lr=0.5), groups, settings=settings,
                        update=UpdateSettings())
        after.append({name: p.detach().clone() for name, p in model.named_parameters()})
        assert metrics["learner/updates"] == 1
    moved = 0.0
    initial = {name: p.detach() for name, p in _model(model_dir).named_parameters()}
    for name, weights in after[0].items():
        torch.testing.assert_close(weights, after[1][name], rtol=0, atol=1e-7, msg=name)
        moved = max(moved, float((weights - initial[name]).abs().max()))
    assert moved > 1e-3  # the update is large enough for a diluted one to differ


def test_a_batch_without_signal_makes_no_update(process_group, model_dir):
    model = _model(model_dir)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    metrics = _step(model, torch.optim.SGD(model.parameters(), lr=0.5), _groups(3, 2, rewards=(0.0, 0.0)),
                    settings=LossSettings(), update=UpdateSettings())
    assert metrics["learner/updates"] == 0
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name


def test_the_mismatch_metric_measures_each_turn_of_the_current_weights(process_group, model_dir):
    """Behaviour log-probs equal to the model's own on turn 1 and 0.3 below on turn 2: the per-turn mismatch reads
    ~0 and 0.3; tokens of other weights are not measured (their gap is policy lag, not mismatch)."""
    import msgspec

    from horizonrl.learner.policy_loss import token_logprobs
    from horizonrl.protocol.arrays import LOGPROB_DTYPE, MASK_DTYPE, TOKEN_DTYPE, pack, unpack

    model = _model(model_dir)
    groups = _groups(3, 1)
    for k, t in enumerate(groups[0]):
        ids = torch.from_numpy(unpack(t.token_ids, TOKEN_DTYPE).astype("int64"))[None]
        mask = unpack(t.loss_mask, MASK_DTYPE).astype(bool)
        with torch.no_grad():
            own = torch.zeros(ids.shape[1])
            own[1:] = token_logprobs(model(input_ids=ids).logits[0, :-1], ids[0, 1:], 1.0)
        start, end = t.turn_spans[1]
        own[start:end] -= 0.3
        groups[0][k] = msgspec.structs.replace(t, logprobs=pack(np.where(mask, own.numpy(), 0.0), LOGPROB_DTYPE))

    def step(current_weights):
        samples, _ = samples_from_batch(Batch(run_id="test-run", request_id=1, groups=groups), True,
                                        current_weights=current_weights)
        fresh = _model(model_dir)  # the weights the behaviour log-probs were taken from
        return train_on_batch(fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-3), samples, rank=0, world_size=1,
                              settings=LossSettings(), update=UpdateSettings(), device=torch.device("cpu"))

    metrics = step((0, 0))
    assert metrics["mismatch/turn_1_mean"] < 1e-5 and metrics["mismatch/turn_1_max"] < 1e-5
    assert metrics["mismatch/turn_2_mean"] == pytest.approx(0.3, abs=1e-4)
    assert metrics["mismatch/turn_2_max"] == pytest.approx(0.3, abs=1e-4)
    assert metrics["mismatch/tokens"] == sum(int(unpack(t.loss_mask, MASK_DTYPE)[1:].sum()) for t in groups[0])
    assert not any(key.startswith("mismatch/") for key in step((0, 1)))
