"""Sequences packed into rows instead of padded to the longest: the same tokens, the same loss, less compute.

A micro-batch padded to its longest sequence computes every padding position through every layer; episodes of
82–541 tokens (the SmolLM2 format warm-up's) waste about half of it. Packing puts several sequences end to end in a
row of at most ``max_tokens`` (first-fit decreasing, Johnson 1973: ≤ 11/9 of the optimal row count + 1) and gives
each its own positions 0, 1, 2, ...; transformers (≥ 4.53) reads the restarting ``position_ids`` as packed sequences
and builds a block-diagonal causal mask (``masking_utils.find_packed_sequence_indices``), so no token attends to
another sequence and each sequence's logits equal its unpacked ones (tests/learner/test_packing.py).

The loss reads ``loss_mask[:, 1:]``: the logits at t − 1 predict token t. At a boundary that would be the previous
sequence's last token predicting the next one's first, so every sequence's first token has mask 0 here.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

PAD_TOKEN_ID = 0  # right padding (and a packed row's tail): with causal attention it never influences real tokens


def pack_rows(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into rows of at most ``max_tokens`` tokens (first-fit decreasing); a sequence
    longer than that is a row of its own. Rows come longest first; within a row, indices in placement order."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, not {max_tokens}")
    rows: list[list[int]] = []
    room: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        length = lengths[index]
        for row, left in enumerate(room):
            if length <= left:
                rows[row].append(index)
                room[row] -= length
                break
        else:
            rows.append([index])
            room.append(max_tokens - length)
    return rows


def packed_batch(sequences: Sequence[tuple[np.ndarray, np.ndarray]], rows: list[list[int]],
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, loss_mask, position_ids), each (R, T): ``rows`` of ``sequences`` ((ids, mask) pairs) end to end,
    right-padded to the longest row; positions restart at 0 for each sequence (and for the padding)."""
    width = max(sum(len(sequences[i][0]) for i in row) for row in rows)
    input_ids = torch.full((len(rows), width), PAD_TOKEN_ID, dtype=torch.long)
    loss_mask = torch.zeros(len(rows), width)
    position_ids = torch.zeros(len(rows), width, dtype=torch.long)
    for r, row in enumerate(rows):
        start = 0
        for i in row:
            ids, mask = sequences[i]
            end = start + len(ids)
            input_ids[r, start:end] = torch.from_numpy(np.asarray(ids, dtype=np.int64))
            loss_mask[r, start:end] = torch.from_numpy(np.asarray(mask, dtype=np.float32))
            loss_mask[r, start] = 0  # the first token of a sequence has no prediction (see the module docstring)
            position_ids[r, start:end] = torch.arange(len(ids))
            start = end
        position_ids[r, start:] = torch.arange(width - start)
    return input_ids.to(device), loss_mask.to(device), position_ids.to(device)


def padding_share(lengths: Sequence[int], rows: list[list[int]]) -> float:
    """The share of a batch's (R × T) positions that are padding."""
    width = max(sum(lengths[i] for i in row) for row in rows)
    return 1.0 - sum(lengths) / (len(rows) * width)
