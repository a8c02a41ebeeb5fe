"""The weight transfer's wire format: what the learner sends and every engine receives.

Torch-free (bottom layer): the two ends live in their parts — the sender in
``learner/weight_broadcast.py``, the receiver in ``actors/weight_receiver.py`` (it runs inside
the vLLM worker process) — and both follow this definition.

Membership is elastic: engines join and leave at any time. The learner (rank 0 of its own
ranks) hosts a ``TCPStore`` at ``network.weight_port``; every key below lives under the store
prefix ``STORE_PREFIX``. An engine's worker joins in four steps:

1. ``n = add(JOIN_COUNTER, 1)`` — its join number, unique for the store's life;
2. ``set(join_key(n), encode(WeightJoin(...)))`` — who it is (run id, actor index, pid) and the run's key
   (the actor process puts it in its environment as ``RUN_KEY_ENV`` for its engine's workers; a learner with a
   key refuses a join without it: only the run's own engines receive its weights or replace its members);
3. a two-rank ``torch.distributed`` group (gloo on CPU, NCCL on GPU) on the store prefix
   ``member_prefix(n)``: the learner is rank 0, the engine rank 1;
4. it receives one version at once: the learner's newest (whatever its number), as below.

From then on the learner sends each new version to every member, once; a member that fails
or does not finish within the timeout is dropped (its group closed), and the engine, whose
receive then fails, joins again with a new number. A join of an actor that is already a member
replaces the older member. A restarted learner is a new store (and a new weight epoch): an
engine that sees the epoch change in ``Control`` joins it.

One version is sent to one member as 3 + B collectives (B buckets), in order, all rooted at rank 0:

1. header   int64[2]  = [number of bytes of the msgpack-encoded :class:`WeightLayout`, bucket_bytes]
2. layout   uint8[n]  = the layout: version, epoch, names, dtypes (as sent: the engine's), shapes,
            total bytes (the sum of the buckets' sizes)
3. bucket i uint8[size_i], for each bucket of ``plan_buckets(names, dtypes, shapes, bucket_bytes)``
            (``protocol/weight_buckets.py``; both ends compute the plan, so it never travels): the
            bytes of its tensors in layout order, each at an offset aligned to ``ALIGN_BYTES``, so a
            receiver can view it in place. A model smaller than one bucket is one payload collective.
4. ack      int64[1]  all-reduce (sum): the engine adds 1 once it has the version (loaded, in the
            engine's case), so the learner knows it got this version.

Buckets rather than tensor by tensor (~0.3 ms per tensor per collective), and rather than one flat
payload (which needs a full-size buffer on both ends: 15 GB for a 7B model in bf16). Every wait is
bounded by the group's timeout and fails with :class:`WeightSyncError` saying who, which version
and what timed out: an unbounded hang is the classic NCCL weight-sync failure (on NCCL the groups
are created with ``TORCH_NCCL_BLOCKING_WAIT=1``, without which ``Work.wait(timeout)`` does not block
the host and the ``.item()`` after it could hang).

A colocated engine (on the learner's GPU, where NCCL cannot form a two-rank group) does step 3
differently: its join names ``ipc_address``, a ZeroMQ PAIR socket it listens on (loopback), and the
learner connects there; a version then goes through a staging buffer on the GPU that both map
(CUDA IPC), bucket by bucket, as ``learner/weight_ipc.py`` describes: the same buckets, each
acknowledged, the last acknowledgement meaning "loaded".

A tensor-parallel engine joins once per worker (``WeightJoin.worker`` = its rank; the member is
(actor, worker)): each worker receives the full tensors and vLLM's loader keeps its own shard.
"""

from __future__ import annotations

from horizonrl.protocol.messages import WeightJoin, WeightLayout

__all__ = ["ALIGN_BYTES", "FROZEN_MEMBER_FLOOR_S", "JOIN_COUNTER", "RUN_KEY_ENV", "SLOWEST_BYTES_PER_S", "STORE_PREFIX",
           "WeightJoin", "WeightLayout", "WeightSyncError", "join_key", "layout_offsets", "member_bound_s",
           "member_prefix"]

RUN_KEY_ENV = "HORIZONRL_RUN_KEY"  # the run's key, for the engine workers' joins (set by their actor process)
STORE_PREFIX = "horizonrl-weights"
JOIN_COUNTER = "joins"
ALIGN_BYTES = 64  # each tensor's offset in the flat payload; >= every dtype's element size


# A member that does not take a version within this bound is dropped (it rejoins by itself), so that a frozen
# engine holds the learner and the other engines for seconds, not the whole weight_sync_timeout_s: a floor for the
# engine to start receiving once the version is announced (a step of its own, an RPC into its worker, loading
# inline), plus the bytes at a rate every link here beats (gloo over loopback on a loaded 2-core host: ~1 GB/s;
# NCCL: tens of GB/s). learner.weight_sync_timeout_s stays the cap.
FROZEN_MEMBER_FLOOR_S = 20.0
SLOWEST_BYTES_PER_S = 100e6


def member_bound_s(nbytes: int, timeout_s: float) -> float:
    """How long one collective of a version of ``nbytes`` may take before its member counts as frozen."""
    return min(timeout_s, FROZEN_MEMBER_FLOOR_S + nbytes / SLOWEST_BYTES_PER_S)


class WeightSyncError(RuntimeError):
    """A weight group could not be formed, or a transfer did not complete within the timeout."""


def join_key(number: int) -> str:
    """The store key holding join ``number``'s :class:`WeightJoin`."""
    return f"join/{number}"


def member_prefix(number: int) -> str:
    """The store prefix of join ``number``'s two-rank group."""
    return f"member/{number}"


def layout_offsets(sizes: list[int]) -> tuple[list[int], int]:
    """Byte offset of each tensor (sizes in bytes) in the flat payload, and the payload's total size."""
    offsets, cursor = [], 0
    for size in sizes:
        offsets.append(cursor)
        cursor += -(-size // ALIGN_BYTES) * ALIGN_BYTES
    return offsets, cursor
