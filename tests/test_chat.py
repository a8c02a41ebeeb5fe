"""ChatTokenizer builds an episode's ids append-only and equal to the template's full render, and tells templates
that rewrite history (rendered in full each turn) from those that do not."""

from __future__ import annotations

import copy

import pytest

from horizonrl.core.chat import ChatTemplateError, ChatTokenizer
from horizonrl.apps.tiny_model import CHATML_TEMPLATE, THINKING_CHAT_TEMPLATE, build_tokenizer

# Qwen2.5-Instruct's rendering without tools: ChatML with a default system message.
QWEN25_STYLE_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Llama-3 style: BOS written by the template, no newline after the end-of-turn token, trimmed content.
LLAMA3_STYLE_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

# Not append-only: the header counts the messages, so adding one rewrites the first line.
COUNTING_TEMPLATE = (
    "{{- '<|im_start|>system\\n' + (messages | length | string) + ' messages<|im_end|>\\n' }}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Not append-only (the way Qwen3 drops old reasoning): assistant turns before the latest
# user message are rendered differently from the latest one.
REWRITES_OLD_REPLIES_TEMPLATE = (
    "{%- set ns = namespace(last_user=0) %}"
    "{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- set content = ('(earlier) ' + message.content) if (message.role == 'assistant' and loop.index0 < ns.last_user) else message.content %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Not append-only: the generation prompt opens an empty think block that history turns do not have.
THINKING_PROMPT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
)

TEXTS = [
    "Follow the signs to the exit. Actions: go left, go right, go straight.\nA sign points left.",
    "Action: go left",
    "Thought: the sign points right.\nAction: go right",
    "red ball: 3 steps forward, 2 steps left",
    "Dead end. You walk back. A sign points straight.",
    "user\nassistant\nsystem\n",
] * 20

CONVERSATIONS = [
    [
        ("user", "Follow the signs to the exit. Actions: go left, go right, go straight.\nA sign points left."),
        ("assistant", "Action: go left"),
        ("user", "A sign points right."),
        ("assistant", "Thought: the sign points right.\nAction: go right"),
        ("user", "Dead end. You walk back. A sign points straight."),
    ],
    [
        ("system", "You are an agent. Reply with Thought: ... then Action: ..."),
        ("user", "red ball: 3 steps forward, 12 steps left\n\n  indented line"),
        ("assistant", "Action: turn left"),
        ("user", "red ball: not visible  "),
        ("assistant", "Thought: où est la balle? 🙂\nAction: move forward"),
        ("user", "Invalid action. Reply with one of: go left, go right, go straight."),
        ("assistant", "Action: go straight"),
        ("user", "42"),
    ],
    [("user", "A sign points left.")],
]


@pytest.fixture(scope="module")
def base_tokenizer():
    return build_tokenizer(TEXTS, vocab_size=400)


def _with_template(tokenizer, template: str):
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = template
    return tokenizer


def _llama3_tokenizer(tokenizer):
    from tokenizers import AddedToken

    tokenizer = _with_template(tokenizer, LLAMA3_STYLE_TEMPLATE)
    specials = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    tokenizer.add_tokens([AddedToken(t, special=True) for t in specials], special_tokens=True)
    tokenizer.bos_token = "<|begin_of_text|>"
    tokenizer.eos_token = "<|eot_id|>"
    return tokenizer


def _incremental_ids(chat: ChatTokenizer, conversation) -> list[int]:
    system = conversation[0][1] if conversation[0][0] == "system" else None
    turns = conversation[1:] if system is not None else conversation
    ids = chat.prompt_ids(turns[0][1], system)
    reply: list[int] = []
    for role, content in turns[1:]:
        if role == "assistant":
            reply = chat.assistant_ids(content)
            ids += reply
        else:
            ids += chat.continuation_ids(content, reply)
    return ids


def _full_render_ids(tokenizer, conversation) -> list[int]:
    messages = [{"role": r, "content": c} for r, c in conversation]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(ids)


@pytest.mark.parametrize("template_name", ["chatml", "qwen25", "llama3"])
@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=["signpost", "system-unicode", "one-turn"])
def test_incremental_ids_equal_full_render(base_tokenizer, template_name, conversation):
    if template_name == "llama3":
        tokenizer = _llama3_tokenizer(base_tokenizer)
    else:
        template = CHATML_TEMPLATE if template_name == "chatml" else QWEN25_STYLE_TEMPLATE
        tokenizer = _with_template(base_tokenizer, template)
    chat = ChatTokenizer(tokenizer)
    assert _incremental_ids(chat, conversation) == _full_render_ids(tokenizer, conversation)


def test_end_of_turn_token_is_found_from_the_template(base_tokenizer):
    chatml = ChatTokenizer(_with_template(base_tokenizer, CHATML_TEMPLATE))
    assert chatml.end_of_turn_token == "<|im_end|>"
    assert chatml.stop_token_ids == [chatml.end_of_turn_id]  # eos is <|im_end|> too
    llama = ChatTokenizer(_llama3_tokenizer(base_tokenizer))
    assert llama.end_of_turn_token == "<|eot_id|>"


def test_chatml_continuation_is_the_qwen_turn_boundary(base_tokenizer):
    chat = ChatTokenizer(_with_template(base_tokenizer, CHATML_TEMPLATE))
    reply = chat.assistant_ids("Action: go left")
    continuation = chat.continuation_ids("A sign points right.", reply)
    expected = "\n<|im_start|>user\nA sign points right.<|im_end|>\n<|im_start|>assistant\n"
    assert chat.decode(continuation, skip_special_tokens=False) == expected


