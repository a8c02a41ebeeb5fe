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

This module finds the trainer's command and builds the config; ``shell.py`` reads the script,
``hydra_values.py`` the override values, ``mapping.py`` says what each setting becomes. The program
imports only the bottom layer.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from horizonrl.apps.import_agentgym_rl.hydra_values import parse_hydra_value
from horizonrl.apps.import_agentgym_rl.mapping import (AGENTGYM_RL_DEFAULTS, DEFAULT_APPLIES, EVAL_MODULES, RULES,
                                                       TRAINER_MODULES, Direct, Override, Unmapped, gpus_text,
                                                       map_context, map_environment, map_kl, map_micro_batch,
                                                       map_output, map_run_length, read_train_file, rule_for,
                                                       value_text)
from horizonrl.apps.import_agentgym_rl.shell import VARIABLE_NAME, ShellCommand, parse_script
from horizonrl.core.config import ConfigError, TrainConfig, dump_config


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
        return f"{key}={value_text(settings.get(key))} (AgentGym-RL's default)"

    messages += _not_mapped(given)
    if "actor_rollout_ref.model.path" not in given:
        raise ConfigError("no actor_rollout_ref.model.path in the script, or one that could not be expanded "
                          "(--var NAME=VALUE gives a variable): horizonrl needs model.path, a Hugging Face model "
                          "directory")
    rounds = settings["algorithm.rounds_ctrl.rounds"]
    if settings["algorithm.rounds_ctrl.type"] == "fixed" and isinstance(rounds, list) and len(rounds) > 1:
        raise ConfigError(f"{describe('algorithm.rounds_ctrl.rounds')} with rounds_ctrl.type=fixed: AgentGym-RL's "
                          "fixed schedule takes one number")
    for key, rule in RULES.items():
        if not isinstance(rule, Direct) or settings.get(key) is None:
            continue
        if key not in given and not DEFAULT_APPLIES.get(key, lambda s: True)(settings):
            continue
        value = settings[key]
        put(rule.target, rule.convert(value) if rule.convert else value, describe(key))

    map_environment(settings, given, command, script_path, data_root, put, messages)
    items = read_train_file(settings, given, command, script_path, data_root, messages, train_items)
    map_run_length(settings, given, items if train_items is None else train_items, put, describe, messages)
    map_kl(settings, given, put, describe, messages)
    map_context(settings, given, put)
    map_micro_batch(settings, given, put, describe, messages)
    map_output(settings, given, command, put, messages)
    if settings["algorithm.adv_estimator"] == "gae":
        put("algorithm.critic_lr", settings["critic.optim.lr"], describe("critic.optim.lr"))
    elif "critic.optim.lr" in given:
        messages.append(f"ignored: {describe('critic.optim.lr')}: no critic with adv_estimator="
                        f"{settings['algorithm.adv_estimator']}")

    groups = tree.get("learner", {}).get("groups_per_step")
    if groups and 2 * groups > 16:
        # the buffer stops taking trajectories at capacity_groups ready groups: below one step's worth the learner
        # would wait for ever; two steps' worth keeps staleness low
        put("buffer.capacity_groups", 2 * groups, "(two learner steps of groups)")
        sources["buffer.capacity_groups"] = "data.train_batch_size"
        messages.append(f"note: buffer.capacity_groups={2 * groups}: two learner steps of groups (learner."
                        f"groups_per_step={groups}); horizonrl's default 16 holds less, and with fewer than one "
                        "step's worth the learner would wait for ever")
    messages.append(f"note: GPU placement: AgentGym-RL trains and generates on the same GPUs (trainer.nnodes × "
                    f"trainer.n_gpus_per_node = {gpus_text(given)}); horizonrl gives the learner (learner.num_ranks) "
                    "and the actors' engines (rollout.num_actors) GPUs of their own: set both for your machines")
    return Conversion(_validate(tree, sources), messages, mapped)


def _not_mapped(given: dict[str, Override]) -> list[str]:
    """A message for each setting of the script that is not mapped: unknown, ignored, or without equivalent."""
    messages = []
    for key, override in given.items():
        rule = rule_for(key)
        shown = f"{key}={override.text}"
        if rule is None:
            how = ("added with '+': AgentGym-RL's trainer does not read it" if override.added
                   else "not a setting of AgentGym-RL's ppo_trainer.yaml (Hydra would refuse it)")
            messages.append(f"unknown: {shown}: {how}; not mapped")
        elif isinstance(rule, Unmapped):
            if override.value in rule.neutral:
                messages.append(f"ignored: {shown}: as horizonrl does anyway ({rule.reason})")
            else:
                messages.append(f"{rule.kind}: {shown}: {rule.reason}")
    return messages


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
        if not sep or not (VARIABLE_NAME.fullmatch(name) or name.isdigit()):
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
