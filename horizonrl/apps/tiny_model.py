"""A tiny chat model built from nothing, for the CPU tests, the demo and CI.

No model hub is reachable, so the starting policy is made here:

1. play random-policy episodes of the chosen environments (``random_action``),
2. train a byte-level BPE tokenizer on their text, with ChatML special tokens and a
   Qwen2.5-style chat template,
3. build a 2-layer Qwen2 model (hidden 128, 2 heads of 64, 1 KV head, tied embeddings),
4. warm it up as a language model on those episodes, loss on the assistant tokens only.

The warm-up teaches the reply *format* ("Action: go left<|im_end|>") with uniform
action choice — not the skill; RL has to find that. The result is an ordinary Hugging
Face directory that ``AutoModelForCausalLM``/``AutoTokenizer`` and vLLM load.

CLI: ``horizonrl make-tiny-model OUT_DIR [--envs signpost,babyai] [--env-settings JSON]
[--steps N] [--seed S]``. torch/transformers are imported inside functions so that
``--help`` answers at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

    from horizonrl.core.chat import ChatTokenizer

# Bump when the recipe changes so that ``ensure_tiny_model`` rebuilds stale directories.
RECIPE_VERSION = 2  # 2: Signpost's random replies restate the sign in a ReAct thought
SPEC_FILE = "horizonrl_tiny_model.json"

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# ChatML as Qwen2.5-Instruct renders it when there are no tools, minus Qwen's default
# system message (the tiny model has no use for it; pass a system prompt if you want one).
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen3's rewriting of history, on the same ChatML markup: the generation prompt opens an empty think block
# (Qwen3 with enable_thinking=False), and an earlier assistant turn is rendered without its think block. So the
# prompt of turn k+1 is never the prompt of turn k plus the reply: episodes with it branch (core/chat.py). Used by
# the tests; put it in a tiny model's tokenizer_config.json to train through the loop with such a template.
THINKING_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- set content = message['content'] %}"
    "{%- if message['role'] == 'assistant' and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
)
# Qwen2's pre-tokenization regex (transformers' Qwen2Tokenizer): single digits, words with
# at most one leading non-letter, newlines kept apart from the words after them.
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

DEFAULT_VOCAB_SIZE = 1024
DEFAULT_EPISODES_PER_ENV = 3000
DEFAULT_WARMUP_STEPS = 250
DEFAULT_BATCH_SIZE = 32
DEFAULT_LR = 3e-3
DEFAULT_MAX_TURNS = 20

# The small signpost model the test suites share: ``cached_tiny_model(**SIGNPOST_TEST_MODEL)``.
# The assistant-token loss nears its floor (ln 3 / 5 reply tokens ≈ 0.22) in ~50 steps, but the
# tail of unused byte tokens needs ~120 steps to fall below 1% of sampled replies at T=1;
# 12 turns cover signpost's usual budgets (its default task needs 4 correct moves).
SIGNPOST_TEST_MODEL: dict[str, Any] = {
    "envs": ("signpost",),
    "episodes_per_env": 800,
    "warmup_steps": 120,
    "max_turns": 12,
}


# ---------------------------------------------------------------------------- tokenizer


def build_tokenizer(texts: Sequence[str], vocab_size: int = DEFAULT_VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on ``texts``, with ChatML specials and chat template.

    Ids 0, 1, 2 are ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``. All 256 bytes are
    in the vocabulary, so any text encodes (BPE merges stop early when ``texts`` run out of
    frequent pairs, so the vocabulary may be smaller than ``vocab_size``). Like
    Qwen2.5-Instruct: eos is ``<|im_end|>``, pad is ``<|endoftext|>``, no BOS.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    # Exactly Qwen2's normalizer and pre-tokenizer: AutoTokenizer (and so vLLM) loads this
    # directory as a Qwen2Tokenizer, which installs them whatever tokenizer.json says, and
    # the ids must not depend on how the directory was loaded.
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Special tokens are cut out of the training text, as they will be at encode time.
    cleaned = [_strip_special(t) for t in texts]
    bpe.train_from_iterator(cleaned, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=None,
        bos_token=None,
        additional_special_tokens=[IM_START, IM_END],
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def episodes_tokenizer(episodes: Sequence[RandomEpisode], vocab_size: int = DEFAULT_VOCAB_SIZE
                       ) -> PreTrainedTokenizerFast:
    """The tiny model's tokenizer: trained on the episodes' messages and the chat template's role names."""
    texts = [m["content"] for e in episodes for m in e.messages]
    return build_tokenizer(texts + ["user\nassistant\nsystem\n"] * 100, vocab_size)


