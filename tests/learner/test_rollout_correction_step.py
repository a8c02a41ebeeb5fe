"""One learner step with each rollout-correction mode on the tiny model (train_on_batch, gloo, W=1), the
settings read from the run config as the learner reads them.

The hand-made trajectories' behaviour log-probs are drawn around the tiny model's own (≈ −log 300), so
ρ = π_old / μ spreads over roughly e^±0.3 and every mode has something to act on. Whole runs exercise the
default (token truncation, configs' default) with real engine log-probs.
"""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist

from horizonrl.core.config import load_config
from horizonrl.learner.batching import samples_from_batch
from horizonrl.learner.algorithm import AlgorithmSettings, UpdateSettings, train_on_batch
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


def _step(model_dir, overrides: list[str], epochs: int = 1) -> dict:
    from horizonrl.learner.model import load_model

    config = load_config("configs/signpost_test.yaml", overrides)
    settings = AlgorithmSettings.from_config(config).loss
    torch.manual_seed(0)
    model = load_model(str(model_dir), "float32", torch.device("cpu"))
    rng = np.random.default_rng(0)
    groups = [[trajectory(rng, f"g{k}", i, r, 24) for i, r in enumerate((1.0, 0.0, 0.0, 1.0))] for k in range(3)]
    samples, _ = samples_from_batch(Batch(run_id="test-run", request_id=1, groups=groups), True)
    return train_on_batch(model, torch.optim.AdamW(model.parameters(), lr=1e-3), samples, rank=0, world_size=1,
                          settings=settings, update=UpdateSettings(ppo_epochs=epochs), device=torch.device("cpu"))


MODES = {
    "none": (["algorithm.rollout_correction.is_level=none"], lambda m: m["correction/mean_factor"] == 1.0),
    "token_tis": (["algorithm.rollout_correction.is_cap=1.05"], lambda m: 0 < m["correction/truncated_fraction"] < 1),
    "sequence_tis": (["algorithm.rollout_correction.is_level=sequence", "algorithm.rollout_correction.is_cap=1.05"],
                     lambda m: 0 < m["correction/truncated_fraction"] < 1),
    "token_reject": (["algorithm.rollout_correction.reject_level=token", "algorithm.rollout_correction.reject_low=0.9",
                      "algorithm.rollout_correction.reject_high=1.1"],
                     lambda m: 0 < m["correction/rejected_fraction"] < 1),
    "sequence_reject": (["algorithm.rollout_correction.reject_level=sequence",
                         "algorithm.rollout_correction.reject_high=1.0"],
                        lambda m: 0 < m["correction/rejected_fraction"] < 1),
    "geometric_reject": (["algorithm.rollout_correction.reject_level=geometric"],
                         lambda m: 0 < m["correction/rejected_fraction"] < 1),
    "turn_drop": (["algorithm.rollout_correction.turn_reject=drop", "algorithm.rollout_correction.turn_kl_bound=0.03"],
                  lambda m: 0 < m["correction/turn_scaled_fraction"] < 1),
    "turn_downweight": (["algorithm.rollout_correction.turn_reject=downweight",
                         "algorithm.rollout_correction.turn_kl_bound=0.03"],
                        lambda m: 0 < m["correction/turn_scaled_fraction"] < 1 and m["correction/mean_factor"] < 1),
}


@pytest.mark.parametrize("decoupled", [False, True], ids=["bypass", "recompute"])
@pytest.mark.parametrize("mode", list(MODES))
def test_one_step_with_each_mode(process_group, model_dir, mode, decoupled):
    overrides, acted = MODES[mode]
    metrics = _step(model_dir, [*overrides, f"learner.decoupled_loss={str(decoupled).lower()}"])
    assert metrics["learner/updates"] == 1
    assert np.isfinite(metrics["loss/policy"]) and metrics["grad/norm"] > 0
    assert metrics["correction/tokens"] > 0
    if mode == "none" and decoupled:  # the untruncated importance weight ρ, not 1
        assert metrics["correction/mean_factor"] != 1.0
    else:
        assert acted(metrics), {k: v for k, v in metrics.items() if k.startswith("correction/") and "turn_" not in k}
    assert metrics["correction/turn_1_k3_kl"] > 0 and "correction/turn_2_removed_fraction" in metrics


def test_rejecting_every_token_leaves_no_gradient(process_group, model_dir):
    """A mask that removes every token removes its gradient too (no entropy or KL term configured)."""
    metrics = _step(model_dir, ["algorithm.rollout_correction.reject_level=token",
                                "algorithm.rollout_correction.reject_low=10", "algorithm.rollout_correction.reject_high=11"])
    assert metrics["correction/rejected_fraction"] == 1.0
    assert metrics["grad/norm"] == 0.0


def test_several_updates_recompute_against_the_policy_before_the_first(process_group, model_dir):
    """With two epochs the recompute anchor is π_prox from the no-grad pass: the second epoch's ρ is the same as
    the first's, so the token TIS truncates the same share of tokens in both (the stats count both updates)."""
    one = _step(model_dir, ["learner.decoupled_loss=true", "algorithm.rollout_correction.is_cap=1.05"])
    two = _step(model_dir, ["learner.decoupled_loss=true", "algorithm.rollout_correction.is_cap=1.05"], epochs=2)
    assert two["learner/updates"] == 2
    assert two["correction/tokens"] == 2 * one["correction/tokens"]
    assert two["correction/truncated_fraction"] == pytest.approx(one["correction/truncated_fraction"])
