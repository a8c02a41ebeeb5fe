"""What a name on the wire may be (bottom layer): one rule, applied at every door.

A string a sender chooses can travel far from where it came in: an environment name in a trajectory
becomes part of the learner's metric names (``env/<env>/success_mean``), which the coordinator checks
again when the learner reports them. If the first door were looser than a later check, a sender could
choose a name that passes the first and makes the later one refuse the system's *own* message (the
learner's report), so every door checks the same rule, and the rule for a part of a name leaves room for
the longest prefix and suffix the system adds to it.

- a *name* (a metric, a counter, an endpoint): ``NAME_PATTERN``'s characters, 1..``MAX_NAME_CHARS``;
- a *label* (environment, stop reason, a timing's name): a name of at most ``MAX_LABEL_CHARS``, so that
  ``<prefix>/<label>/<suffix>`` is still a name (a trajectory's category, only ever shown, is any printable
  text of that length: ``validation.py``);
- an *id* (trajectory, group): ``ID_PATTERN``'s characters (no ``/``, no space), 1..``MAX_ID_CHARS``.

The characters are those TensorBoard and W&B keep as they are in a tag, so a chart's name is the name.
"""

from __future__ import annotations

import re

MAX_NAME_CHARS = 128
MAX_LABEL_CHARS = 48  # two labels and the system's prefixes still make a name ("eval/<env>/<metric>")
MAX_ID_CHARS = 256

NAME_PATTERN = re.compile(r"[A-Za-z0-9._\-/:+=@]+", re.ASCII)
ID_PATTERN = re.compile(r"[A-Za-z0-9._\-:+=@]+", re.ASCII)
LABEL_PATTERN = rf"^[A-Za-z0-9._\-/:+=@]{{1,{MAX_LABEL_CHARS}}}$"  # is_label, for a config field's pattern


def is_name(text: object, limit: int = MAX_NAME_CHARS) -> bool:
    """A non-empty string of at most ``limit`` characters, each of NAME_PATTERN's."""
    return isinstance(text, str) and 0 < len(text) <= limit and NAME_PATTERN.fullmatch(text) is not None


def is_label(text: object) -> bool:
    return is_name(text, MAX_LABEL_CHARS)


def is_id(text: object) -> bool:
    return isinstance(text, str) and 0 < len(text) <= MAX_ID_CHARS and ID_PATTERN.fullmatch(text) is not None


def shown(text: str, limit: int = 64) -> str:
    """A sender's string as a log line or a reason may quote it: cut, and every odd character escaped."""
    return ascii(text[:limit])
