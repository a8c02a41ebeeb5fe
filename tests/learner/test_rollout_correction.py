"""The rollout correction (learner/rollout_correction.py) on values computed by hand, each mode alone.

Five loss tokens in two sequences (rows), the first with two turns:

    token  row  turn   ρ = π_old / μ
      0     0    1      0.5
      1     0    1      1.0
      2     0    2      4.0
      3     1    1      2.0
      4     1    1      1.5
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from horizonrl.core.config import RolloutCorrectionConfig
from horizonrl.learner.policy_loss import ClipSettings, clipped_policy_loss
from horizonrl.learner.rollout_correction import CorrectionSettings, CorrectionStats, k3, rollout_correction

RHO = [0.5, 1.0, 4.0, 2.0, 1.5]
ROWS = torch.tensor([0, 0, 0, 1, 1])
TURNS = torch.tensor([1, 1, 2, 1, 1])


def _correct(settings: CorrectionSettings, bypass: bool):
    return rollout_correction(torch.log(torch.tensor(RHO, dtype=torch.float64)), ROWS, TURNS, settings, bypass)


def _close(tensor, expected):
    np.testing.assert_allclose(tensor.double().numpy(), expected, rtol=1e-6, atol=1e-12)


def test_no_correction_is_the_plain_importance_weight():
    """Recompute: W = ρ (AReaL's decoupled weight); bypass: 1 (the ratio π_θ / μ already carries ρ)."""
    _close(_correct(CorrectionSettings(), bypass=False).factor, RHO)
    _close(_correct(CorrectionSettings(), bypass=True).factor, [1.0] * 5)


def test_token_truncation():
    """C = 2: W = min(ρ_t, 2) = [0.5, 1, 2, 2, 1.5]; only token 2 is truncated (2.0 sits at the cap)."""
    settings = CorrectionSettings(is_level="token", is_cap=2.0)
    recompute = _correct(settings, bypass=False)
    _close(recompute.factor, [0.5, 1.0, 2.0, 2.0, 1.5])
    assert recompute.truncated.tolist() == [False, False, True, False, False]
    # bypass: W / ρ = min(1, C / ρ)
    _close(_correct(settings, bypass=True).factor, [1.0, 1.0, 0.5, 1.0, 1.0])


def test_sequence_truncation():
    """Π ρ: row 0 0.5·1·4 = 2, row 1 2·1.5 = 3; C = 1.5 truncates both to 1.5 on every token."""
    settings = CorrectionSettings(is_level="sequence", is_cap=1.5)
    recompute = _correct(settings, bypass=False)
    _close(recompute.factor, [1.5] * 5)
    assert recompute.truncated.all()
    _close(_correct(settings, bypass=True).factor, [1.5 / 0.5, 1.5 / 1.0, 1.5 / 4.0, 1.5 / 2.0, 1.5 / 1.5])
    # a cap above both products truncates nothing: W = Π ρ
    loose = _correct(CorrectionSettings(is_level="sequence", is_cap=10.0), bypass=False)
    _close(loose.factor, [2.0, 2.0, 2.0, 3.0, 3.0])
    assert not loose.truncated.any()


def test_token_rejection_is_two_sided_and_keeps_the_bounds():
    """[L, U] = [0.5, 3]: ρ = 4 is out; 0.5 (= L) stays. With the token TIS it composes: W · M."""
    settings = CorrectionSettings(reject_level="token", reject_low=0.5, reject_high=3.0)
    out = _correct(settings, bypass=False)
    assert out.rejected.tolist() == [False, False, True, False, False]
    _close(out.factor, [0.5, 1.0, 0.0, 2.0, 1.5])
    below = _correct(CorrectionSettings(reject_level="token", reject_low=0.6, reject_high=3.0), bypass=True)
    assert below.rejected.tolist() == [True, False, True, False, False]
    _close(below.factor, [0.0, 1.0, 0.0, 1.0, 1.0])


def test_sequence_rejection():
    """Π ρ = 2 (row 0) and 3 (row 1); U = 2.5 rejects row 1 whole."""
    out = _correct(CorrectionSettings(reject_level="sequence", reject_low=0.0, reject_high=2.5), bypass=True)
    assert out.rejected.tolist() == [False, False, False, True, True]
    _close(out.factor, [1.0, 1.0, 1.0, 0.0, 0.0])


def test_geometric_rejection():
    """exp(mean log ρ): row 0 2^(1/3) = 1.26, row 1 √3 = 1.73; [0.9, 1.3] keeps row 0 only, [0.9, 1.2] neither."""
    keep_first = _correct(CorrectionSettings(reject_level="geometric", reject_low=0.9, reject_high=1.3), bypass=True)
    assert keep_first.rejected.tolist() == [False, False, False, True, True]
    neither = _correct(CorrectionSettings(reject_level="geometric", reject_low=0.9, reject_high=1.2), bypass=True)
    assert neither.rejected.all()


# k3 = ρ − 1 − ln ρ per token; the turn's KL is its tokens' mean
K3 = [0.5 - 1 - math.log(0.5), 0.0, 3.0 - math.log(4.0), 1.0 - math.log(2.0), 0.5 - math.log(1.5)]
TURN_KL = [(K3[0] + K3[1]) / 2, K3[2], (K3[3] + K3[4]) / 2]  # (row 0, turn 1) 0.097, (row 0, turn 2) 1.61, (row 1, turn 1) 0.20


def test_per_turn_drop_removes_only_the_turns_over_the_bound():
    """B = 0.15: turn 2 of row 0 (1.61) and row 1's turn (0.20) go; row 0's first turn (0.097) trains."""
    assert TURN_KL[0] < 0.15 < TURN_KL[2] < TURN_KL[1]
    out = _correct(CorrectionSettings(turn_action="drop", turn_kl_bound=0.15), bypass=True)
    assert out.turn_scaled.tolist() == [False, False, True, True, True]
    _close(out.factor, [1.0, 1.0, 0.0, 0.0, 0.0])


def test_per_turn_downweight_scales_by_the_bound_over_the_turns_kl():
    out = _correct(CorrectionSettings(turn_action="downweight", turn_kl_bound=0.15), bypass=False)
    b = 0.15
    _close(out.factor, [0.5, 1.0, 4.0 * b / TURN_KL[1], 2.0 * b / TURN_KL[2], 1.5 * b / TURN_KL[2]])


def test_k3_is_the_kl_estimate():
    _close(k3(torch.log(torch.tensor(RHO, dtype=torch.float64))), K3)


def test_both_anchors_weigh_the_first_update_by_the_same_corrected_weight():
    """At the first update π_θ = π_old. Recompute: ℓ = −W·clip(π_θ/π_old)·A, so ∂ℓ/∂log π_θ = −W A; bypass:
    ℓ = −(W/ρ)·(π_θ/μ)·A, so ∂ℓ/∂log π_θ = −(W/ρ)·ρ·A = −W A. With a clip too wide to act, the same gradient."""
    rng = np.random.default_rng(0)
    mu = torch.tensor(rng.normal(-2.0, 0.3, size=5))
    old = mu + torch.log(torch.tensor(RHO, dtype=torch.float64))  # log π_old = log μ + log ρ
    adv = torch.tensor(rng.normal(size=5))
    wide = (10.0, 10.0)
    for settings in (CorrectionSettings(is_level="token", is_cap=2.0),
                     CorrectionSettings(is_level="sequence", is_cap=1.5, reject_level="token", reject_low=0.5,
                                        reject_high=3.0)):
        grads = []
        for decoupled in (False, True):
            logprobs = old.clone().requires_grad_(True)
            correction = rollout_correction(old - mu, ROWS, TURNS, settings, bypass=not decoupled)
            loss, _ = clipped_policy_loss(logprobs, mu, adv, ClipSettings(*wide, decoupled=decoupled),
                                          old if decoupled else None, weight=correction.factor.double())
            loss.sum().backward()
            grads.append(logprobs.grad.numpy())
        np.testing.assert_allclose(grads[0], grads[1], rtol=1e-6)
        expected_w = _correct(settings, bypass=False).factor.double().numpy()
        np.testing.assert_allclose(grads[1], -expected_w * adv.numpy(), rtol=1e-6)


def test_stats_report_the_shares_and_the_per_turn_breakdown():
    stats = CorrectionStats()
    stats.add(_correct(CorrectionSettings(is_level="token", is_cap=2.0, turn_action="drop", turn_kl_bound=0.15),
                       bypass=True), TURNS)
    m = stats.all_reduce().metrics()
    assert m["correction/tokens"] == 5
    assert m["correction/k3_kl"] == pytest.approx(sum(K3) / 5)
    assert m["correction/truncated_fraction"] == pytest.approx(1 / 5)
    assert m["correction/turn_scaled_fraction"] == pytest.approx(3 / 5)
    assert m["correction/rejected_fraction"] == 0.0
    # turn 1: tokens 0, 1 (row 0) and 3, 4 (row 1: dropped); turn 2: token 2 (dropped)
    assert m["correction/turn_1_k3_kl"] == pytest.approx((K3[0] + K3[1] + K3[3] + K3[4]) / 4)
    assert m["correction/turn_1_removed_fraction"] == pytest.approx(2 / 4)
    assert m["correction/turn_2_removed_fraction"] == 1.0
    assert CorrectionStats().metrics() == {}


def test_empty_micro_batch():
    empty = rollout_correction(torch.zeros(0), torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
                               CorrectionSettings(is_level="sequence", reject_level="geometric", turn_action="drop"),
                               bypass=True)
    assert empty.factor.numel() == 0


def test_config_bounds_and_errors():
    assert RolloutCorrectionConfig().is_level == "token" and RolloutCorrectionConfig().is_cap == 2.0
    assert RolloutCorrectionConfig(reject_level="token").reject_bounds == (0.5, 5.0)
    assert RolloutCorrectionConfig(reject_level="geometric").reject_bounds == (0.99, 1.01)
    assert RolloutCorrectionConfig(reject_level="sequence", reject_high=4.0).reject_bounds == (0.0, 4.0)
    with pytest.raises(ValueError, match="reject_low"):
        RolloutCorrectionConfig(reject_level="token", reject_low=6.0)


def test_the_old_cap_setting_names_its_replacement():
    from horizonrl.core.config import load_config

    with pytest.raises(ValueError, match="algorithm.rollout_correction"):
        load_config("configs/signpost_test.yaml", ["learner.behav_imp_weight_cap=1.5"])
