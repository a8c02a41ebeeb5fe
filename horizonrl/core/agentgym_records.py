"""AgentGym's trajectory files: reading (validated) and writing. Bottom layer: no torch.

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
A malformed record raises :class:`OfflineDataError` naming the file, the line and what is wrong.

Written by the environments' expert-data tools, read by the learner's offline paradigms.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

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
