"""The lowest warm-up loss a TextCraft tiny model can reach: the random policy's own randomness per reply token.

    python scripts/textcraft_loss_floor.py [--config configs/textcraft_renamed.yaml] [--episodes 2000]

The tiny model's warm-up (horizonrl/apps/tiny_model.py) is language modelling on random-policy episodes, the loss on
the reply tokens only. Each reply is a uniform draw from ``TextCraftEnv.random_action_choices()`` — the recipe
lines of the first observation, a ``get`` of each ingredient they name, ``inventory`` — so a model that copied
every line and name exactly, and knew nothing else, would still pay ``-log(share of that choice)`` per reply.
Summed over the episodes and divided by their reply tokens (each reply's end-of-turn token included, as the
warm-up counts them), that is the floor of the warm-up's loss; the distance from it to a model's ``final_loss``
(or ``loss_by_100_steps``, in its ``horizonrl_tiny_model.json``) is what it has not learned to copy.

The episodes are the first ``--episodes`` of those ``horizonrl demo --config CONFIG`` builds its model from
(seed 0, ``model.tiny.max_turns``, the config's TextCraft settings), the tokenizer trained on them as
``make_tiny_model`` trains its own (on all of its episodes: the same tokens for the names, one per word).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout without installing it

from horizonrl.core.chat import ChatTokenizer  # noqa: E402
from horizonrl.core.config import load_config  # noqa: E402
from horizonrl.envs.textcraft import TextCraftEnv  # noqa: E402
from horizonrl.apps.tiny_model import RandomEpisode, episode_ids, episodes_tokenizer, random_episodes  # noqa: E402


async def loss_floor(env: TextCraftEnv, episodes: list[RandomEpisode], chat: ChatTokenizer) -> tuple[float, int]:
    """(nats per reply token, reply tokens) of ``episodes`` under the random policy that played them."""
    nats, tokens = 0.0, 0
    for episode in episodes:
        await env.reset(episode.task_id)  # the choices depend only on the first observation's recipe lines
        choices = env.random_action_choices()
        for message in episode.messages:
            if message["role"] == "assistant":
                if message["content"] not in choices:
                    raise ValueError(f"task {episode.task_id}: {message['content']!r} is not a random-policy choice")
                nats -= math.log(choices.count(message["content"]) / len(choices))
        tokens += sum(episode_ids(chat, episode.messages)[1])  # the warm-up's loss mask: reply tokens
    return nats / max(1, tokens), tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/textcraft_renamed.yaml")
    parser.add_argument("--episodes", type=int, default=2000, help="random-policy episodes to average over")
    args = parser.parse_args(argv)
    config = load_config(args.config)
    env_config = next((e for e in config.envs if e.name == "textcraft"), None)
    if env_config is None:
        parser.error(f"{args.config} has no textcraft environment")
    recipe = config.model.tiny
    episodes = random_episodes("textcraft", dict(env_config.settings), args.episodes, 0, recipe.max_turns)
    chat = ChatTokenizer(episodes_tokenizer(episodes))
    env = TextCraftEnv(**dict(env_config.settings))
    floor, tokens = asyncio.run(loss_floor(env, episodes, chat))
    replies = sum(m["role"] == "assistant" for e in episodes for m in e.messages)
    print(f"{args.config}: loss floor {floor:.4f} nats per reply token ({len(episodes)} random episodes of up to "
          f"{recipe.max_turns} turns, {replies} replies, {tokens} reply tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
