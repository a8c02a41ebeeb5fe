"""The tiny model: random-policy data, tokenizer, Qwen2 model, format warm-up, HF and vLLM loading."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from horizonrl.core.chat import ChatTokenizer
from horizonrl.envs import extract_react_action
from horizonrl.envs.signpost import ACTIONS
from horizonrl.apps.tiny_model import (
    SIGNPOST_TEST_MODEL,
    SPEC_FILE,
    build_tokenizer,
    cached_tiny_model,
    ensure_tiny_model,
    episode_ids,
    random_episodes,
    read_spec,
    tiny_model_spec,
)


@pytest.fixture(scope="module")
def model_dir():
    # Built once per machine (~40-90 s on 2 cores) and shared with the other suites.
    return cached_tiny_model(**SIGNPOST_TEST_MODEL)


@pytest.fixture(scope="module")
def hf(model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # One thread: on a busy 2-core machine two threads spin-wait on each other (3-4x slower).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    yield tokenizer, model
    torch.set_num_threads(threads)


def test_importing_does_not_import_torch():
    code = "import sys, horizonrl.apps.tiny_model, horizonrl.core.chat; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_cli_help():
    out = subprocess.run(
        [sys.executable, "-m", "horizonrl.apps.tiny_model", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "--envs" in out and "--env-settings" in out and "--steps" in out and "--seed" in out


def test_random_episodes_are_seeded_and_well_formed():
    first = random_episodes("signpost", {}, 20, seed=3, max_turns=6)
    assert first == random_episodes("signpost", {}, 20, seed=3, max_turns=6)
    assert first != random_episodes("signpost", {}, 20, seed=4, max_turns=6)
    for episode in first:
        roles = [m["role"] for m in episode.messages]
        assert roles[0] == "user" and roles[-1] == "assistant"
        assert roles == ["user", "assistant"] * (len(roles) // 2)
        assert len(roles) // 2 <= 6
        for message in episode.messages[1::2]:
            assert extract_react_action(message["content"]) in ACTIONS


def test_loss_mask_covers_exactly_the_assistant_tokens():
    episodes = random_episodes("signpost", {}, 5, seed=0, max_turns=8)
    tokenizer = build_tokenizer([m["content"] for e in episodes for m in e.messages], vocab_size=400)
    chat = ChatTokenizer(tokenizer)
    for episode in episodes:
        ids, mask = episode_ids(chat, episode.messages)
        assert len(ids) == len(mask)
        # Masked runs, decoded, are the replies each closed by the end-of-turn token.
        runs, current = [], []
        for token, m in zip(ids, mask):
            if m:
                current.append(token)
            elif current:
                runs.append(current)
                current = []
        runs += [current] if current else []
        replies = [m["content"] for m in episode.messages if m["role"] == "assistant"]
        assert [chat.decode(r, skip_special_tokens=False) for r in runs] == [r + "<|im_end|>" for r in replies]
        # And the whole sequence is the template's rendering of the conversation (no generation prompt
        # at the end, because the conversation ends with a reply).
        full = tokenizer.apply_chat_template(list(episode.messages), tokenize=True, return_dict=False)
        assert ids == list(full)[: len(ids)] and len(full) - len(ids) == 1  # the template's trailing "\n"


def test_babyai_random_episodes_tokenize_append_only():
    settings = {"levels": ["BabyAI-GoToRedBallNoDists-v0"]}
    episodes = random_episodes("babyai", settings, 6, seed=0, max_turns=5)
    assert episodes == random_episodes("babyai", settings, 6, seed=0, max_turns=5)
    tokenizer = build_tokenizer([m["content"] for e in episodes for m in e.messages], vocab_size=600)
    chat = ChatTokenizer(tokenizer)
    for episode in episodes:
        ids, mask = episode_ids(chat, episode.messages)
        full = tokenizer.apply_chat_template(list(episode.messages), tokenize=True, return_dict=False)
        assert ids == list(full)[: len(ids)] and sum(mask) > 0


def test_tokenizer_round_trip_and_special_tokens(model_dir, hf):
    tokenizer, _ = hf
    assert [tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.bos_token is None
    texts = [
        "Follow the signs to the exit. Actions: go left, go right, go straight.\nA sign points left.",
        "red ball: 3 steps forward, 12 steps left\n\n  x",
        "unicode: où, 東京, 🙂, tab\tend",
    ]
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text
    # Special tokens written in text are single ids; they never appear as pieces.
    assert tokenizer.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)[0] == 1
    assert tokenizer.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)[-1] == 2
    # The saved tokenizer.json and the AutoTokenizer class agree (vLLM loads it the same way).
    from transformers import PreTrainedTokenizerFast

    raw = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    for text in texts:
        assert raw.encode(text, add_special_tokens=False) == tokenizer.encode(text, add_special_tokens=False)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_model_loads_in_transformers(model_dir, hf):
    import torch

    tokenizer, model = hf
    config = model.config
    assert config.model_type == "qwen2" and config.num_hidden_layers == 2 and config.hidden_size == 128
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (2, 1, 64)
    assert config.tie_word_embeddings and config.max_position_embeddings >= 4096
    assert config.vocab_size == len(tokenizer)
    assert model.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    spec = read_spec(model_dir)
    assert spec["spec"]["envs"] == ["signpost"] and spec["built"]["final_loss"] < 0.3


def test_warmed_up_model_replies_in_the_action_format(hf):
    """Format, not skill: ≥ 90% of sampled replies (T=1) and all greedy ones parse as valid actions."""
    import torch

    tokenizer, model = hf
    chat = ChatTokenizer(tokenizer)
    episodes = random_episodes("signpost", {}, 16, seed=12345, max_turns=6)
    # Prompts at every turn of held-out random episodes: the first observation and later ones.
    prompts = []
    for episode in episodes:
        ids, _ = episode_ids(chat, episode.messages[:1])
        prompts.append(ids)
        for k in range(2, len(episode.messages), 2):
            ids, _ = episode_ids(chat, episode.messages[:k])
            prompts.append(ids + chat.continuation_ids(episode.messages[k]["content"], ids[-1:]))
    prompts = prompts[:64]
    torch.manual_seed(0)
    valid = {"sampled": 0, "greedy": 0}
    for prompt in prompts:
        input_ids = torch.tensor([prompt])
        for mode in valid:
            out = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=16,
                do_sample=mode == "sampled",
                temperature=1.0 if mode == "sampled" else None,
                top_k=0 if mode == "sampled" else None,
                top_p=1.0 if mode == "sampled" else None,
                eos_token_id=chat.stop_token_ids,
                pad_token_id=tokenizer.pad_token_id,
            )
            reply = chat.decode(out[0, len(prompt):].tolist())
            valid[mode] += extract_react_action(reply) in ACTIONS
    rates = {mode: n / len(prompts) for mode, n in valid.items()}
    print(f"valid-action rate over {len(prompts)} prompts: {rates}")
    assert rates["sampled"] >= 0.9 and rates["greedy"] == 1.0


def test_ensure_reuses_a_matching_directory(tmp_path):
    args = dict(envs=("signpost",), episodes_per_env=8, warmup_steps=1, batch_size=4, max_turns=3, progress=False)
    out = ensure_tiny_model(tmp_path / "m", **args)
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model(tmp_path / "m", **args) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    # Different arguments rebuild in place; same seed and arguments give the same weights.
    ensure_tiny_model(tmp_path / "m", **{**args, "seed": 1})
    assert read_spec(out)["spec"]["seed"] == 1
    again = ensure_tiny_model(tmp_path / "again", **args)
    ensure_tiny_model(tmp_path / "m", **args)
    assert (again / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    # A directory that is not ours is never overwritten.
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        ensure_tiny_model(tmp_path / "foreign", **args)
    assert not any(".building-" in p.name for p in tmp_path.iterdir())  # no staging left behind
    assert (out / SPEC_FILE).exists()


def test_the_spec_file_keeps_the_warmup_loss_curve(tmp_path):
    out = ensure_tiny_model(tmp_path / "m", envs=("signpost",), episodes_per_env=8, warmup_steps=150, batch_size=4,
                            max_turns=3, progress=False)
    curve = read_spec(out)["built"]["loss_by_100_steps"]
    assert len(curve) == 2  # steps 1-100 and 101-150
    assert 0 < curve[1] < curve[0]


def test_two_builders_of_one_directory_build_it_once(tmp_path):
    """Parallel test workers (and two demos) ask for the same model at once: one builds, the other waits on the
    lock and reuses the build."""
    code = ("import sys; from horizonrl.apps.tiny_model import ensure_tiny_model; ensure_tiny_model(sys.argv[1], "
            "envs=('signpost',), episodes_per_env=8, warmup_steps=20, batch_size=4, max_turns=3, progress=False)")
    builders = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "m")], stderr=subprocess.PIPE, text=True)
                for _ in range(2)]
    try:
        logs = [b.communicate(timeout=300)[1] for b in builders]
    finally:
        for b in builders:
            b.kill()
    assert [b.returncode for b in builders] == [0, 0], logs
    assert sum("tiny model ->" in log for log in logs) == 1, logs  # the build's own report, printed once
    assert read_spec(tmp_path / "m")["spec"]["episodes_per_env"] == 8


def test_a_builder_waiting_on_a_hung_one_gives_up_with_a_clear_error(tmp_path):
    import fcntl

    from horizonrl.apps.tiny_model import build_lock

    with open(tmp_path / ".m.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another open file: it blocks this process's build_lock as another's would
        with pytest.raises(TimeoutError, match="another process has been building the model"):
            with build_lock(tmp_path / ".m.lock", "the model", timeout_s=1.5):
                pass
    with build_lock(tmp_path / ".m.lock", "the model", timeout_s=1.5):  # released with its holder
        pass


def test_the_shape_is_a_setting_and_the_default_keeps_earlier_directories_valid(tmp_path):
    args = dict(envs=("signpost",), episodes_per_env=8, warmup_steps=1, batch_size=4, max_turns=3, progress=False)
    assert "shape" not in tiny_model_spec(**{k: v for k, v in args.items() if k != "progress"})  # as before
    out = ensure_tiny_model(tmp_path / "wide", **args, layers=3, hidden=192)
    config = json.loads((out / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["intermediate_size"]) == (3, 192, 3, 384)
    assert read_spec(out)["spec"]["shape"] == {"layers": 3, "hidden": 192}
    # The demo's recipe (model.tiny) carries the shape through to the builder.
    from horizonrl.core.config import TinyModelRecipe

    assert TinyModelRecipe(layers=3, hidden=192).model_dump()["hidden"] == 192
    with pytest.raises(ValueError):
        TinyModelRecipe(hidden=100)


VLLM_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time

    def main():
        model_dir, prompts_file, out_file = sys.argv[1:4]
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        started = time.perf_counter()
        llm = LLM(model=model_dir, enforce_eager=True, dtype="float32", max_model_len=2048,
                  logprobs_mode="processed_logprobs", seed=0)
        load_s = time.perf_counter() - started
        prompts = json.load(open(prompts_file))
        params = SamplingParams(temperature=0.7, max_tokens=24, logprobs=0, seed=0)
        started = time.perf_counter()
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
        generate_s = time.perf_counter() - started
        results = []
        for out in outputs:
            completion = out.outputs[0]
            ids = list(completion.token_ids)
            results.append({
                "token_ids": ids,
                "logprobs": [lp[t].logprob for lp, t in zip(completion.logprobs, ids)],
                "finish_reason": completion.finish_reason,
            })
        json.dump({"load_s": load_s, "generate_s": generate_s, "results": results}, open(out_file, "w"))

    if __name__ == "__main__":
        main()
    """
)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_vllm_loads_the_model_and_its_logprobs_match_transformers(model_dir, hf, tmp_path):
    import torch

    tokenizer, model = hf
    chat = ChatTokenizer(tokenizer)
    episodes = random_episodes("signpost", {}, 8, seed=777, max_turns=4)
    prompts = [episode_ids(chat, e.messages[:1])[0] for e in episodes]
    ids, _ = episode_ids(chat, episodes[0].messages[:2])  # a second-turn prompt too
    prompts.append(ids + chat.continuation_ids(episodes[0].messages[2]["content"], ids[-1:]))
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    (tmp_path / "engine.py").write_text(VLLM_SCRIPT)
    # The engine core runs inside the script's process: on a busy 2-core machine spawning the
    # EngineCore and Worker processes takes 20 s to 4 min; in-process it loads in ~3 s. The
    # weights, kernels and sampler are the same either way.
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "engine.py"), str(model_dir), str(tmp_path / "prompts.json"), str(tmp_path / "out.json")],
        capture_output=True, text=True, env=env, timeout=540,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((tmp_path / "out.json").read_text())
    print(f"vLLM load {report['load_s']:.1f} s, generate {report['generate_s']:.2f} s, "
          f"process {time.perf_counter() - started:.1f} s")

    worst = 0.0
    assert len(report["results"]) == len(prompts)
    for prompt, result in zip(prompts, report["results"]):
        generated = result["token_ids"]
        assert result["finish_reason"] == "stop" and generated[-1] in chat.stop_token_ids
        assert extract_react_action(chat.decode(generated)) in ACTIONS
        with torch.no_grad():
            logits = model(torch.tensor([prompt + generated])).logits[0, len(prompt) - 1 : -1]
        hf_logprobs = torch.log_softmax(logits / 0.7, dim=-1).gather(1, torch.tensor(generated)[:, None])[:, 0]
        worst = max(worst, (hf_logprobs - torch.tensor(result["logprobs"])).abs().max().item())
    print(f"max |vLLM - HF| logprob: {worst:.2e}")
    assert worst < 1e-4


def test_the_build_device_is_recorded_and_not_part_of_the_spec(tmp_path):
    """``--device cuda`` runs a long warm-up on a GPU; the directory it builds is then reused by a CPU run that asks
    for the same recipe (configs name the recipe, not where it ran). The device is in the build's figures."""
    from horizonrl.apps.tiny_model import main

    args = dict(envs=("signpost",), episodes_per_env=8, warmup_steps=1, batch_size=4, max_turns=3, progress=False)
    out = ensure_tiny_model(tmp_path / "m", device="cpu", **args)
    record = read_spec(out)
    assert record["built"]["device"] == "cpu" and "device" not in record["spec"]
    assert record["spec"] == tiny_model_spec(**{k: v for k, v in args.items() if k != "progress"})
    # as a GPU build would have written it: reused by a build that names no device
    record["built"]["device"] = "cuda"
    (out / SPEC_FILE).write_text(json.dumps(record))
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model(tmp_path / "m", **args) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    # the command line passes it through
    assert main([str(tmp_path / "cli"), "--episodes-per-env", "8", "--steps", "1", "--batch-size", "4",
                 "--max-turns", "3", "--device", "cpu"]) == 0
    assert read_spec(tmp_path / "cli")["built"]["device"] == "cpu"