def test_truncated_generation_gets_the_end_of_turn_token(base_tokenizer):
    tokenizer = _with_template(base_tokenizer, CHATML_TEMPLATE)
    chat = ChatTokenizer(tokenizer)
    prompt = chat.prompt_ids("A sign points left.")
    truncated = chat.encode("Thought: the sign")  # cut by max_tokens: no <|im_end|>
    continuation = chat.continuation_ids("A sign points left.", truncated)
    assert continuation[0] == chat.end_of_turn_id
    conversation = [("user", "A sign points left."), ("assistant", "Thought: the sign"), ("user", "A sign points left.")]
    assert prompt + truncated + continuation == _full_render_ids(tokenizer, conversation)
    # After a complete turn, the end-of-turn token is not repeated.
    complete = chat.assistant_ids("Action: go left")
    assert chat.continuation_ids("x", complete)[0] != chat.end_of_turn_id
    # A reply that stopped on eos (not the end-of-turn token) is closed as well.
    assert chat.continuation_ids("x", [])[0] == chat.end_of_turn_id


def test_decode_drops_special_tokens(base_tokenizer):
    chat = ChatTokenizer(_with_template(base_tokenizer, CHATML_TEMPLATE))
    assert chat.decode(chat.assistant_ids("Action: go left")) == "Action: go left"
    assert chat.decode(chat.assistant_ids("Action: go left"), skip_special_tokens=False) == "Action: go left<|im_end|>"


REWRITING_TEMPLATES = {"counting": COUNTING_TEMPLATE, "rewrites-old-replies": REWRITES_OLD_REPLIES_TEMPLATE,
                       "thinking-prompt": THINKING_PROMPT_TEMPLATE, "qwen3-style": THINKING_CHAT_TEMPLATE}


@pytest.mark.parametrize("name", list(REWRITING_TEMPLATES))
def test_a_template_that_rewrites_history_is_detected_and_rendered_in_full(base_tokenizer, name):
    tokenizer = _with_template(base_tokenizer, REWRITING_TEMPLATES[name])
    chat = ChatTokenizer(tokenizer)
    assert chat.append_only is False
    with pytest.raises(ChatTemplateError, match="not append-only"):
        chat.continuation_ids("A sign points left.", chat.assistant_ids("Action: go left"))
    conversation = CONVERSATIONS[1][1:]  # without the system message: passed apart
    observations = [c for r, c in conversation if r == "user"]
    replies = [c for r, c in conversation if r == "assistant"]
    assert chat.conversation_ids(observations, replies, CONVERSATIONS[1][0][1]) == _full_render_ids(
        tokenizer, CONVERSATIONS[1])
    with pytest.raises(ValueError, match="expected one more"):
        chat.conversation_ids(observations[:-1], replies)


@pytest.mark.parametrize("template", [CHATML_TEMPLATE, QWEN25_STYLE_TEMPLATE])
def test_append_only_templates_are_detected_as_such(base_tokenizer, template):
    assert ChatTokenizer(_with_template(base_tokenizer, template)).append_only is True
    assert ChatTokenizer(_llama3_tokenizer(base_tokenizer)).append_only is True


def test_the_qwen3_style_template_drops_earlier_think_blocks(base_tokenizer):
    """The template the tests train with rewrites history as Qwen3 does: a reply's think block is gone once a
    new user turn follows, and the generation prompt holds an empty one the history never shows."""
    chat = ChatTokenizer(_with_template(base_tokenizer, THINKING_CHAT_TEMPLATE))
    text = chat.decode(chat.conversation_ids(["A sign points left.", "Dead end."],
                                             ["<think>\nleft it is\n</think>\n\nAction: go left"]),
                       skip_special_tokens=False)
    assert text == ("<|im_start|>user\nA sign points left.<|im_end|>\n<|im_start|>assistant\nAction: go left"
                    "<|im_end|>\n<|im_start|>user\nDead end.<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_tokenizer_without_template_is_rejected(base_tokenizer):
    tokenizer = copy.deepcopy(base_tokenizer)
    tokenizer.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat_template"):
        ChatTokenizer(tokenizer)


def test_the_rust_tokenizer_and_the_continuation_cache_give_the_wrappers_ids(base_tokenizer, monkeypatch):
    import horizonrl.core.chat as chat_module

    chat = ChatTokenizer(_with_template(base_tokenizer, CHATML_TEMPLATE))
    assert chat._backend is not None  # a fast tokenizer: its Rust tokenizer is called directly
    texts = ["A sign points left.", " two  spaces\nand a line", "naïve café 東京", chat.end_of_turn_token + "x"]
    for text in texts:
        assert chat.encode(text) == list(chat.tokenizer.encode(text, add_special_tokens=False))
    monkeypatch.setattr(chat_module, "CONTINUATION_CACHE_SIZE", 2)
    first = chat.continuation_ids("A sign points left.", [5])
    assert chat.continuation_ids("A sign points left.", [5]) == first  # from the cache
    uncached = ChatTokenizer(_with_template(base_tokenizer, CHATML_TEMPLATE))
    uncached._backend = None
    assert uncached.continuation_ids("A sign points left.", [5]) == first
    for text in texts:
        chat.continuation_ids(text, [chat.end_of_turn_id])
    assert len(chat._continuations) == 2  # bounded: the least recently used are dropped
