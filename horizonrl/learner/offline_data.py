"""Offline data in AgentGym's trajectory format, tokenised exactly as the RL actor builds episodes.

SFT files (AgentGym's AgentTraj ``.json`` lists, or ``.jsonl`` with one record per line)::

    {"item_id": "webshop_12",                         # optional
     "conversations": [
        {"from": "human", "loss": null,  "value": "<task: the first observation>"},
        {"from": "gpt",   "loss": true,  "value": "Thought: ...\\nAction: ..."},
        {"from": "human", "loss": null,  "value": "<observation>"},
        {"from": "gpt",   "loss": false, "value": "..."},   # in the sequence, but not trained on
        ...]}

DPO files (``.jsonl`` or a ``.json`` list) hold pairs of trajectories for the same task::

    {"item_id": "signpost_7",                         # optional
     "chosen":   {"conversations": [...]}  or  [...messages...],
     "rejected": {"conversations": [...]}  or  [...messages...]}

Chosen and rejected must share the prompt (the optional system message and the first human
message); they may differ anywhere after it.

A conversation may start with one ``{"from": "system"}`` message; then ``human`` and ``gpt``
messages alternate, starting with ``human``. ``loss`` is optional: a ``gpt`` message is
trained on unless it says ``"loss": false``; a ``human`` message never is (``"loss": true`` on
one is an error). Human messages after the last gpt message are dropped (no loss can follow them).

Token layout (the invariant the tests check against :func:`horizonrl.actors.episode.run_episode`)::

    prompt_ids(first human, system)                  mask 0
    + assistant_ids(gpt value)                       mask 1 (0 if "loss": false), end-of-turn included
    + continuation_ids(human value, previous reply)  mask 0
    + ...

Sequences longer than ``max_length`` are cut to their first ``max_length`` tokens; records that
keep no loss token are dropped. Both are counted and logged — no record disappears silently.
A malformed record raises :class:`OfflineDataError` naming the file, the line and what is wrong.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

log = logging.getLogger("horizonrl.learner.offline_data")

ROLES = ("human", "gpt")


class OfflineDataError(ValueError):
    """A data file that cannot be used; the message names the file, the line and what to fix."""


@dataclass(frozen=True)
class Message:
    role: str  # "human" | "gpt"
    value: str
    trained: bool  # gpt: not "loss": false; human: always False


@dataclass(frozen=True)
class Conversation:
    """A validated conversation: ``messages`` alternate human/gpt, start with human, end with gpt."""

    messages: tuple[Message, ...]
    system: str | None = None
    where: str = ""  # "file:line" of the record, for messages about it

    @property
    def prompt(self) -> tuple[str | None, str]:
        return self.system, self.messages[0].value


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


# ---------------------------------------------------------------------------- reading files


def read_records(path: str | Path) -> Iterator[tuple[int, Any]]:
    """(line number, decoded JSON value) of every record of a JSON list or a JSON Lines file.

    ``.jsonl`` files, and any file whose first character is not ``[``, are read as JSON Lines
    (blank lines skipped); otherwise the file is one JSON list and each element's line is the
    line where it starts.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise OfflineDataError(f"{path}: no such data file") from None
    except UnicodeDecodeError as exc:
        raise OfflineDataError(f"{path}: not UTF-8 text ({exc})") from None
    if path.suffix != ".jsonl" and text.lstrip().startswith("["):
        yield from _json_list(path, text)
        return
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield number, json.loads(line)
        except json.JSONDecodeError as exc:
            raise OfflineDataError(f"{path}:{number}: not valid JSON ({exc.msg} at column {exc.colno})") from None


def _json_list(path: Path, text: str) -> Iterator[tuple[int, Any]]:
    decoder = json.JSONDecoder()
    pos, line, counted_to = text.index("[") + 1, 1, 0

    def skip_space(i: int) -> int:
        while i < len(text) and text[i] in " \t\r\n":
            i += 1
        return i

    def line_of(i: int) -> int:
        nonlocal line, counted_to
        line += text.count("\n", counted_to, i)
        counted_to = i
        return line

    pos = skip_space(pos)
    if pos < len(text) and text[pos] == "]":
        return
    while True:
        start_line = line_of(pos)
        try:
            value, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            raise OfflineDataError(f"{path}:{start_line}: the record starting here is not valid JSON ({exc.msg} at "
                                   f"line {exc.lineno}, column {exc.colno})") from None
        yield start_line, value
        pos = skip_space(pos)
        if pos < len(text) and text[pos] == ",":
            pos = skip_space(pos + 1)
        elif pos < len(text) and text[pos] == "]":
            if text[pos + 1:].strip():
                raise OfflineDataError(f"{path}:{line_of(pos + 1)}: text after the end of the JSON list")
            return
        else:
            raise OfflineDataError(f"{path}:{line_of(min(pos, len(text)))}: expected ',' or ']' in the JSON list")


# ---------------------------------------------------------------------------- validation


def parse_conversation(value: Any, where: str, label: str = "conversations") -> Conversation:
    """A record's ``conversations`` (a dict holding them, or the list itself), validated."""
    if isinstance(value, dict):
        if "conversations" not in value:
            raise OfflineDataError(f"{where}: {label} has no 'conversations' list")
        value = value["conversations"]
    if not isinstance(value, list) or not value:
        raise OfflineDataError(f"{where}: {label} must be a non-empty list of messages")
    system = None
    messages: list[Message] = []
    for i, raw in enumerate(value):
        at = f"{where}: {label}[{i}]"
        if not isinstance(raw, dict):
            raise OfflineDataError(f"{at} is a {type(raw).__name__}, expected an object with 'from' and 'value'")
        role, text, loss = raw.get("from"), raw.get("value"), raw.get("loss")
        if not isinstance(text, str):
            raise OfflineDataError(f"{at}: 'value' must be a string, got {type(text).__name__}")
        if loss is not None and not isinstance(loss, bool):
            raise OfflineDataError(f"{at}: 'loss' must be true, false or null, got {loss!r}")
        if role == "system":
            if i != 0:
                raise OfflineDataError(f"{at}: a system message may only be the first message")
            system = text
            continue
        if role not in ROLES:
            raise OfflineDataError(f"{at}: 'from' is {role!r}; expected 'human' or 'gpt' (or 'system' first)")
        expected = ROLES[len(messages) % 2]
        if role != expected:
            raise OfflineDataError(f"{at}: expected a {expected!r} message here (conversations start with "
                                   f"'human' and alternate human/gpt), got {role!r}")
        if role == "human" and loss is True:
            raise OfflineDataError(f"{at}: 'loss': true on a human message; observations are never trained on")
        messages.append(Message(role, text, role == "gpt" and loss is not False))
    while messages and messages[-1].role == "human":
        messages.pop()  # nothing after it is trained on; the actor never appends a final observation either
    if not messages:
        raise OfflineDataError(f"{where}: {label} has no 'gpt' message")
    return Conversation(tuple(messages), system, where)


def _item_id(record: dict, where: str) -> str | None:
    item_id = record.get("item_id")
    if item_id is not None and not isinstance(item_id, (str, int)):
        raise OfflineDataError(f"{where}: 'item_id' must be a string or an integer")
    return None if item_id is None else str(item_id)


def _record(value: Any, where: str, keys: tuple[str, ...]) -> dict:
    if not isinstance(value, dict):
        raise OfflineDataError(f"{where}: a record must be a JSON object with {' and '.join(map(repr, keys))}, "
                               f"got {type(value).__name__}")
    missing = [k for k in keys if k not in value]
    if missing:
        raise OfflineDataError(f"{where}: record has no {' or '.join(map(repr, missing))} "
                               f"(keys: {', '.join(sorted(map(str, value))) or 'none'})")
    return value


def read_sft_conversations(paths: Sequence[str | Path]) -> Iterator[Conversation]:
    for path in paths:
        for line, value in read_records(path):
            where = f"{path}:{line}"
            record = _record(value, where, ("conversations",))
            _item_id(record, where)
            yield parse_conversation(record["conversations"], where)


def read_dpo_pairs(paths: Sequence[str | Path]) -> Iterator[tuple[Conversation, Conversation]]:
    for path in paths:
        for line, value in read_records(path):
            where = f"{path}:{line}"
            record = _record(value, where, ("chosen", "rejected"))
            _item_id(record, where)
            chosen = parse_conversation(record["chosen"], where, "chosen")
            rejected = parse_conversation(record["rejected"], where, "rejected")
            if chosen.prompt != rejected.prompt:
                raise OfflineDataError(f"{where}: chosen and rejected must share the prompt (system message and "
                                       "first human message); they differ")
            yield chosen, rejected


# ---------------------------------------------------------------------------- tokenisation


def conversation_ids(chat: Any, conversation: Conversation, system_prompt: str | None = None) -> tuple[list[int], list[int]]:
    """Token ids and loss mask of a conversation, built append-only exactly as the actor builds an episode.

    ``chat`` is a :class:`horizonrl.chat.ChatTokenizer`. The conversation's own system message
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


# ---------------------------------------------------------------------------- writing


def conversation_record(messages: Sequence[tuple[str, str]], item_id: str | None = None,
                        untrained: Sequence[int] = ()) -> dict[str, Any]:
    """An AgentGym record from (role, text) pairs, role "human" or "gpt"; gpt messages whose index
    is in ``untrained`` get ``"loss": false``."""
    conversations = [
        {"from": role, "loss": None if role == "human" else i not in untrained, "value": text}
        for i, (role, text) in enumerate(messages)
    ]
    record: dict[str, Any] = {"conversations": conversations}
    if item_id is not None:
        record = {"item_id": item_id, **record}
    return record


def write_records(path: str | Path, records: Sequence[dict[str, Any]]) -> Path:
    """``.jsonl``: one record per line; anything else: one JSON list (AgentGym's AgentTraj files)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    else:
        path.write_text(json.dumps(list(records), indent=1) + "\n")
    return path
