"""scripts/bench_weight_deltas.py's accounting: what a bf16 delta carries, counted by bit pattern.

The GPU figures in docs/benchmarks.md come from this function; here its counts are checked on tensors
whose changes are known.
"""

from __future__ import annotations

import torch
from helpers import load_script


def test_compare_counts_changed_elements_and_bytes():
    compare = load_script("bench_weight_deltas").compare
    old = {"a": torch.zeros(10, dtype=torch.bfloat16), "b": torch.ones(2, 5, dtype=torch.bfloat16)}
    new = {name: tensor.clone() for name, tensor in old.items()}
    new["a"][3] = 1.5
    new["a"][7] = -0.0  # the same value as 0.0, another bit pattern: it travels, so it counts
    figures = compare(old, new)  # also asserts that applying the delta rebuilds ``new`` bit for bit
    assert figures["changed_share"] == 2 / 20
    assert figures["tensors"] == 2 and figures["tensors_unchanged"] == 1
    assert figures["full_bytes"] == 40 and figures["sparse_bytes"] == 12  # 6 bytes per changed element
    assert figures["dense_per_tensor_bytes"] == 20  # tensor "a" whole, "b" not sent


def test_compare_of_a_version_with_itself_is_empty():
    compare = load_script("bench_weight_deltas").compare
    version = {"w": torch.randn(4, 4).to(torch.bfloat16)}
    figures = compare(version, {"w": version["w"].clone()})
    assert figures["changed_share"] == 0 and figures["sparse_bytes"] == 0 and figures["dense_per_tensor_bytes"] == 0
