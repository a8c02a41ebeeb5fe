"""WebArena's action grammar: the action is the text between the first pair of triple backticks.

``click [id]``, ``hover [id]``, ``type [id] [text] [1|0]`` (1, the default, presses Enter after),
``press [key_comb]``, ``scroll [up|down]``, ``new_tab``, ``tab_focus [index]``, ``close_tab``,
``goto [url]``, ``go_back``, ``go_forward``, ``stop [answer]``. :func:`parse_action` returns an
:class:`Action` or raises :class:`ActionError` whose message tells the agent what to fix.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

FENCE = re.compile(r"```(.*?)```", re.DOTALL)
NAMES = ("click", "hover", "type", "press", "scroll", "new_tab", "tab_focus", "close_tab", "goto", "go_back",
         "go_forward", "stop")
GRAMMAR = ("click [id], hover [id], type [id] [text] [1|0], press [key_comb], scroll [up|down], new_tab, "
           "tab_focus [index], close_tab, goto [url], go_back, go_forward, stop [answer]")
KEY_NAMES = {"ctrl": "Control", "control": "Control", "cmd": "Meta", "meta": "Meta", "alt": "Alt", "shift": "Shift",
             "enter": "Enter", "return": "Enter", "esc": "Escape", "escape": "Escape", "tab": "Tab",
             "backspace": "Backspace", "delete": "Delete", "space": " ", "up": "ArrowUp", "down": "ArrowDown",
             "left": "ArrowLeft", "right": "ArrowRight", "pageup": "PageUp", "pagedown": "PageDown",
             "home": "Home", "end": "End", "arrowup": "ArrowUp", "arrowdown": "ArrowDown",
             "arrowleft": "ArrowLeft", "arrowright": "ArrowRight"}


class ActionError(ValueError):
    """A malformed action; the message is shown to the agent."""


@dataclass(frozen=True)
class Action:
    name: str
    element: int | None = None
    text: str = ""
    enter: bool = False

    def __str__(self) -> str:
        if self.name == "type":
            return f"type [{self.element}] [{self.text}] [{int(self.enter)}]"
        if self.element is not None:
            return f"{self.name} [{self.element}]"
        if self.name in ("press", "scroll", "goto", "stop", "tab_focus"):
            return f"{self.name} [{self.text}]"
        return self.name


def extract(reply: str) -> str | None:
    """The text inside the first ``` ``` pair (a language tag line is allowed), or None."""
    match = FENCE.search(reply or "")
    if match is None:
        return None
    text = match.group(1).strip()
    first, _, rest = text.partition("\n")
    if rest and first.strip().isidentifier() and first.strip() not in NAMES:
        text = rest.strip()  # ```text\nclick [3]\n```
    return text


def _args(text: str) -> list[str]:
    """``[a] [b c] [d]`` -> ["a", "b c", "d"]; brackets inside an argument are kept (greedy last)."""
    return re.findall(r"\[(.*?)\](?=\s*\[|\s*$)", text, flags=re.DOTALL)


def parse_action(reply: str) -> Action:
    raw = extract(reply)
    if raw is None:
        raise ActionError("Invalid format: put exactly one action between triple backticks, e.g. ```click [12]```. "
                          f"Actions: {GRAMMAR}.")
    name, _, rest = raw.partition(" ")
    name, rest = name.strip().lower(), rest.strip()
    if "[" in name:  # click[12]
        name, rest = name.split("[", 1)[0], raw[len(name.split("[", 1)[0]):].strip()
    if name not in NAMES:
        raise ActionError(f"Unknown action {name!r}. Actions: {GRAMMAR}.")
    args = _args(rest)
    if name in ("new_tab", "close_tab", "go_back", "go_forward"):
        return Action(name)
    if name == "stop":
        return Action("stop", text=args[0].strip() if args else rest.strip())
    if not args:
        raise ActionError(f"{name} needs its argument in brackets, e.g. {_example(name)}.")
    if name in ("click", "hover", "type"):
        element = _element(args[0], name)
        if name != "type":
            return Action(name, element)
        if len(args) < 2:
            raise ActionError("type needs an id and a text: type [id] [text] [1|0], e.g. type [7] [blue shirt] [1].")
        enter = args[2].strip() if len(args) > 2 else "1"
        if enter not in ("0", "1"):
            raise ActionError("the third argument of type is 1 (press Enter after typing) or 0.")
        return Action("type", element, args[1], enter == "1")
    if name == "scroll":
        direction = args[0].strip().lower()
        if direction not in ("up", "down"):
            raise ActionError("scroll takes [up] or [down].")
        return Action("scroll", text=direction)
    if name == "tab_focus":
        try:
            return Action("tab_focus", text=str(int(args[0].strip())))
        except ValueError:
            raise ActionError("tab_focus takes a tab index, e.g. tab_focus [0].") from None
    if name == "press":
        return Action("press", text=key_combination(args[0]))
    return Action("goto", text=args[0].strip())


def key_combination(text: str) -> str:
    """``ctrl+a`` -> ``Control+a`` in Playwright's key names."""
    parts = [p.strip() for p in text.strip().split("+")]
    if not text.strip() or any(not p for p in parts):
        raise ActionError("press takes a key combination, e.g. press [Enter] or press [Control+a].")
    return "+".join(KEY_NAMES.get(p.lower(), p if len(p) == 1 else p[:1].upper() + p[1:]) for p in parts)


def _element(text: str, name: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ActionError(f"{name} takes a numeric element id from the observation, e.g. {_example(name)}.") from None


def _example(name: str) -> str:
    return {"click": "click [12]", "hover": "hover [12]", "type": "type [7] [blue shirt] [1]", "press": "press [Enter]",
            "scroll": "scroll [down]", "tab_focus": "tab_focus [0]", "goto": "goto [http://example.com]"}.get(
                name, name)
