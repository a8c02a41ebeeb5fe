"""``horizonrl import-agentgym-rl SCRIPT.sh > config.yaml``: bring an AgentGym-RL run over.

AgentGym-RL starts a run with a bash script that sets shell variables and then calls
``python3 -m verl.agent_trainer.main_ppo key=value ...`` (Hydra overrides of its
``ppo_trainer.yaml``). This program reads such a script the way bash would for the parts that
matter — variable assignments and ``$VAR`` / ``${VAR}`` / ``${VAR:-default}`` expansion,
quotes, ``\\`` line continuations, comments, ``cd`` — finds the trainer's overrides, lays them
over AgentGym-RL's defaults (a setting the script leaves out is the one its run used) and maps
every setting with a real horizonrl equivalent onto a horizonrl config, validated by
:class:`horizonrl.core.config.TrainConfig` before it is printed. Everything else is listed on
stderr, one line each, with why: ``ignored:`` (no effect on what is learned in horizonrl: GPU
placement, logging, engine internals), ``no equivalent:`` (changes the algorithm in a way
horizonrl cannot), ``unknown:`` (not a setting of AgentGym-RL's trainer), ``unresolved:`` (a
shell expansion this reader cannot do), and ``note:`` for what a user should know. A result
horizonrl's config rejects, or a run it cannot do at all (an environment it lacks), is an
error (``ConfigError``; the command exits with 2). See docs/agentgym-rl.md for the table.

A program module: it imports only the bottom layer.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Callable

import yaml
from pydantic import ValidationError

from horizonrl.core.config import ConfigError, TrainConfig, dump_config

# ============================================================================== the shell
# Only what AgentGym-RL-style launch scripts use. Control flow (if/for/functions) is not
# interpreted: every assignment is taken in the order it is written.

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
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
            name = _NAME.match(text, start + 1).group(0)
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
    if _NAME.fullmatch(expr):
        return variables.get(expr) or _Value("", f"${expr} is not set in the script")
    if expr in _SPECIAL_PARAMETERS:
        return variables.get(expr) or _Value("", f"${expr} is only known when the script runs")
    if expr.startswith("(("):
        return _Value("", f"arithmetic ${expr} is not evaluated")
    if expr.startswith("("):
        return _Value("", f"command substitution ${expr} is not run")
    inner = expr[1:-1]
    if inner.startswith("#") and _NAME.fullmatch(inner[1:]):
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


# ======================================================================= Hydra values

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


# ==================================================================== AgentGym-RL's side

TRAINER_MODULES = ("verl.agent_trainer.main_ppo", "verl.trainer.main_ppo")
EVAL_MODULES = ("verl.agent_trainer.main_generation", "verl.trainer.main_generation")

# What AgentGym-RL's run uses for a setting its script leaves out, for the settings mapped here:
# its verl/agent_trainer/config/ppo_trainer.yaml, plus the actor's AdamW weight decay (read with
# a default of 1e-2) and the learning-rate schedule (constant after the warm-up, whatever
# optim.warmup_style says).
AGENTGYM_RL_DEFAULTS: dict[str, Any] = {
    "data.train_file": "~/data/rlhf/gsm8k/train.parquet",
    "data.max_prompt_length": 2048,
    "data.max_response_length": 2048,
    "data.train_batch_size": 1024,
    "actor_rollout_ref.actor.ppo_mini_batch_size": 256,
    "actor_rollout_ref.actor.ppo_micro_batch_size": None,
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": None,
    "actor_rollout_ref.actor.grad_clip": 1.0,
    "actor_rollout_ref.actor.clip_ratio": 0.2,
    "actor_rollout_ref.actor.entropy_coeff": 0.001,
    "actor_rollout_ref.actor.use_kl_loss": False,
    "actor_rollout_ref.actor.kl_loss_coef": 0.001,
    "actor_rollout_ref.actor.kl_loss_type": "low_var_kl",
    "actor_rollout_ref.actor.ppo_epochs": 1,
    "actor_rollout_ref.actor.optim.lr": 1e-6,
    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": 0.0,
    "actor_rollout_ref.actor.optim.weight_decay": 0.01,
    "actor_rollout_ref.agentgym.task_name": "textcraft",
    "actor_rollout_ref.rollout.temperature": 1.0,
    "actor_rollout_ref.rollout.top_p": 1.0,
    "actor_rollout_ref.rollout.gpu_memory_utilization": 0.5,
    "actor_rollout_ref.rollout.enforce_eager": True,
    "actor_rollout_ref.rollout.max_model_len": 32768,
    "actor_rollout_ref.rollout.max_num_seqs": 1024,
    "actor_rollout_ref.rollout.max_tokens": 1024,
    "actor_rollout_ref.rollout.n": 1,
    "algorithm.gamma": 1.0,
    "algorithm.lam": 1.0,
    "algorithm.adv_estimator": "gae",
    "algorithm.kl_penalty": "kl",
    "algorithm.rounds_ctrl.type": "fixed",
    "algorithm.rounds_ctrl.rounds": 15,
    "algorithm.rounds_ctrl.steps_scaling_inter": 100,
    "algorithm.kl_ctrl.type": "fixed",
    "algorithm.kl_ctrl.kl_coef": 0.001,
    "critic.optim.lr": 1e-5,
    "trainer.total_epochs": 30,
    "trainer.total_training_steps": None,
    "trainer.project_name": "verl_examples",
    "trainer.experiment_name": "gsm8k",
    "trainer.logger": ["console", "wandb"],
    "trainer.save_freq": -1,
}

# The environments horizonrl has, and the max rounds AgentGym-RL evaluates each with
# (examples/eval/<env>_eval.sh: agentgym.max_rounds).
ENVIRONMENTS = ("babyai", "sciworld", "searchqa", "textcraft")
EVAL_MAX_ROUNDS = {"babyai": 20, "sciworld": 30, "searchqa": 30, "textcraft": 30, "webarena": 15}

_PLACEMENT = "GPU placement is set by learner.num_ranks and rollout.num_actors (each with GPUs of its own)"
_ENGINE = "a vLLM setting of AgentGym-RL's hybrid engine (training and generation on the same GPUs)"
_RECOMPUTE = ("AgentGym-RL recomputes the old log-probs with the actor; horizonrl trains against the engine's own "
              "(behaviour) log-probs")


@dataclass(frozen=True)
class _Direct:
    target: str
    convert: Callable[[Any], Any] | None = None


@dataclass(frozen=True)
class _Unmapped:
    kind: str  # "ignored" | "no equivalent"
    reason: str
    neutral: tuple = ()  # values that behave as horizonrl does anyway: reported as ignored


def _kl_loss_type(value: Any) -> str:
    names = {"low_var_kl": "low_var_kl", "kl": "k1", "mse": "k2"}
    if value in names:
        return names[value]
    if value in ("abs", "full"):
        raise ConfigError(f"kl_loss_type={value}: horizonrl has no {value!r} KL estimator (it has low_var_kl, "
                          "kl as k1, mse as k2)")
    raise ConfigError(f"kl_loss_type={value}: not one of AgentGym-RL's KL estimators (low_var_kl, kl, mse, abs)")


def _adv_estimator(value: Any) -> Any:
    if value == "remax":
        raise ConfigError("algorithm.adv_estimator=remax: horizonrl has no ReMax estimator (it has grpo, rloo, "
                          "reinforce_plus_plus, gae)")
    return value


def _engine_dtype(value: Any) -> str:
    names = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16", "half": "float16",
             "float32": "float32", "fp32": "float32", "float": "float32", "auto": "auto"}
    if str(value) not in names:
        raise ConfigError(f"actor_rollout_ref.rollout.dtype={value}: not a dtype horizonrl's engine takes "
                          "(bfloat16, float16, float32)")
    return names[str(value)]


def _rounds(value: Any) -> list:
    return value if isinstance(value, list) else [value]


RULES: dict[str, _Direct | _Unmapped | str] = {
    # --- mapped one to one
    "actor_rollout_ref.model.path": _Direct("model.path"),
    "data.train_batch_size": _Direct("learner.groups_per_step"),
    "actor_rollout_ref.actor.ppo_mini_batch_size": _Direct("learner.ppo_mini_batch_size"),
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": _Direct("learner.micro_batch_size"),
    "actor_rollout_ref.actor.grad_clip": _Direct("learner.grad_clip"),
    "actor_rollout_ref.actor.clip_ratio": _Direct("learner.clip_ratio"),
    "actor_rollout_ref.actor.entropy_coeff": _Direct("learner.entropy_coeff"),
    "actor_rollout_ref.actor.ppo_epochs": _Direct("learner.ppo_epochs"),
    "actor_rollout_ref.actor.optim.lr": _Direct("learner.lr"),
    "actor_rollout_ref.actor.optim.weight_decay": _Direct("learner.weight_decay"),
    "actor_rollout_ref.rollout.n": _Direct("rollout.n"),
    "actor_rollout_ref.rollout.temperature": _Direct("rollout.temperature"),
    "actor_rollout_ref.rollout.top_p": _Direct("rollout.top_p"),
    "actor_rollout_ref.rollout.max_tokens": _Direct("rollout.max_tokens_per_turn"),
    "actor_rollout_ref.rollout.gpu_memory_utilization": _Direct("rollout.engine.gpu_memory_utilization"),
    "actor_rollout_ref.rollout.enforce_eager": _Direct("rollout.engine.enforce_eager"),
    "actor_rollout_ref.rollout.max_num_seqs": _Direct("rollout.engine.max_num_seqs"),
    # AgentGym-RL, too, keeps fp32 weights in training and generates in this dtype
    "actor_rollout_ref.rollout.dtype": _Direct("rollout.engine.dtype", _engine_dtype),
    "actor_rollout_ref.rollout.tensor_model_parallel_size": _Direct("rollout.engine.tensor_parallel_size"),
    "algorithm.adv_estimator": _Direct("algorithm.adv_estimator", _adv_estimator),
    "algorithm.gamma": _Direct("algorithm.gamma"),
    "algorithm.lam": _Direct("algorithm.lam"),
    "algorithm.rounds_ctrl.type": _Direct("algorithm.rounds_ctrl.type"),
    "algorithm.rounds_ctrl.rounds": _Direct("algorithm.rounds_ctrl.rounds", _rounds),
    "algorithm.rounds_ctrl.steps_scaling_inter": _Direct("algorithm.rounds_ctrl.steps_scaling_inter"),
    "trainer.save_freq": _Direct("learner.save_every", lambda v: max(int(v), 0)),
    "trainer.experiment_name": _Direct("run.name"),
    # --- mapped together with others (see convert())
    "data.train_file": "combined", "data.max_prompt_length": "combined", "data.max_response_length": "combined",
    "actor_rollout_ref.rollout.prompt_length": "combined", "actor_rollout_ref.rollout.response_length": "combined",
    "actor_rollout_ref.rollout.max_model_len": "combined", "actor_rollout_ref.agentgym.task_name": "combined",
    "actor_rollout_ref.actor.use_kl_loss": "combined", "actor_rollout_ref.actor.kl_loss_coef": "combined",
    "actor_rollout_ref.actor.kl_loss_type": "combined", "algorithm.kl_penalty": "combined",
    "algorithm.kl_ctrl.type": "combined", "algorithm.kl_ctrl.kl_coef": "combined",
    "algorithm.kl_ctrl.horizon": "combined", "algorithm.kl_ctrl.target_kl": "combined",
    "actor_rollout_ref.actor.ppo_micro_batch_size": "combined",
    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": "combined",
    "trainer.total_epochs": "combined", "trainer.total_training_steps": "combined",
    "trainer.project_name": "combined", "trainer.logger": "combined", "trainer.default_local_dir": "combined",
    "trainer.nnodes": "combined", "trainer.n_gpus_per_node": "combined",
    "critic.optim.lr": "combined",
    # --- not mapped
    "data.tokenizer": _Unmapped("no equivalent", "horizonrl uses model.path's own tokenizer", (None,)),
    "data.val_files": _Unmapped("no equivalent", "held-out evaluation uses the environment's test split, before "
                                "and after training (eval.episodes; `horizonrl eval --ids FILE` takes id files)"),
    "data.prompt_key": _Unmapped("ignored", "horizonrl's tasks are environment ids", ("item_id",)),
    "data.val_batch_size": _Unmapped("ignored", "validation batching"),
    "data.return_raw_input_ids": _Unmapped("ignored", "data loading detail of verl"),
    "data.return_raw_chat": _Unmapped("ignored", "data loading detail of verl"),
    "data.shuffle": _Unmapped("ignored", "horizonrl draws each group's task at random from the train split"),
    "data.seed": _Unmapped("ignored", "seeds verl's data sampler; run.seed seeds horizonrl's task draws"),
    "actor_rollout_ref.hybrid_engine": _Unmapped("ignored", "horizonrl's engines and learner are separate "
                                                 "processes; " + _PLACEMENT),
    "actor_rollout_ref.model.external_lib": _Unmapped("no equivalent", "model.path must load with "
                                                      "transformers' AutoModelForCausalLM", (None,)),
    "actor_rollout_ref.model.override_config": _Unmapped("no equivalent", "edit the model's config.json", ({},)),
    "actor_rollout_ref.model.enable_gradient_checkpointing": _Unmapped("ignored", "memory/speed trade-off of "
                                                                       "verl's actor"),
    "actor_rollout_ref.model.use_remove_padding": _Unmapped("ignored", "speed setting of verl's actor"),
    "actor_rollout_ref.actor.strategy": _Unmapped("ignored", "horizonrl's learner is FSDP2 over learner.num_ranks"),
    "actor_rollout_ref.actor.use_dynamic_bsz": _Unmapped("no equivalent", "micro-batches are learner.micro_batch_size "
                                                         "trajectories", (False,)),
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": _Unmapped("ignored", "used only with use_dynamic_bsz"),
    "actor_rollout_ref.actor.shuffle": _Unmapped("ignored", "order of mini-batches within a step", (False,)),
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": _Unmapped("no equivalent", "horizonrl has no sequence "
                                                                        "parallelism", (1,)),
    "actor_rollout_ref.actor.optim.min_lr_ratio": _Unmapped("ignored", "AgentGym-RL's actor keeps the lr constant "
                                                            "after the warm-up whatever this says"),
    "actor_rollout_ref.actor.optim.warmup_style": _Unmapped("ignored", "AgentGym-RL's actor keeps the lr constant "
                                                            "after the warm-up whatever this says"),
    "actor_rollout_ref.actor.optim.total_training_steps": _Unmapped("ignored", "filled in by AgentGym-RL's trainer; "
                                                                    "trainer.total_training_steps sets the run length"),
    "actor_rollout_ref.actor.optim.betas": _Unmapped("no equivalent", "horizonrl's AdamW uses betas (0.9, 0.999)",
                                                     ([0.9, 0.999],)),
    "actor_rollout_ref.actor.fsdp_config.": _Unmapped("ignored", "sharding and offload of verl's actor; horizonrl "
                                                      "shards with FSDP2 over learner.num_ranks"),
    "actor_rollout_ref.ref.": _Unmapped("ignored", "the reference policy (learner.use_kl_loss) is a frozen copy of "
                                        "model.path on the learner's ranks"),
    "actor_rollout_ref.agentgym.env_addr": _Unmapped("ignored", "horizonrl runs the environment itself (in the actor "
                                                     "processes; `horizonrl env serve` for a server of its own)"),
    "actor_rollout_ref.agentgym.max_retries": _Unmapped("ignored", "retries of AgentGym-RL's environment client"),
    "actor_rollout_ref.agentgym.timeout": _Unmapped("ignored", "HTTP timeout of AgentGym-RL's environment client; "
                                                    "rollout.episode_timeout_s bounds an episode in horizonrl"),
    "actor_rollout_ref.agentgym.max_rounds": _Unmapped("ignored", "AgentGym-RL's trainer takes the turn budget from "
                                                       "algorithm.rounds_ctrl (its evaluation reads this; here that "
                                                       "is eval.max_turns)"),
    "actor_rollout_ref.rollout.name": _Unmapped("ignored", "horizonrl's engine is vLLM", ("vllm",)),
    "actor_rollout_ref.rollout.top_k": _Unmapped("no equivalent", "horizonrl samples without a top-k cut", (-1, 0)),
    "actor_rollout_ref.rollout.ignore_eos": _Unmapped("no equivalent", "horizonrl's engine stops at EOS", (False,)),
    "actor_rollout_ref.rollout.free_cache_engine": _Unmapped("ignored", _ENGINE),
    "actor_rollout_ref.rollout.load_format": _Unmapped("ignored", _ENGINE),
    "actor_rollout_ref.rollout.max_num_batched_tokens": _Unmapped("ignored", "vLLM scheduling setting"),
    "actor_rollout_ref.rollout.log_prob_micro_batch_size": _Unmapped("ignored", _RECOMPUTE),
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": _Unmapped("ignored", _RECOMPUTE),
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz": _Unmapped("ignored", _RECOMPUTE),
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": _Unmapped("ignored", _RECOMPUTE),
    "actor_rollout_ref.rollout.disable_log_stats": _Unmapped("ignored", "vLLM logging"),
    "actor_rollout_ref.rollout.enable_chunked_prefill": _Unmapped("ignored", "vLLM scheduling setting"),
    "actor_rollout_ref.rollout.do_sample": _Unmapped("no equivalent", "horizonrl always samples", (True,)),
    "actor_rollout_ref.rollout.send_interval": _Unmapped("ignored", "request pacing of AgentGym-RL's rollout"),
    "actor_rollout_ref.rollout.rollout_log_dir": _Unmapped("ignored", "horizonrl records episodes under "
                                                           "<output_dir>/episodes (monitor.record_fraction)"),
    "critic.": _Unmapped("ignored", "critic internals (horizonrl's critic: algorithm.critic_lr, algorithm.vf_coef)"),
    "critic.cliprange_value": _Unmapped("no equivalent", "horizonrl's critic loss ½(V − R)² is not clipped"),
    "reward_model.": _Unmapped("no equivalent", "rewards come from the environment", (False, None)),
    "custom_reward_function.": _Unmapped("no equivalent", "rewards come from the environment", (None,)),
    "trainer.val_generations_to_log_to_wandb": _Unmapped("ignored", "horizonrl logs sample episodes every "
                                                         "monitor.episode_sample_every_s"),
    "trainer.resume_mode": _Unmapped("ignored", "resume with `horizonrl train CONFIG resume=auto`"),
    "trainer.resume_from_path": _Unmapped("no equivalent", "verl checkpoints cannot be resumed; start from a "
                                          "Hugging Face export with model.path", (False, None)),
    "trainer.test_freq": _Unmapped("no equivalent", "horizonrl evaluates before and after training "
                                   "(eval.episodes)", (-1,)),
    "trainer.critic_warmup": _Unmapped("no equivalent", "the critic trains from the first step", (0,)),
    "trainer.default_hdfs_dir": _Unmapped("ignored", "checkpoint copies to HDFS", (None,)),
    "trainer.remove_previous_ckpt_in_save": _Unmapped("ignored", "checkpoint housekeeping"),
    "trainer.del_local_ckpt_after_load": _Unmapped("ignored", "checkpoint housekeeping"),
    "trainer.storage_mode": _Unmapped("ignored", "checkpoint storage"),
}


# A default of AgentGym-RL's that the script leaves out is written only where it matters.
_DEFAULT_APPLIES: dict[str, Callable[[dict[str, Any]], bool]] = {
    "trainer.experiment_name": lambda s: False,  # verl's example name, not the run's
    "algorithm.gamma": lambda s: s["algorithm.adv_estimator"] in ("gae", "reinforce_plus_plus"),
    "algorithm.lam": lambda s: s["algorithm.adv_estimator"] == "gae",
    "algorithm.rounds_ctrl.steps_scaling_inter": lambda s: s["algorithm.rounds_ctrl.type"] != "fixed",
}


def _rule(key: str) -> _Direct | _Unmapped | str | None:
    if key in RULES:
        return RULES[key]
    prefixes = [p for p in RULES if p.endswith(".") and key.startswith(p)]
    return RULES[max(prefixes, key=len)] if prefixes else None


# ====================================================================== the conversion


@dataclass
class Override:
    key: str
    text: str  # the value as the shell handed it over
    value: Any
    added: bool = False  # written +key=value (Hydra adds a key its config does not have)


@dataclass
class Conversion:
    config: TrainConfig
    messages: list[str]  # one line each: "ignored: ...", "no equivalent: ...", "unknown: ...", "note: ..."
    mapped: list[str]  # "their.key=value -> our.key: value"

    def yaml(self, full: bool = False) -> str:
        if full:
            return dump_config(self.config)
        return yaml.dump(self.config.model_dump(mode="json", exclude_unset=True), Dumper=_Dumper, sort_keys=False)


class _Dumper(yaml.SafeDumper):
    """Block style, but a list of plain values on one line: ``rounds: [6, 13, 20]``."""


_Dumper.add_representer(list, lambda dumper, data: dumper.represent_sequence(
    "tag:yaml.org,2002:seq", data, flow_style=not any(isinstance(x, (list, dict)) for x in data)))


_CONFIG_FLAGS = {"--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd"}


def _is_module(word: str, modules: tuple[str, ...]) -> bool:
    """``verl.agent_trainer.main_ppo`` (``python -m``) or a path ending in ``verl/agent_trainer/main_ppo.py``."""
    return word in modules or any(word.endswith(m.replace(".", "/") + ".py") for m in modules)


def find_overrides(commands: list[ShellCommand]) -> tuple[ShellCommand, list[Override], list[str]]:
    """The trainer's command, its ``key=value`` overrides, and messages about its other arguments."""
    found = []
    for command in commands:
        for index, word in enumerate(command.words):
            if _is_module(word, EVAL_MODULES):
                raise ConfigError(f"line {command.line} runs AgentGym-RL's evaluation ({word}), not its training; "
                                  "evaluate with `horizonrl eval --model DIR --env NAME --max-turns N`")
            if _is_module(word, TRAINER_MODULES):
                found.append((command, index))
                break
    if not found:
        raise ConfigError("no AgentGym-RL training command found (python3 -m verl.agent_trainer.main_ppo ...)")
    if len(found) > 1:
        lines = ", ".join(str(c.line) for c, _ in found)
        raise ConfigError(f"the script starts AgentGym-RL's trainer more than once (lines {lines}); convert one at "
                          "a time")
    command, start = found[0]
    overrides, messages = [], []
    takes_value = False
    for index in range(start + 1, len(command.words)):
        word = command.words[index]
        if takes_value:
            takes_value = False
            continue
        if word.split("=")[0] in _CONFIG_FLAGS:
            takes_value = "=" not in word
            value = word.partition("=")[2] or (command.words[index + 1] if index + 1 < len(command.words) else "")
            messages.append(f"ignored: {word.split('=')[0]} {value}: the trainer reads another config file; the "
                            "defaults assumed here are those of AgentGym-RL's ppo_trainer.yaml")
            continue
        if index in command.problems:
            key = word.partition("=")[0] if "=" in word else word
            messages.append(f"unresolved: {word}: {command.problems[index]} (give it with --var NAME=VALUE); "
                            f"{key} is left out")
            continue
        if word.startswith("-"):
            messages.append(f"ignored: {word}: a command-line flag of the trainer, not a setting")
            continue
        if word.startswith("~"):
            messages.append(f"ignored: {word}: removes a setting from AgentGym-RL's config; not mapped")
            continue
        key, sep, text = word.partition("=")
        if not sep or not key:
            messages.append(f"ignored: {word}: not a key=value setting")
            continue
        added = key.startswith("+")
        overrides.append(Override(key.lstrip("+"), text, parse_hydra_value(text), added))
    return command, overrides, messages


