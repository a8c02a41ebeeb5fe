"""scripts/play_with_transformers.py, which docs/learning.md quotes for warm-ups built on a GPU: the run's held-out
evaluation with a batched transformers generator in place of vLLM."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import suite_models
from helpers import load_script


CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.fixture(scope="module")
def model_dir():
    return suite_models.signpost_cached_model()


def test_a_batch_generates_what_each_prompt_generates_alone(model_dir):
    """Left padding must not change what a prompt generates: near-greedy sampling (temperature 1e-4) of three
    prompts of different lengths in one batch gives each prompt's own generation, cut after the first stop
    token; and the three concurrent requests were sampled as one batch."""
    from transformers import AutoModelForCausalLM

    from horizonrl.core.chat import load_chat_tokenizer

    script = load_script("play_with_transformers")
    chat = load_chat_tokenizer(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    generator = script.BatchedTransformersGenerator(model, chat.tokenizer.pad_token_id, "cpu", seed=0)
    calls = []
    sample = generator._sample
    generator._sample = lambda prompts, *rest: calls.append(len(prompts)) or sample(prompts, *rest)
    prompts = [chat.prompt_ids(text) for text in ("You stand at a crossroads.", "Go on.",
                                                  "A long road with signposts to the north, south, east and west.")]
    settings = dict(max_tokens=24, temperature=1e-4, top_p=1.0, stop_token_ids=chat.stop_token_ids)

    async def together():
        return await asyncio.gather(*(generator.generate(p, **settings) for p in prompts))

    async def alone(p):
        return await generator.generate(p, **settings)

    batched = asyncio.run(together())
    assert calls == [3]
    for prompt, gen in zip(prompts, batched):
        assert gen.token_ids == asyncio.run(alone(prompt)).token_ids
        stops = [i for i, t in enumerate(gen.token_ids) if t in chat.stop_token_ids]
        assert stops in ([], [len(gen.token_ids) - 1])  # cut right after the first stop token
        assert (gen.finish_reason == "stop") == bool(stops) and len(gen.logprobs) == len(gen.token_ids)
        assert stops or len(gen.token_ids) == 24


def test_the_script_plays_the_configs_held_out_episodes(model_dir, capsys):
    script = load_script("play_with_transformers")
    assert script.main([str(model_dir), "--config", str(CONFIGS / "signpost_test.yaml"), "--episodes", "6"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["signpost"]
    assert (result["split"], result["tasks"], result["episodes"], result["infra_failures"]) == ("test", 6, 6, 0)
    assert 0.0 <= result["success_rate"] <= 1.0 and 1 <= result["mean_turns"] <= 2  # Signpost's two crossroads
