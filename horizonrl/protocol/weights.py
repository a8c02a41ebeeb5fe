"""The weight transfer's wire format: what the learner sends and every engine receives.

Torch-free (bottom layer): the two ends live in their parts — the sender in
``learner/weight_broadcast.py``, the receiver in ``actors/weight_receiver.py`` (it runs inside
the vLLM worker process) — and both follow this definition.

A weight group is a ``torch.distributed`` process group (gloo on CPU, NCCL on GPU) formed on a
``TCPStore`` hosted by the learner, under the store prefix ``STORE_PREFIX`` (both ends must use
the same prefix, or the rendezvous hangs until its timeout). Rank 0 is the learner; the engines'
workers are ranks 1..K. One version is sent as four collectives, in order, all rooted at rank 0:

1. header   int64[1]  = number of bytes of the msgpack-encoded :class:`WeightLayout`
2. layout   uint8[n]  = the layout: version, names, dtypes, shapes, total bytes
3. payload  uint8[total_bytes] = every tensor's bytes in layout order, each tensor starting at an
            offset aligned to ``ALIGN_BYTES`` (:func:`layout_offsets`), so a receiver can view it in place
4. ack      int64[1]  all-reduce (sum): each receiver adds 1, so the sender learns that all K
            receivers got this version — a receiver that died or never joined is an error on the
            sender too, not a silent success.

One flat payload rather than tensor by tensor (~0.3 ms per tensor per collective). Every wait is
bounded by the group's timeout and fails with :class:`WeightSyncError` saying who, which version
and what timed out: an unbounded hang is the classic NCCL weight-sync failure.
"""

from __future__ import annotations

from horizonrl.protocol.messages import WeightLayout

__all__ = ["ALIGN_BYTES", "STORE_PREFIX", "WeightLayout", "WeightSyncError", "layout_offsets"]

STORE_PREFIX = "horizonrl-weights"
ALIGN_BYTES = 64  # each tensor's offset in the flat payload; >= every dtype's element size


class WeightSyncError(RuntimeError):
    """A weight group could not be formed, or a transfer did not complete within the timeout."""


def layout_offsets(sizes: list[int]) -> tuple[list[int], int]:
    """Byte offset of each tensor (sizes in bytes) in the flat payload, and the payload's total size."""
    offsets, cursor = [], 0
    for size in sizes:
        offsets.append(cursor)
        cursor += -(-size // ALIGN_BYTES) * ALIGN_BYTES
    return offsets, cursor