def convert(text: str, script_path: Path | None = None, variables: dict[str, str] | None = None,
            data_root: Path | None = None, train_items: int | None = None) -> Conversion:
    """Map an AgentGym-RL training script onto a validated horizonrl config."""
    command, overrides, messages = find_overrides(parse_script(text, variables))
    given: dict[str, Override] = {}
    for override in overrides:
        given[override.key] = override  # the last one wins, as in Hydra
    settings = dict(AGENTGYM_RL_DEFAULTS)
    settings.update({key: o.value for key, o in given.items()})
    tree: dict[str, Any] = {}
    sources: dict[str, str] = {}  # our key -> where it came from, for error messages
    mapped: list[str] = []

    def put(target: str, value: Any, source: str) -> None:
        node = tree
        *parents, last = target.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
        sources[target] = source
        mapped.append(f"{source} -> {target}: {json.dumps(value)}")

    def describe(key: str) -> str:
        if key in given:
            return f"{key}={given[key].text}"
        return f"{key}={_show(settings.get(key))} (AgentGym-RL's default)"

    # ---- settings mapped one to one, and the ones that are not mapped
    for key, override in given.items():
        rule = _rule(key)
        shown = f"{key}={override.text}"
        if rule is None:
            how = ("added with '+': AgentGym-RL's trainer does not read it" if override.added
                   else "not a setting of AgentGym-RL's ppo_trainer.yaml (Hydra would refuse it)")
            messages.append(f"unknown: {shown}: {how}; not mapped")
        elif isinstance(rule, _Unmapped):
            if override.value in rule.neutral:
                messages.append(f"ignored: {shown}: as horizonrl does anyway ({rule.reason})")
            else:
                messages.append(f"{rule.kind}: {shown}: {rule.reason}")
    if "actor_rollout_ref.model.path" not in given:
        raise ConfigError("no actor_rollout_ref.model.path in the script, or one that could not be expanded "
                          "(--var NAME=VALUE gives a variable): horizonrl needs model.path, a Hugging Face model "
                          "directory")
    rounds = settings["algorithm.rounds_ctrl.rounds"]
    if settings["algorithm.rounds_ctrl.type"] == "fixed" and isinstance(rounds, list) and len(rounds) > 1:
        raise ConfigError(f"{describe('algorithm.rounds_ctrl.rounds')} with rounds_ctrl.type=fixed: AgentGym-RL's "
                          "fixed schedule takes one number")
    for key, rule in RULES.items():
        if not isinstance(rule, _Direct) or settings.get(key) is None:
            continue
        if key not in given and not _DEFAULT_APPLIES.get(key, lambda s: True)(settings):
            continue
        value = settings[key]
        put(rule.target, rule.convert(value) if rule.convert else value, describe(key))

    _map_environment(settings, given, command, script_path, data_root, put, messages)
    items = _read_train_file(settings, given, command, script_path, data_root, messages, train_items)
    _map_run_length(settings, given, items if train_items is None else train_items, put, describe, messages)
    _map_kl(settings, given, put, describe, messages)
    _map_context(settings, given, put)
    _map_micro_batch(settings, given, put, describe, messages)
    _map_output(settings, given, command, put, messages)
    if settings["algorithm.adv_estimator"] == "gae":
        put("algorithm.critic_lr", settings["critic.optim.lr"], describe("critic.optim.lr"))
    elif "critic.optim.lr" in given:
        messages.append(f"ignored: {describe('critic.optim.lr')}: no critic with adv_estimator="
                        f"{settings['algorithm.adv_estimator']}")

    groups = tree.get("learner", {}).get("groups_per_step")
    if groups and 2 * groups > 16:
        # the buffer stops taking trajectories at capacity_groups ready groups: below one step's worth the learner
        # would wait for ever; two steps' worth keeps staleness low
        tree.setdefault("buffer", {})["capacity_groups"] = 2 * groups
        sources["buffer.capacity_groups"] = "data.train_batch_size"
        mapped.append(f"(two learner steps of groups) -> buffer.capacity_groups: {2 * groups}")
        messages.append(f"note: buffer.capacity_groups={2 * groups}: two learner steps of groups (learner."
                        f"groups_per_step={groups}); horizonrl's default 16 holds less, and with fewer than one "
                        "step's worth the learner would wait for ever")
    messages.append(f"note: GPU placement: AgentGym-RL trains and generates on the same GPUs (trainer.nnodes × "
                    f"trainer.n_gpus_per_node = {_gpus(given)}); horizonrl gives the learner (learner.num_ranks) and "
                    "the actors' engines (rollout.num_actors) GPUs of their own: set both for your machines")
    return Conversion(_validate(tree, sources), messages, mapped)


