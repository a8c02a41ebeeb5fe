"""Hydra's override values, as its command line reads them: ``1e-6`` is a float, ``[6,13,20]`` a list."""

from __future__ import annotations

import re
from typing import Any

_INT = re.compile(r"[+-]?\d+")
_FLOAT = re.compile(r"[+-]?(\d+\.\d*|\.\d+|\d+)([eE][+-]?\d+)?|[+-]?(inf|nan)", re.I)


def parse_hydra_value(text: str) -> Any:
    """A Hydra override value: ``1e-6`` is a float, ``True`` a bool, ``null`` None, ``[6,13,20]`` a
    list, ``'x'`` a string; anything else a string (as Hydra reads unquoted text)."""
    text = text.strip()
    if not text:
        return ""
    if text[0] == "[" and text[-1] == "]":
        return [parse_hydra_value(item) for item in _split_top_level(text[1:-1])]
    if text[0] == "{" and text[-1] == "}":
        out = {}
        for item in _split_top_level(text[1:-1]):
            key, sep, value = item.partition(":")
            if not sep:
                return text
            out[key.strip()] = parse_hydra_value(value)
        return out
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    lower = text.lower()
    if lower in ("true", "false"):
        return lower == "true"
    if lower in ("null", "~"):
        return None
    if _INT.fullmatch(text):
        return int(text)
    if _FLOAT.fullmatch(text):
        return float(text)
    return text


def _split_top_level(text: str) -> list[str]:
    items, depth, quote, current = [], 0, "", ""
    for c in text:
        if quote:
            quote = "" if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
        elif c == "," and depth == 0:
            items.append(current)
            current = ""
            continue
        current += c
    if current.strip() or items:
        items.append(current)
    return [item for item in items if item.strip()]
