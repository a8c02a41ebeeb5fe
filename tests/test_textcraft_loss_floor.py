"""scripts/textcraft_loss_floor.py, which docs/learning.md quotes: the warm-up loss of a perfect copier that
chooses as the random policy does."""

from __future__ import annotations

import asyncio
import math

import pytest
from helpers import load_script

from horizonrl.core.chat import ChatTokenizer
from horizonrl.envs.textcraft import TextCraftEnv
from horizonrl.apps.tiny_model import RandomEpisode, build_tokenizer, episode_ids

SETTINGS = {"max_depth": 1, "max_distractors": 2, "renamed_variants": 10, "rename": "items"}


@pytest.fixture(scope="module")
def setup():
    env = TextCraftEnv(**SETTINGS)
    first = asyncio.run(env.reset(3))
    choices = env.random_action_choices()
    chat = ChatTokenizer(build_tokenizer([first, *choices] * 5))
    return env, first, choices, chat


def test_a_reply_costs_the_log_of_its_share_of_the_choices(setup):
    env, first, choices, chat = setup
    floor_of = load_script("textcraft_loss_floor").loss_floor
    once = next(c for c in choices if choices.count(c) == 1)
    messages = ({"role": "user", "content": first}, {"role": "assistant", "content": once})
    floor, tokens = asyncio.run(floor_of(env, [RandomEpisode("textcraft", 3, messages, False)], chat))
    assert tokens == sum(episode_ids(chat, messages)[1]) > 2  # the reply's tokens and its end-of-turn token
    assert floor * tokens == pytest.approx(math.log(len(choices)))
    # Two replies: the nats add up, and so do the tokens.
    inventory = {"role": "assistant", "content": "Action: inventory"}
    twice = (*messages, {"role": "user", "content": "Got 1 thing"}, inventory)
    floor2, tokens2 = asyncio.run(floor_of(env, [RandomEpisode("textcraft", 3, twice, False)], chat))
    assert floor2 * tokens2 == pytest.approx(2 * math.log(len(choices)))


def test_a_reply_the_random_policy_cannot_give_is_an_error(setup):
    env, first, _, chat = setup
    messages = ({"role": "user", "content": first}, {"role": "assistant", "content": "Action: craft 1 cake"})
    with pytest.raises(ValueError, match="not a random-policy choice"):
        asyncio.run(load_script("textcraft_loss_floor").loss_floor(
            env, [RandomEpisode("textcraft", 3, messages, False)], chat))


def test_the_random_policy_draws_from_its_choices(setup):
    import random

    env, _, choices, _ = setup
    rng = random.Random(0)
    assert {env.random_action(rng) for _ in range(200)} == set(choices)


def test_the_script_prints_the_floor_of_a_config(capsys):
    assert load_script("textcraft_loss_floor").main(["--config", "configs/textcraft.yaml", "--episodes", "20"]) == 0
    line = capsys.readouterr().out
    floor = float(line.split("loss floor ")[1].split()[0])
    assert 0.05 < floor < 0.5, line