def _show(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (list, dict)) or value is None else str(value)


def _gpus(given: dict[str, Override]) -> str:
    nodes = given["trainer.nnodes"].value if "trainer.nnodes" in given else 1
    per_node = given["trainer.n_gpus_per_node"].value if "trainer.n_gpus_per_node" in given else 8
    return f"{nodes} × {per_node}" + ("" if {"trainer.nnodes", "trainer.n_gpus_per_node"} & set(given)
                                      else ", AgentGym-RL's default")


def _map_environment(settings, given, command, script_path, data_root, put, messages) -> None:
    task = settings["actor_rollout_ref.agentgym.task_name"]
    source = f"actor_rollout_ref.agentgym.task_name={task}"
    if "actor_rollout_ref.agentgym.task_name" not in given:
        guess = _env_from_train_file(settings, command, script_path, data_root)
        if guess:
            task, source = guess, f"data.train_file={settings['data.train_file']}"
            messages.append(f"note: environment {task!r} taken from data.train_file (the script does not set "
                            "actor_rollout_ref.agentgym.task_name)")
        else:
            source += " (AgentGym-RL's default)"
            messages.append(f"note: the script does not set actor_rollout_ref.agentgym.task_name; AgentGym-RL's "
                            f"default is {task!r}")
    task = str(task).lower()
    if task not in ENVIRONMENTS:
        raise ConfigError(f"{source}: horizonrl has no {task!r} environment (it has {', '.join(ENVIRONMENTS)})")
    put("envs", [{"name": task}], source)
    if task in EVAL_MAX_ROUNDS:
        put("eval.max_turns", EVAL_MAX_ROUNDS[task], f"AgentGym-RL's examples/eval/{task}_eval.sh max_rounds")
    if task == "searchqa":
        messages.append("note: searchqa: set envs[0].settings.data_dir (Search-R1 data) or retriever_url; without "
                        "them horizonrl's SearchQA uses a small synthetic corpus")


