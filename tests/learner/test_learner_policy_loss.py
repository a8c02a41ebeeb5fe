"""The loss training runs (``micro_batch_loss``) and the log-probabilities it takes, against numpy references."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from horizonrl.learner.batching import MicroBatch
from horizonrl.learner.policy_loss import ClipSettings, PolicyLossStats, clipped_policy_loss, token_logprobs_and_entropy
from horizonrl.learner.algorithm import LossSettings, micro_batch_loss


class FixedLogits(nn.Module):
    """A stand-in for the transformer whose logits (B, T, V) are the parameter: the loss code runs unchanged."""

    def __init__(self, logits: np.ndarray) -> None:
        super().__init__()
        self.logits = nn.Parameter(torch.tensor(logits, dtype=torch.float32))

    def forward(self, input_ids, use_cache=False, logits_to_keep=0):
        # as Hugging Face causal LMs: 0 keeps every position, a tensor the positions it lists
        return SimpleNamespace(logits=self.logits if isinstance(logits_to_keep, int) and logits_to_keep == 0
                               else self.logits[:, logits_to_keep])


def _problem(seed=0, b=3, t=7, v=11):
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 1.5, size=(b, t, v))
    ids = rng.integers(0, v, size=(b, t))
    mask = (rng.random((b, t)) > 0.35).astype(np.float32)
    mask[:, 0] = 0
    mu = rng.normal(-2.3, 0.5, size=(b, t)) * mask
    adv = (rng.normal(size=(b, 1)) * mask).astype(np.float32)
    return logits, ids, mask, mu, adv


def _micro_batch(ids, mask, mu, adv, rows=slice(None)):
    return MicroBatch(torch.tensor(ids[rows]), torch.tensor(mask[rows]), torch.tensor(mu[rows], dtype=torch.float32),
                      torch.tensor(adv[rows]), num_sequences=len(ids[rows]))


def _numpy_loss(logits, ids, mask, mu, adv, temperature, eps, beta, n):
    """Σ_t w_t (ℓ_t − β H_t) with w = 1/N over loss tokens; logits at t−1 predict token t."""
    z = logits[:, :-1] / temperature
    logp_all = z - np.log(np.exp(z).sum(-1, keepdims=True))
    logp = np.take_along_axis(logp_all, ids[:, 1:, None], -1)[..., 0]
    entropy = -(np.exp(logp_all) * logp_all).sum(-1)
    m = mask[:, 1:]
    ratio = np.exp(logp - mu[:, 1:])
    a = adv[:, 1:]
    pg = np.maximum(-a * ratio, -a * np.clip(ratio, 1 - eps, 1 + eps))
    r = ratio[m.astype(bool)]
    return ((pg - beta * entropy) * m).sum() / n, {"clip_fraction": ((r < 1 - eps) | (r > 1 + eps)).mean(),
                                                  "ratio_mean": r.mean(), "entropy": (entropy * m).sum() / m.sum()}


def test_micro_batch_loss_matches_numpy():
    logits, ids, mask, mu, adv = _problem()
    n = int(mask[:, 1:].sum())
    settings = LossSettings(temperature=0.8, clip=ClipSettings(0.2, 0.2), entropy_coeff=0.01)
    model = FixedLogits(logits)
    loss, stats = micro_batch_loss(model, _micro_batch(ids, mask, mu, adv), settings, num_loss_tokens=n, num_sequences=3)
    expected, ref = _numpy_loss(logits, ids, mask, mu, adv, 0.8, 0.2, 0.01, n)
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    metrics = stats.metrics()
    assert ref["clip_fraction"] > 0  # the data exercises the clip
    assert metrics["ratio/clip_fraction"] == pytest.approx(ref["clip_fraction"])
    assert metrics["ratio/mean"] == pytest.approx(ref["ratio_mean"], rel=1e-5)
    assert metrics["loss/entropy"] == pytest.approx(ref["entropy"], rel=1e-5)
    loss.backward()
    # logits at the last position predict nothing; at positions whose next token is not trained, no gradient
    grad = model.logits.grad
    assert torch.all(grad[:, -1] == 0)
    assert torch.all(grad[:, :-1][torch.tensor(mask[:, 1:]) == 0] == 0)
    assert grad.abs().sum() > 0


def test_micro_batches_with_the_global_normaliser_add_up_to_the_whole():
    logits, ids, mask, mu, adv = _problem(seed=1)
    n = int(mask[:, 1:].sum())
    settings = LossSettings(temperature=1.0, clip=ClipSettings(0.2, 0.2))
    whole, _ = micro_batch_loss(FixedLogits(logits), _micro_batch(ids, mask, mu, adv), settings, n, 3)
    total, stats = 0.0, PolicyLossStats()
    for i in range(3):
        part, part_stats = micro_batch_loss(FixedLogits(logits[i:i + 1]), _micro_batch(ids, mask, mu, adv, slice(i, i + 1)),
                                            settings, n, 3)
        total += part.item()
        stats.add(part_stats)
    assert total == pytest.approx(whole.item(), rel=1e-6)
    assert stats.tokens == n


def _nucleus_reference(scaled_logits: np.ndarray, p: float) -> np.ndarray:
    """log-probabilities over the nucleus, from the definition (Holtzman et al., eq. 3), row by row:
    the smallest set of most likely tokens whose probability reaches p, renormalised."""
    out = np.full_like(scaled_logits, -np.inf)
    for row, z in enumerate(scaled_logits):
        probs = np.exp(z - z.max())
        probs /= probs.sum()
        order = np.argsort(-probs, kind="stable")
        keep, mass = [], 0.0
        for token in order:
            keep.append(token)
            mass += probs[token]
            if mass >= p:
                break
        kept = z[keep]
        out[row, keep] = kept - np.log(np.exp(kept - kept.max()).sum()) - kept.max()
    return out


@pytest.mark.parametrize("top_p", [1.0, 0.9, 0.5, 0.05])
def test_logprobs_are_over_the_engines_nucleus(top_p):
    rng = np.random.default_rng(2)
    logits = rng.normal(0, 2.0, size=(64, 50))
    temperature = 0.7
    reference = _nucleus_reference(logits / temperature, top_p)
    targets = np.array([rng.choice(np.flatnonzero(np.isfinite(row))) for row in reference])  # sampled inside
    logp, entropy = token_logprobs_and_entropy(torch.tensor(logits), torch.tensor(targets), temperature, top_p)
    np.testing.assert_allclose(logp.numpy(), reference[np.arange(64), targets], rtol=1e-5, atol=1e-6)
    probs = np.exp(reference)
    np.testing.assert_allclose(entropy.numpy(), -(probs * np.where(probs > 0, reference, 0)).sum(-1), rtol=1e-5,
                               atol=1e-6)
    if top_p < 1:  # the full softmax (what the learner used to take) is a different distribution
        full, _ = token_logprobs_and_entropy(torch.tensor(logits), torch.tensor(targets), temperature)
        assert (logp - full).min() > 1e-3


def test_a_token_outside_the_current_nucleus_gives_no_gradient_and_no_nan():
    logprobs = torch.tensor([float("-inf"), -1.0], requires_grad=True)
    loss, diag = clipped_policy_loss(logprobs, torch.tensor([-2.0, -1.2]), torch.tensor([1.0, -1.0]), ClipSettings())
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(logprobs.grad).all()
    assert logprobs.grad[0] == 0 and diag["ratio"][0] == 0
    stats = PolicyLossStats.from_tokens(loss, diag["ratio"], diag["clipped"])
    assert np.isfinite(stats.metrics()["loss/approx_kl"])


def _nucleus_problem(top_p, seed=3, b=2, t=9, v=13):
    """Sharp logits (so the nucleus leaves tokens out) and, in each row, one target outside the nucleus."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 3.0, size=(b, t, v))
    ids = rng.integers(0, v, size=(b, t))
    reference = _nucleus_reference(logits[:, :-1].reshape(-1, v), top_p).reshape(b, t - 1, v)
    for row in range(b):  # the token at position 2 was sampled by an older policy and is outside the nucleus now
        ids[row, 2] = int(np.flatnonzero(~np.isfinite(reference[row, 1]))[0])
    mask = np.ones((b, t), dtype=np.float32)
    mask[:, 0] = 0
    mu = np.full((b, t), -1.0) * mask
    adv = (np.array([[1.0], [-1.0]]) * mask).astype(np.float32)
    return logits, ids, mask, mu, adv