def _strip_special(text: str) -> str:
    for token in SPECIAL_TOKENS:
        text = text.replace(token, "\n")
    return text


# ---------------------------------------------------------------------------- model


def build_model(vocab_size: int, seed: int = 0, layers: int = 2, hidden: int = 128) -> Qwen2ForCausalLM:
    """The tiny Qwen2: by default 2 layers, hidden 128, 2 heads × 64 (hidden / 64 heads), 1 KV head, MLP
    twice the hidden size, tied embeddings, float32.

    head_dim 64 because vLLM's CPU attention rejects 16. Token ids follow
    :func:`build_tokenizer` (``<|endoftext|>`` = 0 is bos/pad, ``<|im_end|>`` = 2 is eos).
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=SPECIAL_TOKENS.index(ENDOFTEXT),
        eos_token_id=SPECIAL_TOKENS.index(IM_END),
        pad_token_id=SPECIAL_TOKENS.index(ENDOFTEXT),
        use_sliding_window=False,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    return model


# ---------------------------------------------------------------------------- random episodes


@dataclass(frozen=True)
class RandomEpisode:
    """One random-policy episode as chat messages: user observations and assistant replies."""

    env_name: str
    task_id: int
    messages: tuple[dict[str, str], ...]
    success: bool


async def _play_random_episode(env: Any, task_id: int, rng: random.Random, max_turns: int) -> tuple[list, bool]:
    messages = [{"role": "user", "content": await env.reset(task_id)}]
    success = False
    for _ in range(max_turns):
        reply = env.random_action(rng)
        messages.append({"role": "assistant", "content": reply})
        result = await env.step(reply)
        if result.done:
            success = result.success
            break
        messages.append({"role": "user", "content": result.observation})
    return messages, success


async def random_episodes_async(
    env_name: str,
    settings: dict[str, Any] | None,
    num_episodes: int,
    seed: int = 0,
    max_turns: int = DEFAULT_MAX_TURNS,
    concurrency: int = 8,
) -> list[RandomEpisode]:
    """``num_episodes`` random-policy episodes of one environment on train task ids.

    Episode ``i`` draws its task id and its actions from its own ``Random(f"{seed}:{env}:{i}")``,
    so the result does not depend on ``concurrency`` or scheduling. The conversation ends
    with the last assistant reply (the final observation is never trained on).
    """
    from horizonrl.envs import make_env

    envs = [make_env(env_name, settings) for _ in range(max(1, min(concurrency, num_episodes)))]
    train_ids = envs[0].task_ids("train")
    episodes: list[RandomEpisode | None] = [None] * num_episodes

    async def worker(env: Any, indices: range) -> None:
        for i in indices:
            rng = random.Random(f"{seed}:{env_name}:{i}")
            task_id = rng.choice(train_ids)
            messages, success = await _play_random_episode(env, task_id, rng, max_turns)
            if messages[-1]["role"] == "user":  # ran out of turns after an observation
                messages = messages[:-1]
            episodes[i] = RandomEpisode(env_name, task_id, tuple(messages), success)

    try:
        await asyncio.gather(*(worker(env, range(k, num_episodes, len(envs))) for k, env in enumerate(envs)))
    finally:
        for env in envs:
            await env.close()
    return [e for e in episodes if e is not None]


def random_episodes(
    env_name: str,
    settings: dict[str, Any] | None,
    num_episodes: int,
    seed: int = 0,
    max_turns: int = DEFAULT_MAX_TURNS,
) -> list[RandomEpisode]:
    """Synchronous wrapper of :func:`random_episodes_async`."""
    return asyncio.run(random_episodes_async(env_name, settings, num_episodes, seed, max_turns))


def episode_ids(
    chat: ChatTokenizer, messages: Sequence[dict[str, str]], system_prompt: str | None = None
) -> tuple[list[int], list[int]]:
    """Token ids and loss mask of one conversation, built append-only as the actor builds it.

    The mask is 1 exactly on assistant tokens, their end-of-turn token included.
    """
    if not messages or messages[0]["role"] != "user":
        raise ValueError("a conversation starts with the first observation (a user message)")
    ids = chat.prompt_ids(messages[0]["content"], system_prompt)
    mask = [0] * len(ids)
    last_reply: list[int] = []
    for message in messages[1:]:
        if message["role"] == "assistant":
            last_reply = chat.assistant_ids(message["content"])
            ids += last_reply
            mask += [1] * len(last_reply)
        else:
            piece = chat.continuation_ids(message["content"], last_reply)
            ids += piece
            mask += [0] * len(piece)
    return ids, mask


# ---------------------------------------------------------------------------- warm-up


def assistant_token_loss(logits: Any, input_ids: Any, loss_mask: Any) -> Any:
    """Mean next-token cross-entropy over the tokens with ``loss_mask`` 1.

    logits [B, T, V], input_ids [B, T], loss_mask [B, T] (1 on assistant tokens). Token t is
    predicted from position t-1, so the mask is read shifted by one.
    """
    import torch.nn.functional as F

    target_mask = loss_mask[:, 1:].float()
    nll = F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), input_ids[:, 1:].reshape(-1), reduction="none"
    ).view_as(target_mask)
    return (nll * target_mask).sum() / target_mask.sum().clamp(min=1.0)


def warmup(
    model: Any,
    sequences: Sequence[tuple[list[int], list[int]]],
    steps: int = DEFAULT_WARMUP_STEPS,
    batch_size: int = DEFAULT_BATCH_SIZE,
    lr: float = DEFAULT_LR,
    seed: int = 0,
    pad_id: int = 0,
    progress: bool = True,
    num_threads: int = 1,
    device: str = "cpu",
) -> list[float]:
    """Language-model warm-up on (ids, loss_mask) pairs; returns the loss of every step.

    AdamW with a 10-step linear warm-up and cosine decay to 10% of ``lr``. Batches are
    drawn by epochs of a seeded permutation, right-padded; padding has mask 0.

    One torch thread by default: the result then does not depend on the machine's core
    count, and on a busy 2-core machine (tests beside engines) two threads spin-wait on
    each other and run 3-4x slower than one.

    ``device`` (e.g. ``cuda``): where the steps run; the model is back on the CPU afterwards. Batches are
    drawn the same way on every device, but the arithmetic differs, so the weights do too (slightly).
    """
    import torch

    previous_threads = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    model.to(device)
    try:
        return _warmup_loop(model, sequences, steps, batch_size, lr, seed, pad_id, progress, device)
    finally:
        model.to("cpu")
        torch.set_num_threads(previous_threads)


def _warmup_loop(
    model: Any,
    sequences: Sequence[tuple[list[int], list[int]]],
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    pad_id: int,
    progress: bool,
    device: str = "cpu",
) -> list[float]:
    import torch
    from tqdm import tqdm

    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min(1.0, (s + 1) / 10) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))),
    )
    model.train()
    batches: list[list[int]] = []
    losses: list[float] = []
    bar = tqdm(range(steps), desc="tiny-model warm-up", disable=not progress, file=sys.stderr)
    for _ in bar:
        if not batches:
            batches = _length_bucketed_batches([len(ids) for ids, _ in sequences], batch_size, generator)
        batch = [sequences[i] for i in batches.pop()]
        input_ids, attention_mask, loss_mask = (t.to(device) for t in _pad_batch(batch, pad_id))
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        loss = assistant_token_loss(logits, input_ids, loss_mask)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
    model.eval()
    return losses


def _length_bucketed_batches(lengths: Sequence[int], batch_size: int, generator: Any) -> list[list[int]]:
    """One epoch of batches; each batch holds sequences of similar length (less padding).

    A random permutation is cut into windows of 8 batches, each window sorted by length and
    split into batches; the batch order is shuffled again so that lengths do not trend.
    """
    import torch

    order = torch.randperm(len(lengths), generator=generator).tolist()
    window = 8 * batch_size
    batches = []
    for start in range(0, len(order), window):
        chunk = sorted(order[start : start + window], key=lambda i: lengths[i])
        batches += [chunk[k : k + batch_size] for k in range(0, len(chunk), batch_size)]
    batches = [b for b in batches if len(b) == batch_size] or batches
    return [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]


def _pad_batch(batch: Sequence[tuple[list[int], list[int]]], pad_id: int) -> tuple[Any, Any, Any]:
    import torch

    length = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), length), dtype=torch.long)
    loss_mask = torch.zeros((len(batch), length), dtype=torch.long)
    for row, (ids, mask) in enumerate(batch):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention_mask[row, : len(ids)] = 1
        loss_mask[row, : len(ids)] = torch.tensor(mask)
    return input_ids, attention_mask, loss_mask


# ---------------------------------------------------------------------------- the whole recipe


def tiny_model_spec(
    envs: Sequence[str] = ("signpost",),
    env_settings: dict[str, dict[str, Any]] | None = None,
    episodes_per_env: int = DEFAULT_EPISODES_PER_ENV,
    warmup_steps: int = DEFAULT_WARMUP_STEPS,
    seed: int = 0,
    max_turns: int = DEFAULT_MAX_TURNS,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    batch_size: int = DEFAULT_BATCH_SIZE,
    lr: float = DEFAULT_LR,
    system_prompt: str | None = None,
    layers: int = 2,
    hidden: int = 128,
) -> dict[str, Any]:
    """Everything that determines the built directory (stored in its spec file)."""
    envs = list(envs)
    unknown = set(env_settings or {}) - set(envs)
    if unknown:
        raise ValueError(f"env_settings names environments not in envs: {sorted(unknown)}")
    return {
        "recipe_version": RECIPE_VERSION,
        "envs": envs,
        "env_settings": {name: (env_settings or {}).get(name, {}) for name in envs},
        "episodes_per_env": episodes_per_env,
        "warmup_steps": warmup_steps,
        "seed": seed,
        "max_turns": max_turns,
        "vocab_size": vocab_size,
        "batch_size": batch_size,
        "lr": lr,
        "system_prompt": system_prompt,
        # The shape only when it is not the default, so directories built before it was a setting stay valid.
        **({"shape": {"layers": layers, "hidden": hidden}} if (layers, hidden) != (2, 128) else {}),
    }


def make_tiny_model(
    out_dir: str | os.PathLike,
    envs: Sequence[str] = ("signpost",),
    env_settings: dict[str, dict[str, Any]] | None = None,
    episodes_per_env: int = DEFAULT_EPISODES_PER_ENV,
    warmup_steps: int = DEFAULT_WARMUP_STEPS,
    seed: int = 0,
    max_turns: int = DEFAULT_MAX_TURNS,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    batch_size: int = DEFAULT_BATCH_SIZE,
    lr: float = DEFAULT_LR,
    system_prompt: str | None = None,
    progress: bool = True,
    layers: int = 2,
    hidden: int = 128,
    device: str = "cpu",
) -> dict[str, Any]:
    """Build the tiny model into ``out_dir`` (a Hugging Face directory) and return its spec file.

    The spec file records the arguments and the build's figures (episode count, random
    success rate, warm-up seconds, final loss, the device). Same arguments and device → same
    weights. The device is where the recipe ran, not part of it: a directory built on a GPU
    (``device="cuda"``, for long warm-ups) is reused by a CPU run that asks for the same spec.
    """
    import torch
    from transformers import GenerationConfig

    from horizonrl.core.chat import ChatTokenizer

    spec = tiny_model_spec(
        envs, env_settings, episodes_per_env, warmup_steps, seed, max_turns, vocab_size, batch_size, lr, system_prompt,
        layers, hidden,
    )
    torch.empty(0, device=device)  # an absent or unknown device fails now, not after the episodes are played
    random.seed(seed)
    torch.manual_seed(seed)
    started = time.perf_counter()
    episodes = [
        episode
        for name in spec["envs"]
        for episode in random_episodes(name, spec["env_settings"][name], episodes_per_env, seed, max_turns)
    ]
    episodes_s = time.perf_counter() - started

    tokenizer = episodes_tokenizer(episodes, vocab_size)
    chat = ChatTokenizer(tokenizer)
    sequences = [episode_ids(chat, e.messages, system_prompt) for e in episodes]

    model = build_model(len(tokenizer), seed, layers, hidden)
    started = time.perf_counter()
    losses = warmup(model, sequences, warmup_steps, batch_size, lr, seed, tokenizer.pad_token_id, progress,
                    device=device)
    warmup_s = time.perf_counter() - started
    final_loss = sum(losses[-10:]) / max(1, len(losses[-10:]))
    # The curve, for comparing warm-ups: a model learning to copy from its context shows a fall after a plateau.
    loss_by_100_steps = [round(sum(block) / len(block), 4) for block in
                         (losses[i:i + 100] for i in range(0, len(losses), 100))]

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=[*chat.stop_token_ids, tokenizer.pad_token_id],
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    record = {
        "spec": spec,
        "built": {
            "episodes": len(episodes),
            "random_success_rate": sum(e.success for e in episodes) / max(1, len(episodes)),
            "tokens": sum(len(ids) for ids, _ in sequences),
            "max_sequence_tokens": max(len(ids) for ids, _ in sequences),
            "vocab_size": len(tokenizer),
            "parameters": sum(p.numel() for p in model.parameters()),
            "episodes_s": round(episodes_s, 2),
            "warmup_s": round(warmup_s, 2),
            "final_loss": final_loss,
            "loss_by_100_steps": loss_by_100_steps,
            "device": str(device),
        },
    }
    (out / SPEC_FILE).write_text(json.dumps(record, indent=2) + "\n")
    print(
        f"tiny model -> {out}: {len(episodes)} random episodes ({episodes_s:.1f} s), "
        f"vocab {len(tokenizer)}, {record['built']['parameters']:,} parameters, "
        f"warm-up {warmup_steps} steps in {warmup_s:.1f} s on {device}, final loss {final_loss:.4f}",
        file=sys.stderr,
    )
    return record


def read_spec(out_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The spec file of a built directory, or None if there is none (or it is unreadable)."""
    try:
        return json.loads((Path(out_dir) / SPEC_FILE).read_text())
    except (OSError, ValueError):
        return None


