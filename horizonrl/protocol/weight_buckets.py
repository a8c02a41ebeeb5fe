"""The bucket plan of a weight transfer: which tensors travel together, at which byte offsets.

Torch-free (bottom layer), because both ends compute it: the learner to fill each bucket as it
gathers, the engine's worker to cut each bucket it receives back into named tensors. Both call
:func:`plan_buckets` on the same names, dtypes and shapes (the :class:`WeightLayout`) and the
same ``bucket_bytes`` (sent in the header), so the plan itself never travels.

Rules (the plan is deterministic; tests/learner/test_weight_buckets.py pins them):

- tensors keep the layout's order and are packed greedily: a bucket is closed when the next tensor
  (its size rounded up to ``ALIGN_BYTES``) would take it past ``bucket_bytes``;
- a tensor bigger than ``bucket_bytes`` travels alone in a bucket of its own size (it is never split:
  the receiver hands whole tensors to the engine's loader);
- inside a bucket every tensor starts at a multiple of ``ALIGN_BYTES``, so the receiver can view it
  in place with any dtype; a bucket's size is its aligned end;
- a model smaller than one bucket is one bucket: one payload collective per update.
"""

from __future__ import annotations

from dataclasses import dataclass

from horizonrl.protocol.weights import ALIGN_BYTES

__all__ = ["ELEMENT_BYTES", "Bucket", "BucketEntry", "plan_buckets", "tensor_nbytes"]

# Bytes per element of every dtype a checkpoint holds, by torch's name without "torch.".
ELEMENT_BYTES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
    "complex64": 8, "complex128": 16,
}


@dataclass(frozen=True)
class BucketEntry:
    """One tensor inside a bucket: ``nbytes`` bytes at byte ``offset`` from the bucket's start."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Bucket:
    """Tensors sent together in one collective; ``nbytes`` is the size of that collective's buffer."""

    index: int
    entries: tuple[BucketEntry, ...]
    nbytes: int


def tensor_nbytes(dtype: str, shape) -> int:
    if dtype not in ELEMENT_BYTES:
        raise ValueError(f"weight transfer: no element size known for dtype {dtype!r}")
    count = 1
    for dim in shape:
        count *= int(dim)
    return count * ELEMENT_BYTES[dtype]


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


def plan_buckets(names: list[str], dtypes: list[str], shapes: list, bucket_bytes: int) -> list[Bucket]:
    """Group the tensors into buckets of at most ``bucket_bytes`` (see the module docstring)."""
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"weight transfer: {len(names)} names, {len(dtypes)} dtypes, {len(shapes)} shapes")
    if bucket_bytes < ALIGN_BYTES:
        raise ValueError(f"weight transfer: bucket_bytes must be at least {ALIGN_BYTES}, not {bucket_bytes}")
    buckets: list[Bucket] = []
    entries: list[BucketEntry] = []
    cursor = 0  # aligned end of the open bucket

    def close() -> None:
        nonlocal entries, cursor
        if entries:
            buckets.append(Bucket(len(buckets), tuple(entries), cursor))
        entries, cursor = [], 0

    for name, dtype, shape in zip(names, dtypes, shapes):
        nbytes = tensor_nbytes(dtype, shape)
        if entries and cursor + _aligned(nbytes) > bucket_bytes:
            close()
        entries.append(BucketEntry(name, dtype, tuple(int(d) for d in shape), cursor, nbytes))
        cursor += _aligned(nbytes)
        if cursor >= bucket_bytes:  # full (or one oversized tensor alone): nothing more fits
            close()
    close()
    return buckets
