"""Offline data tokenised exactly as the RL actor builds episodes (the file format: core/agentgym_records.py).

Token layout (the invariant the tests check against :func:`horizonrl.actors.episode.run_episode`)::

    prompt_ids(first human, system)                  mask 0
    + assistant_ids(gpt value)                       mask 1 (0 if "loss": false), end-of-turn included
    + continuation_ids(human value, previous reply)  mask 0
    + ...

Sequences longer than ``max_length`` are cut to their first ``max_length`` tokens; records that
keep no loss token are dropped. Both are counted and logged — no record disappears silently.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from horizonrl.core.agentgym_records import Conversation, OfflineDataError, read_dpo_pairs, read_sft_conversations

log = logging.getLogger("horizonrl.learner.offline_data")

__all__ = ["DPOData", "DataStats", "OfflineDataError", "SFTData", "SequenceSet", "conversation_ids", "load_dpo_data",
           "load_sft_data"]

@dataclass
class SequenceSet:
    """Token sequences stored flat: sequence i is ``tokens[offsets[i]:offsets[i + 1]]``.

    ``mask`` is 1 on tokens that are trained on (gpt turns). Flat numpy arrays keep a large
    data set compact and can be saved without pickle (``np.savez``) for the ranks to load.
    """

    tokens: np.ndarray  # (total,) int64
    mask: np.ndarray  # (total,) uint8
    offsets: np.ndarray  # (n + 1,) int64

    @classmethod
    def from_lists(cls, sequences: Sequence[tuple[Sequence[int], Sequence[int]]]) -> "SequenceSet":
        lengths = np.array([len(ids) for ids, _ in sequences], dtype=np.int64)
        offsets = np.zeros(len(sequences) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        tokens = np.fromiter((t for ids, _ in sequences for t in ids), dtype=np.int64, count=int(offsets[-1]))
        mask = np.fromiter((m for _, mask in sequences for m in mask), dtype=np.uint8, count=int(offsets[-1]))
        return cls(tokens, mask, offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def get(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.tokens[start:end], self.mask[start:end]

    def num_tokens(self, i: int) -> int:
        return int(self.offsets[i + 1] - self.offsets[i])

    def num_loss_tokens(self, i: int) -> int:
        """Trained tokens of sequence i; token 0 is never predicted, so it never counts."""
        _, mask = self.get(i)
        return int(mask[1:].sum())

    def arrays(self, prefix: str) -> dict[str, np.ndarray]:
        return {f"{prefix}tokens": self.tokens, f"{prefix}mask": self.mask, f"{prefix}offsets": self.offsets}

    @classmethod
    def from_arrays(cls, arrays: Any, prefix: str) -> "SequenceSet":
        return cls(arrays[f"{prefix}tokens"], arrays[f"{prefix}mask"], arrays[f"{prefix}offsets"])


@dataclass
class DataStats:
    """What happened to every record read: kept (some cut to max_length) or dropped, by reason."""

    read: int = 0
    kept: int = 0
    truncated: int = 0
    dropped: Counter = field(default_factory=Counter)

    def summary(self, what: str, max_length: int) -> str:
        dropped = ", ".join(f"{n} {reason}" for reason, n in sorted(self.dropped.items())) or "none"
        return (f"{what}: {self.read} records read, {self.kept} kept ({self.truncated} cut to {max_length} tokens); "
                f"dropped: {dropped}")

    def to_dict(self) -> dict[str, Any]:
        return {"read": self.read, "kept": self.kept, "truncated": self.truncated, "dropped": dict(self.dropped)}


@dataclass
class SFTData:
    sequences: SequenceSet
    stats: DataStats

    def __len__(self) -> int:
        return len(self.sequences)

    def save(self, path: Path) -> None:
        np.savez(path, **self.sequences.arrays(""))

    @classmethod
    def load(cls, path: Path) -> "SFTData":
        with np.load(path, allow_pickle=False) as arrays:
            return cls(SequenceSet.from_arrays(arrays, ""), DataStats())


@dataclass
class DPOData:
    chosen: SequenceSet
    rejected: SequenceSet  # pair i is (chosen[i], rejected[i])
    stats: DataStats

    def __len__(self) -> int:
        return len(self.chosen)

    def save(self, path: Path) -> None:
        np.savez(path, **self.chosen.arrays("chosen_"), **self.rejected.arrays("rejected_"))

    @classmethod
    def load(cls, path: Path) -> "DPOData":
        with np.load(path, allow_pickle=False) as arrays:
            return cls(SequenceSet.from_arrays(arrays, "chosen_"), SequenceSet.from_arrays(arrays, "rejected_"),
                       DataStats())


# ---------------------------------------------------------------------------- tokenisation


def conversation_ids(chat: Any, conversation: Conversation,
                     system_prompt: str | None = None) -> tuple[list[int], list[int]]:
    """Token ids and loss mask of a conversation, built append-only exactly as the actor builds an episode.

    ``chat`` is a :class:`horizonrl.core.chat.ChatTokenizer`. The conversation's own system message
    wins over ``system_prompt``.
    """
    first, rest = conversation.messages[0], conversation.messages[1:]
    system = conversation.system if conversation.system is not None else system_prompt
    ids = chat.prompt_ids(first.value, system)
    mask = [0] * len(ids)
    reply: list[int] = []
    for message in rest:
        if message.role == "gpt":
            reply = chat.assistant_ids(message.value)
            ids += reply
            mask += [int(message.trained)] * len(reply)
        else:
            piece = chat.continuation_ids(message.value, reply)
            ids += piece
            mask += [0] * len(piece)
    return ids, mask


def _fit(ids: list[int], mask: list[int], max_length: int) -> tuple[list[int], list[int], bool]:
    if len(ids) <= max_length:
        return ids, mask, False
    return ids[:max_length], mask[:max_length], True


def _has_loss(mask: Sequence[int]) -> bool:
    return any(mask[1:])


def load_sft_data(paths: Sequence[str | Path], chat: Any, max_length: int, system_prompt: str | None = None) -> SFTData:
    """Every record of ``paths`` tokenised; cut to ``max_length``; records without loss tokens dropped (counted)."""
    stats = DataStats()
    sequences = []
    for conversation in read_sft_conversations(paths):
        stats.read += 1
        ids, mask = conversation_ids(chat, conversation, system_prompt)
        if not _has_loss(mask):
            stats.dropped["with no trained gpt message"] += 1
            continue
        ids, mask, cut = _fit(ids, mask, max_length)
        if not _has_loss(mask):
            stats.dropped[f"with no trained token within max_length={max_length}"] += 1
            continue
        stats.truncated += cut
        stats.kept += 1
        sequences.append((ids, mask))
    log.info("%s", stats.summary("sft data", max_length))
    return SFTData(SequenceSet.from_lists(sequences), stats)


def load_dpo_data(paths: Sequence[str | Path], chat: Any, max_length: int, system_prompt: str | None = None) -> DPOData:
    """Every pair of ``paths`` tokenised; a pair is dropped (counted) when either side keeps no loss token."""
    stats = DataStats()
    chosen, rejected = [], []
    for pair in read_dpo_pairs(paths):
        stats.read += 1
        sides = [conversation_ids(chat, side, system_prompt) for side in pair]
        if not all(_has_loss(mask) for _, mask in sides):
            stats.dropped["with a side that has no trained gpt message"] += 1
            continue
        fitted = [_fit(ids, mask, max_length) for ids, mask in sides]
        if not all(_has_loss(mask) for _, mask, _ in fitted):
            stats.dropped[f"with a side that has no trained token within max_length={max_length}"] += 1
            continue
        stats.truncated += any(cut for _, _, cut in fitted)
        stats.kept += 1
        chosen.append(fitted[0][:2])
        rejected.append(fitted[1][:2])
    log.info("%s", stats.summary("dpo pairs", max_length))
    return DPOData(SequenceSet.from_lists(chosen), SequenceSet.from_lists(rejected), stats)