@pytest.mark.parametrize("entropy_coeff", [0.0, 0.01])
def test_a_step_under_top_p_has_finite_gradients_and_the_untruncated_kl(entropy_coeff):
    """The loss training runs with rollout.top_p < 1, a reference model and the entropy term: the
    gradient is finite everywhere (the nucleus puts −inf in the log-probabilities; entropy's
    0 · log 0 and KL's e^(+∞) must not turn it into NaN), and the KL is between the full distributions."""
    top_p, temperature = 0.6, 0.9
    logits, ids, mask, mu, adv = _nucleus_problem(top_p)
    n = int(mask[:, 1:].sum())
    settings = LossSettings(temperature=temperature, top_p=top_p, clip=ClipSettings(0.2, 0.2), entropy_coeff=entropy_coeff,
                            kl_loss_coef=0.1, kl_loss_type="k3")
    model = FixedLogits(logits)
    reference_logits = logits + np.random.default_rng(9).normal(0, 0.5, size=logits.shape)
    loss, stats = micro_batch_loss(model, _micro_batch(ids, mask, mu, adv), settings, n, 2,
                                   reference=FixedLogits(reference_logits))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(model.logits.grad).all()
    assert model.logits.grad.abs().sum() > 0

    def full_logp(z):
        z = z[:, :-1] / temperature
        z = z - z.max(-1, keepdims=True)
        return np.take_along_axis(z - np.log(np.exp(z).sum(-1, keepdims=True)), ids[:, 1:, None], -1)[..., 0]

    x = full_logp(reference_logits) - full_logp(logits)  # log π_ref − log π_θ, untruncated
    assert stats.kl_ref_sum == pytest.approx(float((np.exp(x) - x - 1).sum()), rel=1e-5)


