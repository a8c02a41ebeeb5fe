"""Arrays as raw little-endian bytes on the wire (no pickle, no per-element msgpack cost)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

TOKEN_DTYPE = np.dtype("<i4")
MASK_DTYPE = np.dtype("u1")
LOGPROB_DTYPE = np.dtype("<f4")


def pack(values: Sequence[float] | np.ndarray, dtype: np.dtype) -> bytes:
    return np.asarray(values, dtype=dtype).tobytes()


def unpack(data: bytes, dtype: np.dtype) -> np.ndarray:
    """A read-only view of ``data`` as a 1-D array (copy it before writing)."""
    if len(data) % dtype.itemsize:
        raise ValueError(f"{len(data)} bytes is not a whole number of {dtype} items")
    return np.frombuffer(data, dtype=dtype)
