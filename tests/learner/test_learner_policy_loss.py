"""The clipped surrogate and its metrics against a numpy reference."""

import numpy as np
import torch

from horizonrl.learner.policy_loss import PolicyLossStats, ppo_clip_loss, token_logprobs_and_entropy


def _reference(logp, mu, adv, mask, eps, n):
    ratio = np.exp(logp - mu)
    loss_tok = -np.minimum(ratio * adv, np.clip(ratio, 1 - eps, 1 + eps) * adv)
    m = mask.astype(bool)
    r = ratio[m]
    return {
        "loss": (loss_tok * mask).sum() / n,
        "ratio_mean": r.mean(),
        "ratio_min": r.min(),
        "ratio_max": r.max(),
        "clip_fraction": (np.abs(r - 1) > eps).mean(),
        "kl": ((r - 1) - np.log(r)).mean(),
    }


def test_ppo_clip_loss_matches_numpy():
    rng = np.random.default_rng(0)
    logp = rng.normal(-2, 0.5, size=(3, 6))
    mu = logp + rng.normal(0, 0.3, size=(3, 6))
    adv = rng.normal(size=(3, 1)).repeat(6, axis=1)
    mask = (rng.random((3, 6)) > 0.4).astype(np.float64)
    n = int(mask.sum())
    ref = _reference(logp, mu, adv * mask, mask, 0.2, n)

    logp_t = torch.tensor(logp, requires_grad=True)
    loss, stats = ppo_clip_loss(logp_t, torch.tensor(mu), torch.tensor(adv * mask), torch.tensor(mask), 0.2, n)
    metrics = stats.metrics()
    np.testing.assert_allclose(loss.item(), ref["loss"], rtol=1e-12)
    np.testing.assert_allclose(metrics["loss/policy"], ref["loss"], rtol=1e-12)
    np.testing.assert_allclose(metrics["ratio/mean"], ref["ratio_mean"], rtol=1e-12)
    np.testing.assert_allclose(metrics["ratio/min"], ref["ratio_min"], rtol=1e-12)
    np.testing.assert_allclose(metrics["ratio/max"], ref["ratio_max"], rtol=1e-12)
    np.testing.assert_allclose(metrics["ratio/clip_fraction"], ref["clip_fraction"], rtol=1e-12)
    np.testing.assert_allclose(metrics["loss/approx_kl"], ref["kl"], rtol=1e-10)
    loss.backward()
    assert torch.all(logp_t.grad[torch.tensor(mask) == 0] == 0)


def test_global_normaliser_makes_splits_add_up():
    rng = np.random.default_rng(1)
    logp, mu, adv = (torch.tensor(rng.normal(size=(4, 5))) for _ in range(3))
    mask = torch.tensor((rng.random((4, 5)) > 0.3).astype(np.float64))
    n = int(mask.sum())
    whole, _ = ppo_clip_loss(logp, mu, adv, mask, 0.2, n)
    parts = [ppo_clip_loss(logp[i : i + 1], mu[i : i + 1], adv[i : i + 1], mask[i : i + 1], 0.2, n) for i in range(4)]
    torch.testing.assert_close(sum(loss for loss, _ in parts), whole)
    total = PolicyLossStats()
    for _, stats in parts:
        total.add(stats)
    assert total.tokens == n


def test_logprobs_use_temperature_and_entropy():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(5, 7))
    targets = rng.integers(0, 7, size=5)
    temperature = 0.7
    z = logits / temperature
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    got_logp, got_entropy = token_logprobs_and_entropy(torch.tensor(logits), torch.tensor(targets), temperature)
    np.testing.assert_allclose(got_logp.numpy(), logp[np.arange(5), targets], rtol=1e-6)
    np.testing.assert_allclose(got_entropy.numpy(), -(np.exp(logp) * logp).sum(-1), rtol=1e-6)
