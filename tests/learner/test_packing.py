"""Packed rows (learner/packing.py): first-fit decreasing within the row limit, and a packed forward that gives
each sequence exactly its unpacked log-probabilities (no token attends to another sequence), so the SFT loss and
its gradient are those of padding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from horizonrl.learner.packing import pack_rows, packed_batch, padding_share


def test_first_fit_decreasing_keeps_every_row_within_the_limit():
    lengths = [300, 120, 500, 80, 260, 200, 541, 90]
    rows = pack_rows(lengths, 600)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))  # each sequence exactly once
    assert all(sum(lengths[i] for i in row) <= 600 for row in rows)
    assert len(rows) == 4  # 2,091 tokens in rows of 600: four is the fewest
    assert rows[0][0] == 6  # the longest first
    assert pack_rows([700, 10], 600) == [[0], [1]]  # too long for a row: a row of its own
    assert padding_share(lengths, rows) < padding_share(lengths, [[i] for i in range(len(lengths))])
    with pytest.raises(ValueError):
        pack_rows([1], 0)


def test_packed_rows_restart_positions_and_mask_each_sequences_first_token():
    sequences = [(np.array([5, 6, 7]), np.array([0, 1, 1])), (np.array([8, 9]), np.array([1, 1]))]
    ids, mask, positions = packed_batch(sequences, [[0, 1]], torch.device("cpu"))
    assert ids.tolist() == [[5, 6, 7, 8, 9]]
    assert positions.tolist() == [[0, 1, 2, 0, 1]]
    assert mask.tolist() == [[0, 1, 1, 0, 1]]  # 8 is not predicted from 7


def test_a_packed_forward_gives_each_sequence_its_own_logprobs():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from horizonrl.learner.offline import sequence_logprobs

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                         attn_implementation="sdpa")).eval()
    rng = np.random.default_rng(0)
    sequences = []
    for length in (17, 9, 30, 12, 5):
        mask = (rng.random(length) < 0.5).astype(np.uint8)
        mask[0] = 0
        sequences.append((rng.integers(1, 64, size=length), mask))
    cpu = torch.device("cpu")
    with torch.no_grad():
        rows = pack_rows([len(ids) for ids, _ in sequences], 40)
        assert len(rows) < len(sequences)  # several sequences share a row, so attention across them could leak
        ids, mask, positions = packed_batch(sequences, rows, cpu)
        packed = sequence_logprobs(model, ids, mask, positions)[0]
        # the packed loss tokens come row by row, each row's sequences in placement order
        alone = torch.cat([sequence_logprobs(model, *packed_batch([sequences[i]], [[0]], cpu))[0]
                           for row in rows for i in row])
        leaking = sequence_logprobs(model, ids, mask)[0]  # the same rows read as one sequence each
    assert packed.numel() == alone.numel() == sum(int(m[1:].sum()) for _, m in sequences)
    torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-4)
    assert float((leaking - alone).abs().max()) > 1e-2  # the check can fail: attention across sequences shows


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_the_rl_loss_on_packed_rows_equals_the_padded_one(mode):
    """learner.pack_tokens: the step's loss and every gradient as with padded rows, for both kinds of aggregation and a
    per-sequence rollout correction (which must see sequences, not rows)."""
    import sys
    from pathlib import Path

    from transformers import Qwen2Config, Qwen2ForCausalLM

    from horizonrl.learner.batching import micro_batches_for_rank, samples_from_batch
    from horizonrl.learner.rollout_correction import CorrectionSettings
    from horizonrl.learner.algorithm import LossSettings, micro_batch_loss
    from horizonrl.protocol import Batch

    sys.path.insert(0, str(Path(__file__).parent))
    from learner_fixtures import VOCAB, groups

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                         attn_implementation="sdpa"))
    samples, _ = samples_from_batch(Batch(run_id="test-run", request_id=1, groups=groups()), True, "grpo")
    settings = LossSettings(temperature=0.8, loss_agg_mode=mode,
                            correction=CorrectionSettings(is_level="sequence", is_cap=2.0))
    n_tokens, n_seqs = sum(s.num_loss_tokens for s in samples), len(samples)

    def loss_and_grads(**packing):
        model.zero_grad(set_to_none=True)
        micro = micro_batches_for_rank(samples, 0, 1, micro_batch_size=3, **packing)
        total = sum(micro_batch_loss(model, mb, settings, n_tokens, n_seqs)[0] for mb in micro)
        total.backward()
        return float(total.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}, micro

    padded_loss, padded_grads, _ = loss_and_grads()
    packed_loss, packed_grads, packed = loss_and_grads(pack_tokens=48)
    assert any(mb.num_sequences > 1 for mb in packed) and all(mb.input_ids.shape[0] == 1 for mb in packed)
    assert sum(mb.num_sequences for mb in packed) == n_seqs
    assert packed_loss == pytest.approx(padded_loss, rel=1e-5, abs=1e-6)
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