# The tiny model the integration tests and `horizonrl bench` share (cached in .cache/tiny-signpost).
SIGNPOST_TEST_RECIPE: dict[str, Any] = dict(envs=("signpost",), env_settings={"signpost": {"length": 4}},
                                            episodes_per_env=1500, warmup_steps=200, max_turns=6)


# make_tiny_model's arguments that do not change what it builds: kept out of the spec a directory is matched by.
NOT_IN_SPEC = ("progress", "device")


def ensure_tiny_model(out_dir: str | os.PathLike, **kwargs: Any) -> Path:
    """``out_dir`` built by :func:`make_tiny_model` with ``kwargs``; built only if it is not already (its spec file
    matches the arguments), as :func:`build_once_into` builds."""
    wanted = tiny_model_spec(**{k: v for k, v in kwargs.items() if k not in NOT_IN_SPEC})
    return build_once_into(Path(out_dir), built=lambda out: (read_spec(out) or {}).get("spec") == wanted,
                           ours=lambda out: read_spec(out) is not None, build=lambda staging: make_tiny_model(
                               staging, **kwargs), what="the tiny model")


def build_once_into(out: Path, *, built: Callable[[Path], bool], ours: Callable[[Path], bool],
                    build: Callable[[Path], Any], what: str) -> Path:
    """``out`` holding what ``build(directory)`` makes, unless ``built(out)`` says it already does.

    Builds into a sibling temporary directory and renames it into place, so a half-built directory is never seen.
    Builders of the same directory take turns on a lock file beside it: a second one (a parallel test worker, a
    second ``horizonrl demo``) waits for the first build and reuses it instead of building it again. A directory
    that holds something else (``ours(out)`` false, and not empty) is never deleted."""
    if built(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with build_lock(out.parent / f".{out.name}.lock", f"{what} {out}"):
        if built(out):
            return out  # built while we waited
        if out.exists() and not ours(out) and any(out.iterdir()):
            raise FileExistsError(f"{out} exists and holds something else than {what}; choose another path")
        staging = out.parent / f".{out.name}.building-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        try:
            build(staging)
            if out.exists():
                shutil.rmtree(out)  # ours, built from something else
            staging.rename(out)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return out


@contextlib.contextmanager
def build_lock(lock_path: Path, what: str, timeout_s: float = 3600.0):
    """Hold an exclusive lock on ``lock_path`` (created if missing) while building ``what``. A second builder
    waits, saying so once, and gives up with an error after ``timeout_s``. The lock goes with its holder: a
    builder that dies (even by kill -9) releases it, so a lock file left behind never blocks anyone."""
    import fcntl

    with open(lock_path, "w") as lock:
        deadline = time.monotonic() + timeout_s
        waiting = False
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another process has been building {what} for over {timeout_s:.0f} s "
                                       f"(it holds {lock_path}): stop it if it hangs, or build elsewhere") from None
                if not waiting:
                    print(f"waiting for another process building {what}", file=sys.stderr)
                    waiting = True
                time.sleep(1.0)
        yield