def _candidates(path: str, command: ShellCommand, script_path: Path | None, data_root: Path | None) -> list[Path]:
    given = Path(path).expanduser()
    if given.is_absolute():
        return [given]
    bases = ([data_root] if data_root else []) + [Path.cwd()] + ([script_path.parent] if script_path else [])
    out = []
    for base in bases:
        for candidate in (base / command.cwd / given, base / given):
            if candidate not in out:
                out.append(candidate)
    return out


def _item_env(item: Any) -> str | None:
    item_id = item.get("item_id") if isinstance(item, dict) else item
    match = re.fullmatch(r"\s*([A-Za-z][A-Za-z0-9]*)_(\d+)\s*", str(item_id))
    return match.group(1).lower() if match else None


def _load_ids(path: Path) -> list[Any]:
    text = path.read_text(encoding="utf-8").strip()
    if text.startswith("["):
        rows = json.loads(text)
    else:
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    if not isinstance(rows, list):
        raise ValueError("not a JSON list")
    return rows


def _env_from_train_file(settings, command, script_path, data_root) -> str | None:
    path = str(settings["data.train_file"])
    for candidate in _candidates(path, command, script_path, data_root):
        if candidate.is_file():
            try:
                names = {_item_env(row) for row in _load_ids(candidate)} - {None}
            except (OSError, ValueError):
                break
            if len(names) == 1:
                return names.pop()
            break
    match = re.match(r"([A-Za-z]+)", Path(path).name)
    name = match.group(1).lower() if match else ""
    return name if name in ENVIRONMENTS or name in EVAL_MAX_ROUNDS else None


