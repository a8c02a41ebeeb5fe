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


def _checkpoint_rank(rank: int, world: int, port: int, out: str, refusals: dict, limit_s: float | None) -> None:
    """One of two gloo ranks saving a checkpoint of a tiny (unsharded) model while the disk refuses some parts:
    ``refusals`` maps (rank, "hf" | "rng") to how many times that part is refused."""
    import types
    from datetime import timedelta

    import torch.distributed as dist

    import horizonrl.learner.checkpoint as checkpoint
    import horizonrl.learner.services as services
    from horizonrl.core.config import TrainConfig
    from horizonrl.core.disk import Backoff
    from horizonrl.core.run_events import EventLog, NullEventLog
    from horizonrl.learner.model import save_hf_checkpoint as real_save_hf

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    left = {part: refusals.get((rank, part), 0) for part in ("hf", "rng")}

    def refusing(part, real):
        def write(*args, **kwargs):
            if left[part] > 0:
                left[part] -= 1
                raise OSError(errno.ENOSPC, "No space left on device", str(args[-1]))
            return real(*args, **kwargs)
        return write

    services.save_hf_checkpoint = refusing("hf", real_save_hf)
    checkpoint.torch.save = refusing("rng", torch.save)
    services.Backoff = lambda limit_s: Backoff(first_s=0.05, max_s=0.1, limit_s=limit_s if limit_s is not None else 0.4)
    if limit_s is not None:
        services.CHECKPOINT_RETRY_LIMIT_S = limit_s
    config_hf, state = tiny()
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM(config_hf)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    tr = types.SimpleNamespace(model=model, checkpoint_parts=lambda: {"model": model, "optimizer": optimizer,
                                                                       "scheduler": scheduler})
    res = types.SimpleNamespace(events=EventLog(out, "learner-0") if rank == 0 else NullEventLog(), batches=None)
    config = TrainConfig.model_validate({"run": {"output_dir": out}, "model": {"path": out + "/no-tokenizer"},
                                         "envs": [{"name": "signpost"}]})
    checkpointer = services.TrainStateCheckpointer(config, tr, res, types.SimpleNamespace(rank=rank), timeout_s=60)
    try:
        path = checkpointer.save(7, [(0, 0)], [], 0)
        outcome = f"saved {path} after {checkpointer.counters.checkpoint_write_retries:.0f} retries"
    except checkpoint.CheckpointWriteError as exc:
        outcome = f"gave up: {exc}"
    with open(f"{out}/rank{rank}.txt", "w") as f:
        f.write(outcome)
    dist.destroy_process_group()


@pytest.mark.slow
def test_a_checkpoint_the_disk_refuses_is_written_again_by_every_rank_together_and_counted(tmp_path):
    from learner_fixtures import run_ranks

    from horizonrl.core.run_dirs import STATE_FILE, latest_checkpoint
    from horizonrl.core.run_events import read_events
    from horizonrl.protocol.transport import free_port

    out = str(tmp_path)
    run_ranks(_checkpoint_rank, free_port(), out, {(0, "hf"): 1, (1, "rng"): 2}, None, world=2)
    outcomes = [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)]
    assert all(o.startswith("saved ") and o.endswith("after 3 retries") for o in outcomes), outcomes
    assert latest_checkpoint(out).name == "step_000007" and (latest_checkpoint(out) / STATE_FILE).is_file()
    assert sorted((latest_checkpoint(out) / "rng").iterdir()) == [latest_checkpoint(out) / "rng" / f"rank_{r}.pt"
                                                                  for r in range(2)]
    [failed] = read_events(out, "write_failed")
    [recovered] = read_events(out, "write_recovered")
    assert failed["critical"] and "step_000007" in failed["path"] and "No space" in failed["error"]
    assert recovered["retries"] == 3


@pytest.mark.slow
def test_a_disk_that_never_takes_the_checkpoint_stops_every_rank_alike_after_the_limit(tmp_path):
    from learner_fixtures import run_ranks

    from horizonrl.protocol.transport import free_port

    out = str(tmp_path)
    run_ranks(_checkpoint_rank, free_port(), out, {(1, "rng"): 10**6}, 0.3, world=2)
    outcomes = [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)]
    assert all(o.startswith("gave up: ") and "still refuses" in o for o in outcomes), outcomes
