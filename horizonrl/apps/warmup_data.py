"""A format warm-up's data: episodes of a run's environments played by a uniformly random policy, written as
AgentGym SFT records (``conversations``, loss on the gpt turns) for ``horizonrl sft``.

The paper starts RL from an instruct model that already answers in the environments' action format. A small
model may not (SmolLM2-135M-Instruct writes prose to BabyAI's prompt and almost never ``Action: ...``), and RL
cannot start from a policy whose every reply is invalid: every group's rewards are equal and carry no signal.
Fine-tuning briefly on these episodes teaches the format — each reply is a valid action chosen at random, so
the data holds no skill: whatever the policy gains afterwards comes from RL. The tiny model's build uses the
same episodes (``tiny_model.random_episodes``).

CLI: ``horizonrl make-warmup-data CONFIG OUT.jsonl [key=value ...] [--episodes N] [--seed S]``: ``N`` episodes
per environment of the config, on its train task ids, at its final turn budget.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

ROLE = {"user": "human", "assistant": "gpt"}


def warmup_records(config, episodes_per_env: int, seed: int = 0) -> list[dict]:
    """AgentGym records of ``episodes_per_env`` random-policy episodes of each of the config's environments."""
    from horizonrl.core.agentgym_records import conversation_record
    from horizonrl.core.schedule import TurnBudgetSchedule
    from horizonrl.apps.tiny_model import random_episodes

    max_turns = TurnBudgetSchedule.from_config(config.algorithm.rounds_ctrl).final_max_turns
    records = []
    for spec in config.envs:
        for episode in random_episodes(spec.name, dict(spec.settings), episodes_per_env, seed, max_turns):
            messages = [(ROLE[m["role"]], m["content"]) for m in episode.messages]
            records.append(conversation_record(messages, f"{episode.env_name}_{episode.task_id}"))
    return records


WARMUP_SPEC_FILE = "horizonrl_format_warmup.json"


def ensure_pretrained(config) -> Path:
    """``config.model.path`` made from ``config.model.pretrained`` (see core/config.py's PretrainedRecipe) unless it
    already holds that: the packaged model imported, then format-warmed on the run's environments if the recipe
    asks. Returns the path."""
    import json

    from horizonrl.apps.model_import import ensure_imported

    recipe = config.model.pretrained
    out = Path(config.model.path)
    if recipe.format_warmup is None:
        return ensure_imported(out, packaged=recipe.packaged, dtype=recipe.dtype)
    base = ensure_imported(out.with_name(out.name + ".base"), packaged=recipe.packaged, dtype=recipe.dtype)
    # exclude_none: a recipe that does not use a newer setting (lora, pack_tokens) matches the spec of a model built
    # before the setting existed, which is then reused, not built again
    wanted = {"base": str(base), "recipe": recipe.model_dump(exclude_none=True),
              "envs": [{"name": e.name, "settings": dict(e.settings)} for e in config.envs],
              "rounds": list(config.algorithm.rounds_ctrl.rounds), "system_prompt": config.rollout.system_prompt}
    try:
        if json.loads((out / WARMUP_SPEC_FILE).read_text())["spec"] == wanted:
            return out
    except (OSError, ValueError, KeyError):
        pass
    if out.exists() and any(out.iterdir()) and not (out / WARMUP_SPEC_FILE).exists():
        raise FileExistsError(f"{out} exists and is not a format-warmed model; choose another model.path")
    summary = format_warmup(config, base, out)
    (out / WARMUP_SPEC_FILE).write_text(json.dumps({"spec": wanted, "sft": summary}, indent=1) + "\n")
    return out


def format_warmup(config, base: Path, out: Path) -> dict:
    """SFT of ``base`` on random-policy episodes of the config's environments, into ``out``; the SFT's summary."""
    import shutil

    from horizonrl.core.agentgym_records import write_records
    from horizonrl.core.offline_config import OfflineConfig
    from horizonrl.learner.offline import run_offline

    warm = config.model.pretrained.format_warmup
    work = out.with_name(out.name + ".warmup")
    shutil.rmtree(work, ignore_errors=True)
    data = write_records(work / "episodes.jsonl", warmup_records(config, warm.episodes_per_env, config.run.seed))
    sft = OfflineConfig.model_validate({
        "model": {"path": str(base)}, "data": [str(data)], "output_dir": str(work / "sft"),
        "max_length": config.rollout.max_context_tokens, "system_prompt": config.rollout.system_prompt,
        "max_steps": warm.steps, "epochs": 100, "batch_size": warm.batch_size,
        "micro_batch_size": min(warm.batch_size, 8), "lr": warm.lr, "lr_warmup_steps": min(5, warm.steps),
        "compute_dtype": "bfloat16", "seed": config.run.seed, "log_every": 10,
        "lora": warm.lora.model_dump() if warm.lora is not None else None, "pack_tokens": warm.pack_tokens,
        # the first and last steps' losses say enough; a pass over all the data before and after costs as much as
        # the warm-up itself on the CPU
        "measure_before_after": False})
    summary = run_offline(sft, "sft")
    shutil.rmtree(out, ignore_errors=True)
    shutil.move(str(sft.checkpoint_dir), out)
    shutil.rmtree(work, ignore_errors=True)
    return {k: summary.get(k) for k in ("steps", "first_step", "last_step", "times")}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="horizonrl make-warmup-data",
        description="Random-policy episodes of a config's environments as AgentGym SFT records, for a format "
                    "warm-up with `horizonrl sft` (format, not skill: every reply is a random valid action)")
    parser.add_argument("config", type=Path)
    parser.add_argument("out", type=Path, help="a .jsonl file (one record per line) or .json (one list)")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value, as for `horizonrl train`")
    parser.add_argument("--episodes", type=int, default=1000, help="episodes per environment")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from horizonrl.core.agentgym_records import write_records
    from horizonrl.core.config import ConfigError, load_config

    if args.episodes < 1:
        print("error: --episodes must be at least 1", file=sys.stderr)
        return 2
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    records = warmup_records(config, args.episodes, args.seed)
    write_records(args.out, records)
    turns = sum(sum(1 for c in r["conversations"] if c["from"] == "gpt") for r in records)
    print(f"{args.out}: {len(records)} episodes ({', '.join(s.name for s in config.envs)}), {turns} replies")
    return 0