def default_cache_dir() -> Path:
    """Where :func:`cached_tiny_model` keeps built models: ``$HORIZONRL_CACHE_DIR`` or ~/.cache/horizonrl."""
    return Path(os.environ.get("HORIZONRL_CACHE_DIR") or Path.home() / ".cache" / "horizonrl").expanduser()


def cached_tiny_model(**kwargs: Any) -> Path:
    """:func:`ensure_tiny_model` in a directory of the cache named after the spec.

    Every caller with the same arguments (tests, demo, benchmarks) shares one build;
    different specs do not overwrite each other.
    """
    spec = tiny_model_spec(**{k: v for k, v in kwargs.items() if k not in NOT_IN_SPEC})
    digest = hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    return ensure_tiny_model(default_cache_dir() / f"tiny-{'-'.join(spec['envs'])}-{digest}", **kwargs)


# ---------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="horizonrl make-tiny-model",
        description="Build the tiny Qwen2 chat model (tokenizer + format warm-up on random episodes).",
    )
    parser.add_argument("out_dir", help="directory to write the Hugging Face model into")
    parser.add_argument("--envs", default="signpost", help="comma-separated environment names (default: signpost)")
    parser.add_argument(
        "--env-settings",
        default="{}",
        help='JSON object: env name -> settings, e.g. \'{"babyai": {"levels": ["BabyAI-GoToRedBallNoDists-v0"]}}\'',
    )
    parser.add_argument("--episodes-per-env", type=int, default=DEFAULT_EPISODES_PER_ENV)
    parser.add_argument("--steps", type=int, default=DEFAULT_WARMUP_STEPS, help="warm-up optimizer steps")
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE)
    parser.add_argument("--lr", type=float, default=DEFAULT_LR)
    parser.add_argument("--max-turns", type=int, default=DEFAULT_MAX_TURNS, help="turn cap of a random episode")
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE, help="BPE vocabulary upper bound")
    parser.add_argument("--system-prompt", default=None)
    parser.add_argument("--layers", type=int, default=2, help="decoder layers")
    parser.add_argument("--hidden", type=int, default=128, help="hidden size, a multiple of 64 (heads of 64)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu",
                        help="where the warm-up runs (cpu, cuda, cuda:1); the spec is the same on every device")
    parser.add_argument("--reuse", action="store_true", help="keep OUT_DIR if it was built with the same arguments")
    args = parser.parse_args(argv)
    try:
        env_settings = json.loads(args.env_settings)
    except ValueError as exc:
        parser.error(f"--env-settings is not valid JSON: {exc}")
    if not isinstance(env_settings, dict) or not all(isinstance(v, dict) for v in env_settings.values()):
        parser.error("--env-settings must be a JSON object mapping env names to settings objects")
    from horizonrl.envs import env_names

    envs = [e.strip() for e in args.envs.split(",") if e.strip()]
    unknown = [e for e in [*envs, *env_settings] if e not in env_names()]
    if not envs or unknown:
        parser.error(f"unknown environments {unknown}; known: {', '.join(env_names())}")
    if set(env_settings) - set(envs):
        parser.error(f"--env-settings names environments not in --envs: {sorted(set(env_settings) - set(envs))}")
    kwargs = dict(
        envs=envs,
        env_settings=env_settings,
        episodes_per_env=args.episodes_per_env,
        warmup_steps=args.steps,
        seed=args.seed,
        max_turns=args.max_turns,
        vocab_size=args.vocab_size,
        batch_size=args.batch_size,
        lr=args.lr,
        system_prompt=args.system_prompt,
        layers=args.layers,
        hidden=args.hidden,
        device=args.device,
    )
    if args.hidden < 64 or args.hidden % 64 or args.layers < 1:
        parser.error("--hidden must be a multiple of 64 (attention heads of 64) and --layers at least 1")
    if args.reuse:
        print(ensure_tiny_model(args.out_dir, **kwargs))
    else:
        make_tiny_model(args.out_dir, **kwargs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
