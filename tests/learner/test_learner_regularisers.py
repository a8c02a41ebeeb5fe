"""Asymmetric / dual clip, decoupled PPO, KL estimators, aggregation and the LR schedule against numpy."""

import math

import numpy as np
import pytest
import torch

from horizonrl.learner.policy_loss import ClipSettings, aggregation_weights, clipped_policy_loss, kl_penalty
from horizonrl.learner.algorithm import lr_multiplier


def _data(seed=0, n=40):
    rng = np.random.default_rng(seed)
    logp = rng.normal(-2, 0.5, size=n)
    mu = logp + rng.normal(0, 0.4, size=n)
    adv = rng.normal(size=n)
    return logp, mu, adv


def test_asymmetric_clip_matches_numpy():
    logp, mu, adv = _data()
    lo, hi = 0.1, 0.3
    r = np.exp(logp - mu)
    ref = np.maximum(-adv * r, -adv * np.clip(r, 1 - lo, 1 + hi))
    got, diag = clipped_policy_loss(torch.tensor(logp), torch.tensor(mu), torch.tensor(adv), ClipSettings(lo, hi))
    np.testing.assert_allclose(got.numpy(), ref, rtol=1e-12)
    clipped = (r < 1 - lo) | (r > 1 + hi)
    assert 0 < clipped.sum() < len(r)  # the data exercises both sides of the clip
    np.testing.assert_allclose(diag["clipped"].numpy(), clipped.astype(float))


def test_dual_clip_bounds_the_loss_of_negative_advantages():
    """Hand-made tokens, ε_low 0.1, ε_high 0.3, c = 2; ℓ = max(−rA, −clip(r)A), then min(ℓ, −cA) where A < 0."""
    ratios = np.array([3.0, 3.0, 1.5, 0.5])
    adv = torch.tensor([-1.0, 1.0, -1.0, -1.0], dtype=torch.float64)
    logp, mu = torch.tensor(np.log(ratios)), torch.zeros(4, dtype=torch.float64)
    without, _ = clipped_policy_loss(logp, mu, adv, ClipSettings(0.1, 0.3))
    dual, _ = clipped_policy_loss(logp, mu, adv, ClipSettings(0.1, 0.3, 2.0))
    # r=3, A=-1: max(3, 1.3) = 3 -> min(3, 2) = 2;  r=3, A=1: max(-3, -1.3) = -1.3;
    # r=1.5, A=-1: max(1.5, 1.3) = 1.5 < 2;         r=0.5, A=-1: max(0.5, 0.9) = 0.9
    np.testing.assert_allclose(without.numpy(), [3.0, -1.3, 1.5, 0.9], rtol=1e-12)
    np.testing.assert_allclose(dual.numpy(), [2.0, -1.3, 1.5, 0.9], rtol=1e-12)


def test_decoupled_loss_weights_by_the_behaviour_ratio_and_has_the_on_policy_gradient():
    """Without a weight given, w = π_prox / μ (AReaL); a truncated one (the rollout correction's) replaces it."""
    logp, mu, adv = _data(1)
    for weight in (None, np.minimum(np.exp(logp - mu), 1.5)):
        logp_t = torch.tensor(logp, requires_grad=True)
        got, diag = clipped_policy_loss(logp_t, torch.tensor(mu), torch.tensor(adv), ClipSettings(0.2, 0.2, None, True),
                                        weight=None if weight is None else torch.tensor(weight))
        w = np.exp(logp - mu) if weight is None else weight
        np.testing.assert_allclose(got.detach().numpy(), -w * adv, rtol=1e-12)  # r̃ = 1 at the proximal policy
        got.sum().backward()
        # ∂/∂logπ of −w·A·π/π_prox at π = π_prox is −w·A
        np.testing.assert_allclose(logp_t.grad.numpy(), -w * adv, rtol=1e-12)
        np.testing.assert_allclose(diag["weight"].numpy(), w, rtol=1e-12)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "low_var_kl"])
def test_kl_estimators(kind):
    logp, ref, _ = _data(2)
    x = ref - logp
    expected = {"k1": -x, "k2": 0.5 * x**2, "k3": np.exp(x) - x - 1, "low_var_kl": np.clip(np.exp(x) - x - 1, -10, 10)}[kind]
    np.testing.assert_allclose(kl_penalty(torch.tensor(logp), torch.tensor(ref), kind).numpy(), expected, rtol=1e-12)
    assert torch.all(kl_penalty(torch.tensor(logp), torch.tensor(logp), kind) == 0)


def test_low_var_kl_is_clamped():
    assert kl_penalty(torch.tensor([0.0]), torch.tensor([20.0]), "low_var_kl").item() == 10.0


def test_aggregation_modes():
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 1, 0, 0, 0]], dtype=torch.float32)
    loss = torch.tensor([[9, 1, 2, 3, 9], [9, 6, 9, 9, 9]], dtype=torch.float32)

    def agg(mode):
        return float((aggregation_weights(mask, mode, num_loss_tokens=4, num_sequences=2) * loss).sum())

    assert agg("token-mean") == pytest.approx((1 + 2 + 3 + 6) / 4)
    assert agg("seq-mean-token-mean") == pytest.approx(((1 + 2 + 3) / 3 + 6) / 2)
    assert agg("seq-mean-token-sum") == pytest.approx(((1 + 2 + 3) + 6) / 2)
    # split by rows (micro-batches or ranks), with the step's global counts: the same sum
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        parts = sum(float((aggregation_weights(mask[i:i + 1], mode, 4, 2) * loss[i:i + 1]).sum()) for i in range(2))
        assert parts == pytest.approx(agg(mode))


def test_lr_schedule():
    assert [lr_multiplier(s, 4, 20, "constant", 0.0) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert lr_multiplier(4, 4, 20, "linear", 0.1) == 1.0
    assert lr_multiplier(12, 4, 20, "linear", 0.1) == pytest.approx(1 - 0.9 * 0.5)
    assert lr_multiplier(20, 4, 20, "linear", 0.1) == pytest.approx(0.1)
    assert lr_multiplier(12, 4, 20, "cosine", 0.0) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_multiplier(100, 0, 20, "cosine", 0.2) == pytest.approx(0.2)