def _read_train_file(settings, given, command, script_path, data_root, messages, train_items=None) -> int | None:
    """The number of rows in data.train_file (what AgentGym-RL's epochs count), or None if unreadable."""
    if "data.train_file" not in given:
        return None  # AgentGym-RL's default is verl's GSM8K example file: nothing to count
    path = str(settings["data.train_file"])
    shown = f"data.train_file={given['data.train_file'].text}"
    why = ("horizonrl trains on the environment's own train split (each group's task drawn from its train ids), "
           "not on a list of ids")
    for candidate in _candidates(path, command, script_path, data_root):
        if not candidate.is_file():
            continue
        try:
            rows = _load_ids(candidate)
        except (OSError, ValueError) as exc:
            messages.append(f"no equivalent: {shown}: {why}; {candidate} could not be read as an id file ({exc})")
            return None
        names = sorted({_item_env(row) for row in rows} - {None})
        messages.append(f"no equivalent: {shown}: {why}; its {len(rows)} ids ({', '.join(names) or 'no env'}) set "
                        f"only the run length here (read from {candidate})")
        return len(rows)
    looked = ", ".join(str(c) for c in _candidates(path, command, script_path, data_root))
    size = (f"--train-items gives its size, {train_items}" if train_items is not None
            else "so its size is unknown (--data-root DIR or --train-items N)")
    messages.append(f"no equivalent: {shown}: {why}; not found (looked in {looked}), {size}")
    return None


