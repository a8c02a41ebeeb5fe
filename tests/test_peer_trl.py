"""scripts/peer_trl.py, the TRL peer of docs/benchmarks.md, without TRL (its `peer-trl` extra is not installed for
the tests): the episodes it hands TRL are the conversation horizonrl's chat layout renders, the observations are
masked, the reward is the episode's return, turns are generated in lock step, and the settings map as documented."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from helpers import load_script

from horizonrl.apps.tiny_model import build_tokenizer
from horizonrl.core.chat import ChatTokenizer
from horizonrl.core.config import load_config
from horizonrl.envs import make_env

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "smollm2_babyai.yaml"
# SmolLM2-135M-Instruct's chat template (the packaged GGUF file's): a default system message when there is none.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Few seeds keep the train split small (3 levels x 8 train seeds): the same levels and settings otherwise.
FEW_SEEDS = {"num_seeds": 10}


@pytest.fixture(scope="module")
def peer():
    return load_script("peer_trl")


@pytest.fixture(scope="module")
def config():
    return load_config(CONFIG)


@pytest.fixture(scope="module")
def env_settings(config):
    return {**dict(config.envs[0].settings), **FEW_SEEDS}


@pytest.fixture(scope="module")
def chat(env_settings):
    """A ChatML tokenizer with SmolLM2's specials (0, 1, 2 = <|endoftext|>, <|im_start|>, <|im_end|>) and template."""
    env = make_env("babyai", env_settings)
    texts = [asyncio.run(env.reset(i)) for i in env.task_ids("train")] + ["Action: go to red ball 1"]
    tokenizer = build_tokenizer(texts * 3)
    tokenizer.chat_template = SMOLLM2_TEMPLATE
    return ChatTokenizer(tokenizer)


def scripted_sampler(chat, reply_of):
    """The engine's batched sampler: each prompt's reply (``reply_of(prompt text)``) as the model would generate it."""
    calls = []

    def sample(prompts):
        calls.append(len(prompts))
        return [chat.assistant_ids(reply_of(chat.decode(p, skip_special_tokens=False))) for p in prompts]
    return sample, calls


def play(peer, config, chat, env_settings, task_ids, reply_of):
    r = config.rollout
    sample, calls = scripted_sampler(chat, reply_of)
    turns = peer.LockstepTurns(sample, temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_tokens_per_turn,
                               stop_token_ids=chat.stop_token_ids)
    sampling = peer.SamplingSettings(r.temperature, r.top_p, r.max_tokens_per_turn, r.max_context_tokens,
                                     r.system_prompt)
    envs = [make_env("babyai", env_settings) for _ in task_ids]
    episodes = asyncio.run(peer.play_batch(task_ids, turns, chat, envs, max_turns=peer.max_turns_of(config),
                                           sampling=sampling))
    return episodes, turns, calls


def test_each_episode_is_the_conversation_the_chat_template_renders(peer, config, chat, env_settings):
    """prompt_ids + completion_ids of every episode = the template's rendering of [user(o0), assistant(r0),
    user(o1), ...] with the generation prompt after the last observation; env_mask is 1 on the replies' tokens
    (their <|im_end|> included) and 0 on the rest; the prompt is the first observation alone."""
    task_ids = [t for t in make_env("babyai", env_settings).task_ids("train")[:4] for _ in range(2)]
    replies = iter(["Action: turn left", "Action: move forward", "no action here", "Action: turn right"] * 20)
    episodes, _, _ = play(peer, config, chat, env_settings, task_ids, lambda prompt: next(replies))
    out = peer.rollout_output(episodes)
    assert out["logprobs"] is None and len(out["prompt_ids"]) == len(task_ids)
    render = chat.tokenizer.apply_chat_template
    for i, ep in enumerate(episodes):
        assert ep.num_turns == 3 and not ep.failure
        conversation = []
        for turn, observation in enumerate(ep.observations):
            conversation.append({"role": "user", "content": observation})
            if turn < len(ep.replies):
                conversation.append({"role": "assistant", "content": ep.replies[turn]})
        whole = render(conversation, add_generation_prompt=True, tokenize=False)
        assert chat.decode(out["prompt_ids"][i] + out["completion_ids"][i], skip_special_tokens=False) == whole
        assert out["prompt_ids"][i] == chat.encode(render(conversation[:1], add_generation_prompt=True, tokenize=False))
        mask, ids = out["env_mask"][i], out["completion_ids"][i]
        assert len(mask) == len(ids)
        generated = [t for t, m in zip(ids, mask) if m]
        assert generated == [t for reply in ep.replies for t in chat.assistant_ids(reply)]
        assert "no action here" not in chat.decode([t for t, m in zip(ids, mask) if not m])