def test_entropy_gradient_survives_probabilities_that_underflow():
    """A low temperature spreads logits / T over more than float32's exp range: p = 0 for some tokens
    even with top_p = 1. The entropy bonus's gradient must stay finite (entr's is −(1 + log 0) · 0 = NaN)."""
    logits = torch.tensor([[0.0, -30.0, 1.0, -45.0]], requires_grad=True)
    logp, entropy = token_logprobs_and_entropy(logits, torch.tensor([2]), temperature=0.2)
    assert torch.exp(torch.log_softmax(logits / 0.2, -1))[0, 3] == 0  # the case: an underflowed probability
    (logp.sum() - 0.01 * entropy.sum()).backward()
    assert torch.isfinite(logits.grad).all()
    p = torch.softmax(logits.detach() / 0.2, -1)
    assert entropy.item() == pytest.approx(float(-(p[p > 0] * p[p > 0].log()).sum()), rel=1e-6)


@pytest.mark.parametrize("architecture", ["qwen2", "llama"])
def test_logits_at_the_loss_positions_only_equal_the_full_logits_rows_and_gradients(architecture):
    """``loss_token_logits`` runs the output layer only where some sequence has a loss token; its rows, and the
    gradients of a loss on them, are those of the full (B, T, V) logits, in the same order — on real Hugging Face
    causal LMs (random weights; the tiny model is a Qwen2, SmolLM2 a Llama)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from horizonrl.learner.model import loss_token_logits, takes_logits_to_keep

    torch.manual_seed(0)
    shape = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    model = (Qwen2ForCausalLM(Qwen2Config(**shape)) if architecture == "qwen2"
             else LlamaForCausalLM(LlamaConfig(**shape))).float()
    rng = np.random.default_rng(1)
    ids = torch.tensor(rng.integers(0, 97, size=(3, 20)))
    mask = torch.zeros(3, 20)
    mask[0, 5:9], mask[1, 12:15], mask[2, 5:7], mask[2, 17:20] = 1, 1, 1, 1  # replies at different places
    selected = mask[:, 1:].bool()
    assert takes_logits_to_keep(model)  # the kept way is the one compared here, not the fallback
    full = model(input_ids=ids, use_cache=False).logits[:, :-1][selected]
    (full.float().log_softmax(-1)[:, 0].sum()).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    kept = loss_token_logits(model, ids, selected)
    (kept.float().log_softmax(-1)[:, 0].sum()).backward()
    assert kept.shape == full.shape == (int(selected.sum()), 97)
    torch.testing.assert_close(kept, full, rtol=1e-5, atol=1e-5)
    for before, p in zip(grads, model.parameters()):
        torch.testing.assert_close(p.grad, before, rtol=1e-4, atol=1e-6)
    # a micro-batch with no loss token at all (a rank's padding row) gives no rows, and no error
    assert loss_token_logits(model, ids[:1], torch.zeros(1, 19, dtype=torch.bool)).shape == (0, 97)


def test_a_model_without_logits_to_keep_gets_the_full_logits_rows():
    """A model whose forward takes no ``logits_to_keep`` (an older or custom class) still gets the loss rows."""
    from horizonrl.learner.model import loss_token_logits

    class Plain(nn.Module):
        def __init__(self, logits: torch.Tensor) -> None:
            super().__init__()
            self.logits = logits

        def forward(self, input_ids, use_cache=False):
            return SimpleNamespace(logits=self.logits)

    logits, ids, mask, _, _ = _problem()
    full = torch.tensor(logits, dtype=torch.float32)
    selected = torch.tensor(mask)[:, 1:].bool()
    rows = loss_token_logits(Plain(full), torch.tensor(ids), selected)
    assert torch.equal(rows, full[:, :-1][selected])
    assert torch.equal(loss_token_logits(FixedLogits(logits), torch.tensor(ids), selected), rows)  # the kept way