def _map_run_length(settings, given, items, put, describe, messages) -> None:
    total = settings["trainer.total_training_steps"]
    if total is not None:
        put("learner.total_steps", int(total), describe("trainer.total_training_steps"))
        if "trainer.total_epochs" in given:
            messages.append(f"ignored: {describe('trainer.total_epochs')}: trainer.total_training_steps sets the "
                            "run length")
    elif items is not None:
        batch = int(settings["data.train_batch_size"])
        per_epoch = items // batch  # verl's dataloader drops the last partial batch
        if per_epoch < 1:
            raise ConfigError(f"data.train_file has {items} ids, fewer than one batch "
                              f"({describe('data.train_batch_size')}): AgentGym-RL would not start")
        total = per_epoch * int(settings["trainer.total_epochs"])
        put("learner.total_steps", total, f"{describe('trainer.total_epochs')} × ({items} ids // "
                                          f"{batch} per step)")
    else:
        messages.append(f"note: learner.total_steps left at horizonrl's default: the run length is "
                        f"{describe('trainer.total_epochs')} × (ids in data.train_file // data.train_batch_size), "
                        "and the id file was not found (--data-root DIR or --train-items N), nor is "
                        "trainer.total_training_steps set")
    ratio = float(settings["actor_rollout_ref.actor.optim.lr_warmup_steps_ratio"] or 0.0)
    if ratio > 0:
        if total is None:
            messages.append(f"note: {describe('actor_rollout_ref.actor.optim.lr_warmup_steps_ratio')} not mapped: "
                            "the run length is unknown")
        else:
            put("learner.lr_warmup_steps", int(ratio * total),
                describe("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio") + f" × {total} steps")


