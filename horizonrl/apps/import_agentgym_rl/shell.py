"""Reading an AgentGym-RL launch script the way bash would, for the parts that matter: variable assignments
and ``$VAR`` / ``${VAR}`` / ``${VAR:-default}`` expansion, quotes, ``\\`` line continuations, comments, ``cd``.
Control flow (if/for/functions) is not interpreted: every assignment is taken in the order it is written.

A lexer of its own, after looking for one to use: Python's ``shlex`` splits words but drops what the rest
needs — which part of a word was quoted (``'$X'`` is literal, an unquoted ``$X`` is split on blanks) and
where an expansion ends (``${A:-a b}`` is one word) — and ``bashlex``, a port of bash's parser, refuses
much of what real scripts hold and is no longer maintained.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import PurePosixPath

from horizonrl.core.config import ConfigError

VARIABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ASSIGNMENT = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=")
_DECLARERS = {"export", "declare", "typeset", "local", "readonly"}
_SPECIAL_PARAMETERS = set("?#@*$!-0123456789")


@dataclass
class _Piece:
    """Part of a word as written: literal text, or an expansion (``text`` is what follows the ``$``)."""

    text: str
    expansion: bool = False
    quoted: bool = False  # inside quotes: no word splitting


@dataclass
class _RawCommand:
    words: list[list[_Piece]]
    line: int


@dataclass
class ShellCommand:
    """One simple command after expansion."""

    words: list[str]
    env: dict[str, str]  # exported variables plus ``NAME=value`` prefixes of this command
    cwd: PurePosixPath  # relative to where the script started, after its ``cd``s
    line: int
    problems: dict[int, str] = field(default_factory=dict)  # word index -> why it could not be expanded


@dataclass
class _Value:
    text: str
    problem: str | None = None


class _Lexer:
    """Splits a script into simple commands of words, keeping quoting and expansions apart."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.i = 0
        self.line = 1
        self.commands: list[_RawCommand] = []
        self.words: list[list[_Piece]] = []
        self.pieces: list[_Piece] = []
        self.in_word = False  # a word has begun (an empty "" is still a word)
        self.redirect = False  # the next word is a redirection target: dropped
        self.command_line = 1

    def run(self) -> list[_RawCommand]:
        text, n = self.text, len(self.text)
        while self.i < n:
            c = text[self.i]
            if c == "\\":
                nxt = text[self.i + 1] if self.i + 1 < n else ""
                if text.startswith("\r\n", self.i + 1):  # a script saved with Windows line ends
                    nxt, self.i = "\n", self.i + 1
                self.i += 2
                if nxt == "\n":  # line continuation
                    self.line += 1
                    continue
                self._literal(nxt)
            elif c in " \t\r":
                self._end_word()
                self.i += 1
            elif c == "\n":
                self._end_command()
                self.line += 1
                self.i += 1
            elif c == "#" and not self.in_word:
                while self.i < n and text[self.i] != "\n":
                    self.i += 1
            elif c == "'":
                end = text.find("'", self.i + 1)
                if end < 0:
                    raise ConfigError(f"line {self.line}: unterminated single quote")
                self._literal(text[self.i + 1:end], quoted=True)
                self.line += text.count("\n", self.i, end)
                self.i = end + 1
            elif c == '"':
                self._double_quoted()
            elif c == "$":
                self._dollar(quoted=False)
            elif c == "`":
                end = text.find("`", self.i + 1)
                if end < 0:
                    raise ConfigError(f"line {self.line}: unterminated backquote")
                self._expansion("(" + text[self.i + 1:end] + ")", quoted=False)
                self.i = end + 1
            elif c in ";|&()":
                if c == "&" and text.startswith("&>", self.i):
                    self._redirection(2)
                    continue
                self._end_command()
                self.i += 2 if text[self.i:self.i + 2] in ("&&", "||", ";;") else 1
            elif c in "<>":
                # "2>&1", "> log", ">> log": not part of the command's arguments
                if self.in_word and all(not p.expansion and p.text.isdigit() for p in self.pieces):
                    self.pieces, self.in_word = [], False
                self._end_word()
                length = 1
                while self.i + length < n and text[self.i + length] in "<>&":
                    length += 1
                self._redirection(length)
            else:
                self._literal(c)
                self.i += 1
        self._end_command()
        return self.commands

    def _redirection(self, length: int) -> None:
        self._end_word()
        self.i += length
        if self.text[self.i - 1] == "&" and self.i < len(self.text) and (self.text[self.i].isdigit()
                                                                          or self.text[self.i] == "-"):
            self.i += 1  # ">&1", ">&-": the target is part of the operator
            return
        self.redirect = True

    def _double_quoted(self) -> None:
        text, n = self.text, len(self.text)
        self.i += 1
        self._literal("", quoted=True)  # "" is still a word
        while True:
            if self.i >= n:
                raise ConfigError(f"line {self.line}: unterminated double quote")
            c = text[self.i]
            if c == '"':
                self.i += 1
                return
            if c == "\\" and self.i + 1 < n and text[self.i + 1] in '$`"\\\n':
                if text[self.i + 1] != "\n":
                    self._literal(text[self.i + 1], quoted=True)
                else:
                    self.line += 1
                self.i += 2
            elif c == "$":
                self._dollar(quoted=True)
            elif c == "`":
                end = text.find("`", self.i + 1)
                if end < 0:
                    raise ConfigError(f"line {self.line}: unterminated backquote")
                self._expansion("(" + text[self.i + 1:end] + ")", quoted=True)
                self.i = end + 1
            else:
                if c == "\n":
                    self.line += 1
                self._literal(c, quoted=True)
                self.i += 1

    def _dollar(self, quoted: bool) -> None:
        text, n, start = self.text, len(self.text), self.i
        nxt = text[start + 1] if start + 1 < n else ""
        if nxt in "{(":
            close = "}" if nxt == "{" else ")"
            depth, j = 0, start + 1
            while j < n:
                if text[j] == nxt:
                    depth += 1
                elif text[j] == close:
                    depth -= 1
                    if depth == 0:
                        break
                j += 1
            if j >= n:
                raise ConfigError(f"line {self.line}: unterminated ${nxt}")
            self._expansion(text[start + 1:j + 1], quoted)
            self.i = j + 1
        elif nxt and (nxt.isalpha() or nxt == "_"):
            name = VARIABLE_NAME.match(text, start + 1).group(0)
            self._expansion(name, quoted)
            self.i = start + 1 + len(name)
        elif nxt and nxt in _SPECIAL_PARAMETERS:
            self._expansion(nxt, quoted)
            self.i = start + 2
        else:
            self._literal("$", quoted)
            self.i = start + 1

    def _literal(self, text: str, quoted: bool = False) -> None:
        last = self.pieces[-1] if self.pieces else None
        if last is not None and not last.expansion and last.quoted == quoted:
            last.text += text
        else:
            self.pieces.append(_Piece(text, quoted=quoted))
        self.in_word = True

    def _expansion(self, text: str, quoted: bool) -> None:
        self.pieces.append(_Piece(text, expansion=True, quoted=quoted))
        self.in_word = True

    def _end_word(self) -> None:
        if self.in_word:
            if self.redirect:
                self.redirect = False
            else:
                if not self.words:
                    self.command_line = self.line
                self.words.append(self.pieces)
        self.pieces, self.in_word = [], False

    def _end_command(self) -> None:
        self._end_word()
        self.redirect = False
        if self.words:
            self.commands.append(_RawCommand(self.words, self.command_line))
        self.words = []


