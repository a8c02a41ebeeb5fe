"""A checkpoint that cannot be written (a full disk) leaves no ``step_*.tmp`` behind, and one left by a
learner killed while saving is removed by the next save."""

from __future__ import annotations

import errno

import pytest
import torch
from transformers import Qwen2Config

from horizonrl.learner.model import save_hf_checkpoint


def tiny() -> tuple[Qwen2Config, dict[str, torch.Tensor]]:
    config = Qwen2Config(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1, tie_word_embeddings=False)
    return config, {"model.embed_tokens.weight": torch.zeros(16, 8), "lm_head.weight": torch.ones(16, 8)}


def test_a_failed_save_leaves_no_partial_checkpoint_and_a_stale_one_is_removed(tmp_path, monkeypatch):
    import safetensors.torch

    config, state = tiny()
    root = tmp_path / "checkpoints"
    stale = root / "step_000003.tmp"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half")

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        save_hf_checkpoint(config, state, str(tmp_path / "no-tokenizer"), root / "step_000004")
    assert sorted(p.name for p in root.iterdir()) == []  # neither the stale one nor this one's
    monkeypatch.undo()
    stale.mkdir()
    out = save_hf_checkpoint(config, state, str(tmp_path / "no-tokenizer"), root / "step_000005")
    assert sorted(p.name for p in root.iterdir()) == ["step_000005"] and (out / "model.safetensors").is_file()