def _map_kl(settings, given, put, describe, messages) -> None:
    use_kl_loss = bool(settings["actor_rollout_ref.actor.use_kl_loss"])
    put("learner.use_kl_loss", use_kl_loss, describe("actor_rollout_ref.actor.use_kl_loss"))
    reward_kl = ("algorithm.kl_ctrl.type", "algorithm.kl_ctrl.kl_coef", "algorithm.kl_ctrl.horizon",
                 "algorithm.kl_ctrl.target_kl", "algorithm.kl_penalty")
    if use_kl_loss:
        put("learner.kl_loss_coef", settings["actor_rollout_ref.actor.kl_loss_coef"],
            describe("actor_rollout_ref.actor.kl_loss_coef"))
        put("learner.kl_loss_type", _kl_loss_type(settings["actor_rollout_ref.actor.kl_loss_type"]),
            describe("actor_rollout_ref.actor.kl_loss_type"))
        for key in reward_kl:
            if key in given:
                messages.append(f"ignored: {describe(key)}: with use_kl_loss=True AgentGym-RL puts the KL in the loss "
                                "(kl_loss_coef) and does not read this")
        return
    for key in ("actor_rollout_ref.actor.kl_loss_coef", "actor_rollout_ref.actor.kl_loss_type"):
        if key in given:
            messages.append(f"ignored: {describe(key)}: use_kl_loss is false")
    coef = settings["algorithm.kl_ctrl.kl_coef"]
    if coef:
        messages.append(f"no equivalent: {describe('algorithm.kl_ctrl.kl_coef')}: with use_kl_loss=false AgentGym-RL "
                        "subtracts kl_coef × KL(policy || reference) from the reward; horizonrl has the KL only as a "
                        f"loss term (learner.use_kl_loss=true learner.kl_loss_coef={coef} is the nearest)")
    for key in reward_kl:
        if key in given and key != "algorithm.kl_ctrl.kl_coef":
            messages.append(f"no equivalent: {describe(key)}: part of the KL penalty in the reward, which horizonrl "
                            "does not have")