def _expand(expr: str, variables: dict[str, _Value]) -> _Value:
    """The value of one expansion (``NAME``, ``{NAME}``, ``{NAME:-word}``, ``{#NAME}``, ...)."""
    if VARIABLE_NAME.fullmatch(expr):
        return variables.get(expr) or _Value("", f"${expr} is not set in the script")
    if expr in _SPECIAL_PARAMETERS:
        return variables.get(expr) or _Value("", f"${expr} is only known when the script runs")
    if expr.startswith("(("):
        return _Value("", f"arithmetic ${expr} is not evaluated")
    if expr.startswith("("):
        return _Value("", f"command substitution ${expr} is not run")
    inner = expr[1:-1]
    if inner.startswith("#") and VARIABLE_NAME.fullmatch(inner[1:]):
        value = _expand(inner[1:], variables)
        return _Value(str(len(value.text)), value.problem)
    match = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*|[0-9?#@*$!-])(?:(:?[-=+?])(.*))?", inner, re.S)
    if not match:
        return _Value("", f"${{{inner}}} is an expansion this reader does not do")
    name, op, word = match.groups()
    value = variables.get(name)
    if op is None:
        return _expand(name, variables)
    unset = value is None or (op.startswith(":") and value.text == "")
    if op.endswith("+"):
        return _expand_text(word, variables) if not unset else _Value("")
    if not unset:
        return value
    if op.endswith("?"):
        return _Value("", f"${{{inner}}}: {name} is not set in the script")
    default = _expand_text(word, variables)
    if op.endswith("="):
        variables[name] = default
    return default


def _expand_text(text: str, variables: dict[str, _Value]) -> _Value:
    """Expansions inside an operand such as the ``word`` of ``${NAME:-word}`` (no further quoting)."""
    lexer = _Lexer(text)
    lexer.in_word = True
    out, problem = [], None
    i = 0
    while i < len(text):
        if text[i] == "$":
            lexer.i, lexer.pieces = i, []
            lexer._dollar(quoted=True)
            piece = lexer.pieces[0]
            i = lexer.i
            if piece.expansion:
                value = _expand(piece.text, variables)
                out.append(value.text)
                problem = problem or value.problem
            else:
                out.append(piece.text)
        else:
            out.append(text[i])
            i += 1
    return _Value("".join(out), problem)


def _expand_word(pieces: list[_Piece], variables: dict[str, _Value], split: bool) -> tuple[list[str], str | None]:
    """The fields one written word becomes (unquoted expansions are split on blanks, as bash does)."""
    fields: list[str] = []
    current, exists, problem = "", False, None
    for piece in pieces:
        if not piece.expansion:
            current, exists = current + piece.text, True
            continue
        value = _expand(piece.text, variables)
        problem = problem or value.problem
        if piece.quoted or not split:
            current, exists = current + value.text, True
            continue
        parts = re.split(r"[ \t\n]+", value.text)
        current += parts[0]
        exists = exists or bool(parts[0])
        for part in parts[1:]:
            if exists:
                fields.append(current)
            current, exists = part, bool(part)
    if exists:
        fields.append(current)
    return fields, problem


def _assignment(pieces: list[_Piece], variables: dict[str, _Value]) -> tuple[str, _Value] | None:
    """``NAME=value`` (the name unquoted and literal), expanded without word splitting."""
    if not pieces or pieces[0].expansion or pieces[0].quoted:
        return None
    match = _ASSIGNMENT.match(pieces[0].text)
    if not match:
        return None
    rest = [_Piece(pieces[0].text[match.end():])] + pieces[1:]
    fields, problem = _expand_word(rest, variables, split=False)
    return match.group(1), _Value("".join(fields), problem)


def parse_script(text: str, variables: dict[str, str] | None = None) -> list[ShellCommand]:
    """The script's simple commands, in order, with variables expanded as bash would (``variables``:
    values known before it starts, e.g. its positional parameters ``{"1": ...}``)."""
    values = {name: _Value(value) for name, value in (variables or {}).items()}
    exported: set[str] = set()
    cwd = PurePosixPath(".")
    commands = []
    for raw in _Lexer(text).run():
        prefix: dict[str, _Value] = {}
        index = 0
        while index < len(raw.words) and (found := _assignment(raw.words[index], {**values, **prefix})):
            prefix[found[0]] = found[1]
            index += 1
        if index == len(raw.words):  # only assignments: shell variables
            values.update(prefix)
            continue
        words: list[str] = []
        problems: dict[int, str] = {}
        head, _ = _expand_word(raw.words[index], values, split=True)
        if head and head[0] in _DECLARERS:
            for pieces in raw.words[index + 1:]:
                if found := _assignment(pieces, values):
                    values[found[0]] = found[1]
                    names = [found[0]]
                else:
                    names = _expand_word(pieces, values, split=True)[0]
                if head[0] == "export":
                    exported.update(names)
            continue
        for pieces in raw.words[index:]:
            fields, problem = _expand_word(pieces, values, split=True)
            if problem:
                for k in range(len(words), len(words) + max(1, len(fields))):
                    problems[k] = problem
            words += fields or ([""] if problem else [])
        if not words:
            continue
        if words[0] == "unset":
            for name in words[1:]:
                values.pop(name, None)
        elif words[0] == "cd" and len(words) > 1 and words[1] != "-" and 1 not in problems:
            target = PurePosixPath(words[1])
            cwd = target if target.is_absolute() else _normalise(cwd / target)
        env = {name: values[name].text for name in sorted(exported) if name in values}
        env.update({name: value.text for name, value in prefix.items()})
        commands.append(ShellCommand(words, env, cwd, raw.line, problems))
    return commands


def _normalise(path: PurePosixPath) -> PurePosixPath:
    parts: list[str] = []
    for part in path.parts:
        if part == "..":
            if parts and parts[-1] != "..":
                parts.pop()
            else:
                parts.append(part)
        elif part != ".":
            parts.append(part)
    return PurePosixPath(*parts) if parts else PurePosixPath(".")
