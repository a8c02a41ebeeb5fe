"""The full training state, saved with torch distributed checkpointing (DCP) and restored exactly.

A checkpoint directory ``<output_dir>/checkpoints/step_N/`` holds

    config.json, model.safetensors, tokenizer files   the policy as a Hugging Face model (rank 0)
    train_state/                                       DCP: policy + optimizer (+ critic + its optimizer),
                                                       each rank writes its own shards
    rng/rank_<r>.pt                                    each rank's torch RNG state
    train_state.json                                   core/run_dirs.py TrainState: learner step, LR
                                                       schedule, data cursor, lineage, what each step
                                                       trained on; written LAST, so its presence marks
                                                       a complete checkpoint

What a resumed run needs to be indistinguishable from one that never stopped: the weights and
AdamW moments (DCP), the LR schedule's position, the RNG, the learner step (which is also the
weight version and, through :class:`~horizonrl.core.schedule.TurnBudgetSchedule`, the turn budget)
and the data cursor (the next batch request id).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from horizonrl.core.disk import is_disk_refusal, refusal_text
import msgspec

from horizonrl.core.run_dirs import (STATE_FILE, TrainState, checkpoint_dir, latest_checkpoint, read_state,
                                    resolve_resume, write_state)

__all__ = ["STATE_FILE", "TrainState", "checkpoint_dir", "latest_checkpoint", "load_train_state", "read_state",
           "resolve_resume", "save_train_state"]


def _modules(model, optimizer, critic, critic_optimizer) -> dict[str, tuple[nn.Module, torch.optim.Optimizer]]:
    out = {"policy": (model, optimizer)}
    if critic is not None:
        out["critic"] = (critic, critic_optimizer)
    return out


class CheckpointWriteError(RuntimeError):
    """The disk refused a part of a checkpoint on some rank (full, read-only): raised on every rank alike, so
    they retry together (learner/services.py) or stop together."""


Agree = Callable[[str | None], str | None]  # a rank's refusal (None: it wrote its part) -> the first of any rank


def disk_refusal(write: Callable[[], Any]) -> str | None:
    """Run ``write``; what the disk refused (core/disk.py), or None. Any other error is raised: it is ours."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        write()
    except CheckpointException as exc:  # DCP's own collective gathers every rank's failure into one
        failures = [failure for failure, _ in exc.failures.values()]
        if failures and all(is_disk_refusal(failure) for failure in failures):
            return "; ".join(sorted({refusal_text(failure) for failure in failures}))
        raise
    except OSError as exc:
        if is_disk_refusal(exc):
            return refusal_text(exc)
        raise
    return None


def agree_by_barrier(error: str | None) -> str | None:
    """:data:`Agree` over the default group with no timeout of its own (tests; the learner passes its bounded one)."""
    refused = torch.tensor([0 if error is None else 1], dtype=torch.int64)
    dist.all_reduce(refused, op=dist.ReduceOp.MAX)
    return error or ("another learner rank could not write its part" if refused.item() else None)


def save_train_state(path: Path, *, model: nn.Module, optimizer, scheduler, state: TrainState,
                     critic: nn.Module | None = None, critic_optimizer=None, critic_scheduler=None,
                     agree: Agree = agree_by_barrier) -> None:
    """Collective: every rank calls it after rank 0 wrote the Hugging Face files into ``path``. Each part ends
    with ``agree`` (it is the barrier between them), so a part the disk refused on one rank raises
    :class:`CheckpointWriteError` on every rank at the same point."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    path = Path(path)
    to_save = {}
    for name, (module, optim) in _modules(model, optimizer, critic, critic_optimizer).items():
        model_sd, optim_sd = get_state_dict(module, optim)
        to_save[name] = {"model": model_sd, "optim": optim_sd}
    _agreed(agree, disk_refusal(lambda: dcp.save(to_save, checkpoint_id=str(path / "train_state"))))

    def write_rng() -> None:
        (path / "rng").mkdir(parents=True, exist_ok=True)
        torch.save(_rng_state(), path / "rng" / f"rank_{dist.get_rank()}.pt")

    _agreed(agree, disk_refusal(write_rng))
    error = None
    if dist.get_rank() == 0:
        full = msgspec.structs.replace(
            state, lr_scheduler=scheduler.state_dict(), world_size=dist.get_world_size(),
            critic_lr_scheduler=critic_scheduler.state_dict() if critic_scheduler is not None else None)
        error = disk_refusal(lambda: write_state(path, full))
    _agreed(agree, error)


def _agreed(agree: Agree, error: str | None) -> None:
    error = agree(error)
    if error is not None:
        raise CheckpointWriteError(error)


def load_train_state(path: Path, *, model: nn.Module, optimizer, scheduler,
                     critic: nn.Module | None = None, critic_optimizer=None, critic_scheduler=None) -> TrainState:
    """Collective: restore everything :func:`save_train_state` saved; returns its ``train_state.json``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = Path(path)
    state = read_state(path)
    modules = _modules(model, optimizer, critic, critic_optimizer)
    to_load = {}
    for name, (module, optim) in modules.items():
        model_sd, optim_sd = get_state_dict(module, optim)
        to_load[name] = {"model": model_sd, "optim": optim_sd}
    dcp.load(to_load, checkpoint_id=str(path / "train_state"))
    for name, (module, optim) in modules.items():
        set_state_dict(module, optim, model_state_dict=to_load[name]["model"], optim_state_dict=to_load[name]["optim"])
    if state.lr_scheduler is None:
        raise ValueError(f"{path / STATE_FILE}: no lr_scheduler state, so not a checkpoint the learner wrote")
    scheduler.load_state_dict(state.lr_scheduler)
    if critic_scheduler is not None and state.critic_lr_scheduler is not None:
        critic_scheduler.load_state_dict(state.critic_lr_scheduler)
    rng_file = path / "rng" / f"rank_{dist.get_rank()}.pt"
    if rng_file.is_file() and state.world_size == dist.get_world_size():
        _set_rng_state(torch.load(rng_file, weights_only=True))
    return state


def _rng_state() -> dict[str, torch.Tensor]:
    out = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