def _map_context(settings, given, put) -> None:
    """AgentGym-RL caps a whole episode at min(max_model_len, prompt_length + response_length) tokens."""
    prompt_key = ("actor_rollout_ref.rollout.prompt_length" if "actor_rollout_ref.rollout.prompt_length" in given
                  else "data.max_prompt_length")
    response_key = ("actor_rollout_ref.rollout.response_length" if "actor_rollout_ref.rollout.response_length" in given
                    else "data.max_response_length")
    prompt, response = int(settings[prompt_key]), int(settings[response_key])
    model_len = int(settings["actor_rollout_ref.rollout.max_model_len"])
    put("rollout.max_context_tokens", min(model_len, prompt + response),
        f"min({_short(given, settings, 'actor_rollout_ref.rollout.max_model_len')}, "
        f"{_short(given, settings, prompt_key)} + {_short(given, settings, response_key)})")


def _short(given, settings, key) -> str:
    return f"{key}={given[key].text if key in given else _show(settings[key])}"


def _map_micro_batch(settings, given, put, describe, messages) -> None:
    key = "actor_rollout_ref.actor.ppo_micro_batch_size"
    if settings[key] is None or settings["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"] is not None:
        if key in given and settings[key] is not None:
            messages.append(f"ignored: {describe(key)}: ppo_micro_batch_size_per_gpu is set (verl refuses both)")
        return
    gpus = 1
    for gpu_key, default in (("trainer.nnodes", 1), ("trainer.n_gpus_per_node", 8)):
        gpus *= int(given[gpu_key].value) if gpu_key in given else default
    put("learner.micro_batch_size", max(1, int(settings[key]) // gpus), f"{describe(key)} // {gpus} GPUs")


def _map_output(settings, given, command, put, messages) -> None:
    if "trainer.default_local_dir" in given:
        put("run.output_dir", str(settings["trainer.default_local_dir"]),
            _given_text(given, "trainer.default_local_dir"))
    elif "trainer.project_name" in given or "trainer.experiment_name" in given:
        path = f"checkpoints/{settings['trainer.project_name']}/{settings['trainer.experiment_name']}"
        put("run.output_dir", path, "AgentGym-RL's default checkpoints/<project_name>/<experiment_name>")
    if command.cwd != PurePosixPath(".") and "actor_rollout_ref.model.path" in given:
        model = str(settings["actor_rollout_ref.model.path"])
        if not Path(model).expanduser().is_absolute():
            messages.append(f"note: model.path={model} is relative to {command.cwd}/ in the script (it `cd`s there); "
                            "horizonrl reads it relative to where `horizonrl train` starts")
    logger = settings["trainer.logger"]
    loggers = logger if isinstance(logger, list) else [logger]
    mode = command.env.get("WANDB_MODE", "online").lower()
    if "wandb" in loggers:
        how = f"trainer.logger={given['trainer.logger'].text}" if "trainer.logger" in given else \
            "trainer.logger=[console,wandb] (AgentGym-RL's default)"
        if mode in ("disabled", "dryrun"):
            messages.append(f"ignored: {how}: WANDB_MODE={mode}")
            return
        wandb = {"project": str(settings["trainer.project_name"]), "mode": "offline" if mode == "offline" else "online"}
        put("monitor.wandb", wandb, how + f", trainer.project_name, WANDB_MODE={mode}")
        messages.append(f"note: {how}: logs to Weights & Biases as well (monitor.wandb, project "
                        f"{wandb['project']!r}; needs `pip install wandb`); remove monitor.wandb for TensorBoard only")
    elif "trainer.project_name" in given:
        messages.append(f"ignored: {_given_text(given, 'trainer.project_name')}: no wandb in trainer.logger")


def _given_text(given: dict[str, Override], key: str) -> str:
    return f"{key}={given[key].text}"


def _validate(tree: dict[str, Any], sources: dict[str, str]) -> TrainConfig:
    try:
        return TrainConfig.model_validate(tree)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"] if not isinstance(p, int)) or "(top)"
            source = next((sources[k] for k in sorted(sources, key=len, reverse=True)
                           if loc == k or loc.startswith(k + ".")), None)
            if source is None and loc == "(top)":  # a check across fields names them in its message
                source = next((sources[k] for k in sorted(sources, key=len, reverse=True) if k in err["msg"]), None)
            lines.append(f"  {loc}: {err['msg']}" + (f" (from {source})" if source else ""))
        raise ConfigError("the converted config is not one horizonrl accepts:\n" + "\n".join(lines)) from None


# ========================================================================== the program


def main(script: Path, variables: list[str] | None = None, data_root: Path | None = None,
         train_items: int | None = None, full: bool = False, explain: bool = False) -> int:
    """Print the converted config on stdout and what was not mapped on stderr. Raises ConfigError."""
    known: dict[str, str] = {}
    for item in variables or []:
        name, sep, value = item.partition("=")
        if not sep or not (_NAME.fullmatch(name) or name.isdigit()):
            raise ConfigError(f"--var {item!r} is not of the form NAME=VALUE")
        known[name] = value
    try:
        text = Path(script).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read {script}: {exc.strerror or exc}") from None
    result = convert(text, Path(script), known, data_root, train_items)
    if explain:
        for line in result.mapped:
            print(f"mapped: {line}", file=sys.stderr)
    for line in result.messages:
        print(line, file=sys.stderr)
    print(f"# horizonrl config converted from {Path(script).name} by `horizonrl import-agentgym-rl` "
          "(docs/agentgym-rl.md).\n# Settings not written here take horizonrl's defaults; "
          "`horizonrl train THIS.yaml --dry-run` prints them all.")
    print(result.yaml(full), end="")
    return 0
