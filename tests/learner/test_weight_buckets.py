"""The bucket plan (protocol/weight_buckets.py): greedy, ordered, aligned, oversized tensors alone."""

from __future__ import annotations

import pytest

from horizonrl.protocol.weight_buckets import plan_buckets, tensor_nbytes
from horizonrl.protocol.weights import ALIGN_BYTES


def _plan(sizes_in_floats: list[int], bucket_bytes: int):
    names = [f"t{i}" for i in range(len(sizes_in_floats))]
    return plan_buckets(names, ["float32"] * len(names), [[n] for n in sizes_in_floats], bucket_bytes)


def test_tensors_keep_their_order_and_fill_buckets_greedily():
    # 4-byte floats: 64, 64, 64, 32 bytes... with 128-byte buckets: [t0, t1] [t2, t3] [t4]
    plan = _plan([16, 16, 16, 8, 16], 128)
    assert [[e.name for e in b.entries] for b in plan] == [["t0", "t1"], ["t2", "t3"], ["t4"]]
    assert [b.index for b in plan] == [0, 1, 2]
    assert [b.nbytes for b in plan] == [128, 128, 64]


def test_offsets_are_aligned_and_sizes_exact():
    names = ["a", "b", "c", "d"]
    dtypes = ["bfloat16", "float32", "bool", "int64"]
    shapes = [[3], [5, 2], [7], []]
    (bucket,) = plan_buckets(names, dtypes, shapes, 1 << 20)
    assert [e.nbytes for e in bucket.entries] == [6, 40, 7, 8]
    assert [e.offset for e in bucket.entries] == [0, 64, 128, 192]
    assert all(e.offset % ALIGN_BYTES == 0 for e in bucket.entries)
    assert bucket.nbytes == 256  # aligned end of the last tensor
    assert [e.shape for e in bucket.entries] == [(3,), (5, 2), (7,), ()]


def test_a_tensor_bigger_than_a_bucket_travels_alone():
    plan = _plan([4, 1000, 4, 4], 256)
    assert [[e.name for e in b.entries] for b in plan] == [["t0"], ["t1"], ["t2", "t3"]]
    assert plan[1].nbytes == 4032 and plan[1].entries[0].nbytes == 4000  # its size, aligned up
    assert all(b.nbytes <= 256 for b in plan if len(b.entries) > 1)


def test_a_small_model_is_one_bucket_and_no_bucket_is_empty():
    plan = _plan([10, 20, 0, 30], 1 << 20)
    assert len(plan) == 1 and [e.name for e in plan[0].entries] == ["t0", "t1", "t2", "t3"]
    assert plan[0].entries[2].nbytes == 0
    assert _plan([], 1024) == []


def test_buckets_never_exceed_the_limit_unless_one_tensor_does():
    import random

    rng = random.Random(0)
    sizes = [rng.randint(0, 3000) for _ in range(300)]
    limit = 4096
    plan = _plan(sizes, limit)
    assert [e.name for b in plan for e in b.entries] == [f"t{i}" for i in range(len(sizes))]
    for bucket in plan:
        assert bucket.entries
        assert bucket.nbytes <= limit or len(bucket.entries) == 1
        ends = [e.offset + e.nbytes for e in bucket.entries]
        assert all(e.offset >= prev for e, prev in zip(bucket.entries[1:], ends))  # no overlap
    # greedy: the first tensor of each bucket would not have fitted in the one before
    for before, after in zip(plan, plan[1:]):
        first = after.entries[0].nbytes
        assert before.nbytes + (-(-first // ALIGN_BYTES) * ALIGN_BYTES) > limit


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="no element size"):
        tensor_nbytes("qint8", [2])
    with pytest.raises(ValueError, match="names"):
        plan_buckets(["a"], [], [[1]], 1024)
    with pytest.raises(ValueError, match="at least"):
        plan_buckets(["a"], ["float32"], [[1]], 8)