def test_the_reward_is_the_episode_return_and_lock_step_batches_shrink_as_episodes_end(peer, config, chat,
                                                                                        env_settings):
    """Every reply 'go to red ball 1': episodes where that ball is in view succeed at once with minigrid's reward
    (1 - 0.9 steps / max_steps); the rest play on. Turn k of all episodes still playing is one batch."""
    env = make_env("babyai", env_settings)
    in_view = {t: "go to red ball 1" in asyncio.run(env.reset(t)) for t in env.task_ids("train")}
    tasks = [t for t, seen in in_view.items() if seen][:2] + [t for t, seen in in_view.items() if not seen][:2]
    task_ids = [t for t in tasks for _ in range(2)]
    episodes, turns, calls = play(peer, config, chat, env_settings, task_ids, lambda prompt: "Action: go to red ball 1")
    out = peer.rollout_output(episodes)
    assert out["episode_return"] == [sum(ep.turn_rewards) for ep in episodes]
    assert out["episode_success"] == [float(ep.success) for ep in episodes]
    assert peer.episode_return(episode_return=out["episode_return"], prompts=[], completions=[]) == out["episode_return"]
    won = [ep for ep in episodes if ep.success]
    assert len(won) == 4
    assert all(0 < ep.reward <= 1 and ep.num_turns == 1 for ep in won)
    assert all(ep.reward == 0 and ep.num_turns == 3 for ep in episodes if not ep.success)
    assert calls == turns.batch_sizes == [len(episodes), len(episodes) - len(won), len(episodes) - len(won)]


def test_the_dataset_is_the_train_split_with_each_tasks_first_observation(peer, config, env_settings):
    env = make_env("babyai", env_settings)
    rows = peer.train_rows(env, None)
    assert [row["task_id"] for row in rows] == env.task_ids("train")
    assert not {row["task_id"] for row in rows} & set(env.task_ids("test"))
    assert all(row["prompt"][-1]["content"] == asyncio.run(env.reset(row["task_id"])) for row in rows[:5])
    prompts = [rows[0]["prompt"]] * 8 + [rows[1]["prompt"]] * 8
    assert peer.task_ids_of(prompts, 8) == [rows[0]["task_id"]] * 8 + [rows[1]["task_id"]] * 8
    with pytest.raises(RuntimeError, match="groups of 8"):
        peer.task_ids_of(prompts[4:] + prompts[:4], 8)


def test_an_episode_that_failed_is_never_handed_to_trl(peer, config, chat, env_settings):
    def broken(prompts):
        raise RuntimeError("the generator broke")

    r = config.rollout
    turns = peer.LockstepTurns(broken, temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_tokens_per_turn,
                               stop_token_ids=chat.stop_token_ids)
    sampling = peer.SamplingSettings(r.temperature, r.top_p, r.max_tokens_per_turn, r.max_context_tokens)
    episodes = asyncio.run(peer.play_batch([3, 3], turns, chat, [make_env("babyai", env_settings) for _ in range(2)],
                                           max_turns=3, sampling=sampling))
    assert all(ep.failure == "engine" for ep in episodes)
    with pytest.raises(RuntimeError, match="not the agent's fault"):
        peer.rollout_output(episodes)


def test_the_trl_settings_are_the_configs_where_they_map(peer, config, tmp_path):
    kw = peer.grpo_arguments(config, tmp_path, max_steps=7, gradient_checkpointing=False)
    lc, r = config.learner, config.rollout
    assert kw["num_generations"] == r.n == 8
    assert kw["per_device_train_batch_size"] * kw["gradient_accumulation_steps"] == lc.groups_per_step * r.n == 32
    assert kw["per_device_train_batch_size"] == lc.micro_batch_size
    assert (kw["learning_rate"], kw["lr_scheduler_type"], kw["warmup_steps"]) == (1e-5, "constant", 0)
    assert (kw["temperature"], kw["top_p"], kw["max_completion_length"]) == (1.0, 1.0, 24)
    assert (kw["epsilon"], kw["epsilon_high"], kw["max_grad_norm"], kw["weight_decay"]) == (0.2, 0.2, 1.0, 0.0)
    assert (kw["loss_type"], kw["scale_rewards"], kw["beta"], kw["num_iterations"]) == ("dapo", "group", 0.0, 1)
    assert kw["entropy_coef"] == 0.0
    assert kw["bf16"] and kw["use_cpu"] and not kw["use_vllm"] and not kw["gradient_checkpointing"]
    assert kw["max_steps"] == 7 and kw["seed"] == config.run.seed
    for override, message in (("algorithm.adv_estimator=gigpo", "GRPO only"),
                              ("learner.lr_schedule=cosine", "constant"),
                              ("algorithm.rounds_ctrl.type=scaling_inter_stepwise", "fixed turn budget"),
                              ("learner.loss_agg_mode=seq-mean-token-sum", "no TRL loss_type"),
                              ("learner.decoupled_loss=true", "no TRL counterpart")):
        with pytest.raises(ValueError, match=message):
            peer.grpo_arguments(load_config(CONFIG, [override]), tmp_path, 7, False)


def test_held_out_evaluation_is_horizonrl_eval_with_the_demos_settings(peer, config, tmp_path):
    command = peer.eval_command(config, tmp_path / "step_5", None, tmp_path / "out.json")
    args = dict(zip(command[4::2], command[5::2]))
    assert command[1:4] == ["-m", "horizonrl", "eval"]
    assert json.loads(args["--env-settings"]) == dict(config.envs[0].settings)
    assert (args["--split"], args["--episodes"], args["--max-turns"]) == ("test", "150", "3")
    assert (args["--max-tokens-per-turn"], args["--max-context-tokens"], args["--dtype"]) == ("24", "1024", "bfloat16")
    assert (args["--temperature"], args["--samples"], args["--seed"]) == ("1.0", "1", "0")
