"""A version's bytes from the learner's (sharded) parameters: :func:`gather_buckets`, the collective every
learner rank iterates in step, filling each bucket of the plan (``protocol/weight_buckets.py``) in the engine's
dtype; :func:`layout_of`, what is sent. Shared by the weight hub (``weight_broadcast.py``) and the CUDA-IPC
sender (``weight_ipc.py``)."""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from horizonrl.protocol.weight_buckets import Bucket, plan_buckets


def layout_of(named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None):
    """Names, dtype names and shapes of ``named`` as sent: floating tensors in ``dtype`` (the engine's),
    others as they are. A sharded ``DTensor`` counts with its full shape (no communication)."""
    names, dtypes, shapes = [], [], []
    for name, tensor in named:
        names.append(name)
        sent = dtype if (dtype is not None and tensor.is_floating_point()) else tensor.dtype
        dtypes.append(str(sent).removeprefix("torch."))
        shapes.append([int(d) for d in tensor.shape])
    return names, dtypes, shapes



def gather_buckets(named: list[tuple[str, torch.Tensor]], plan: list[Bucket], *, device: torch.device,
                   fill: bool, into: list[torch.Tensor] | None = None) -> Iterator[torch.Tensor | None]:
    """Collective (every learner rank iterates it to the end, in step): yields each bucket of ``plan``
    filled with the full tensors of ``named`` (FSDP-sharded ``DTensor``s are gathered one at a time).

    ``fill``: this rank keeps the bytes (rank 0); the others only take part in the gathers and get
    None. The bucket is a reused buffer on ``device`` (valid until the next one is asked for), or
    ``into[i]`` when given (rank 0 on the CPU fills the admission copy directly, saving a copy).
    Floating tensors are cast to the plan's dtype *before* the gather, so a bf16 engine costs half
    the gathered bytes of fp32 master weights.
    """
    tensors = dict(named)
    staging = None
    if fill and into is None and plan:
        staging = torch.empty(max(b.nbytes for b in plan), dtype=torch.uint8, device=device)
    for bucket in plan:
        target = None
        if fill:
            target = into[bucket.index] if into is not None else staging[: bucket.nbytes]
        for entry in bucket.entries:
            tensor = tensors[entry.name].detach()
            dtype = getattr(torch, entry.dtype)
            if tensor.dtype != dtype:
                tensor = tensor.to(dtype)
            full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            if target is not None:
                raw = target[entry.offset: entry.offset + entry.nbytes]
                raw.view(dtype).view(entry.shape).copy_(full, non_blocking=False)
            del full, tensor
        yield target



def gather_without_sending(named: list[tuple[str, torch.Tensor]], *, bucket_bytes: int,
                           dtype: torch.dtype | None = None) -> None:
    """A learner rank's part in :meth:`WeightHub.publish` when it sends nothing: the same gathers, in the same
    order, nothing kept (the plan is computed from the same names, dtypes and shapes as rank 0's). Every rank
    other than 0 calls it, and rank 0 too once a stop has abandoned the sending (the other ranks are still
    in the gathers)."""
    names, dtypes, shapes = layout_of(named, dtype)
    plan = plan_buckets(names, dtypes, shapes, bucket_bytes)
    for _ in gather_buckets(named, plan, device=torch.device("cpu"), fill=False):
        pass
