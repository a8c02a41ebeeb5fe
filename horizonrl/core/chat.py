"""Token sequences of multi-turn episodes, built append-only from a chat template.

An episode is token-in/token-out: the ids the engine is prompted with are exactly the
ids the learner trains on, and the model's generated ids are kept as generated — never
decoded and re-tokenized (decode→encode is not an identity, and it would silently change
the tokens whose behaviour logprobs we hold).

So the sequence grows by appending only::

    prompt_ids(first_obs)                       system? + user(first_obs) + assistant header
    + generated_ids                             the model's reply, usually ending in <eot>
    + continuation_ids(obs, generated_ids)      [<eot> if truncated] + rest of the turn end
                                                + user(obs) + assistant header
    + generated_ids + ...

``continuation_ids`` is derived from the chat template itself: a probe conversation is
rendered with and without the new user message and the difference is taken after the
assistant's end-of-turn token. For a ChatML template (Qwen2.5-Instruct) that is
``"\\n<|im_start|>user\\n{obs}<|im_end|>\\n<|im_start|>assistant\\n"``.

Templates that rewrite history (Qwen3 drops the ``<think>`` blocks of earlier assistant turns, and
writes an empty one into the generation prompt when thinking is off) are not append-only: the
prompt of turn k+1 is not the prompt of turn k plus what was generated. For them
(``append_only`` is False) every next prompt is rendered in full (:meth:`ChatTokenizer.conversation_ids`);
the episode compares it with the tokens it holds and, where they differ, starts a new *sample*
whose prompt is that rendering (``actors/episode.py``, ``docs/algorithms.md``). Either way the
engine is prompted with exactly the ids the learner trains on.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Sequence

# Placeholders for the probe conversation. They are plain words so that every template
# renders them unchanged (some templates trim or escape content).
_PROBE_USER = "horizonrlprobeuser"
_PROBE_ASSISTANT = "horizonrlprobeassistant"
# A reply with a reasoning block: templates that strip or reformat reasoning in history show it only with one.
_PROBE_THINKING = "<think>\nhorizonrlprobethought\n</think>\n\nhorizonrlprobeassistant"
CONTINUATION_CACHE_SIZE = 4096  # observations whose ids are kept, per kind (most recently used first)


class ChatTemplateError(ValueError):
    """The tokenizer's chat template cannot be used to build an episode's sequences."""


class ChatTokenizer:
    """A Hugging Face tokenizer with a chat template, used to build an episode's ids.

    Invariant, when ``append_only``: for assistant turns whose ids are ``assistant_ids(text)``,
    ``prompt_ids(o1) + a1 + continuation_ids(o2, a1) + a2 + ...`` equals
    ``tokenizer.apply_chat_template(messages, add_generation_prompt=True)``. When the template
    rewrites history (``append_only`` False), ``continuation_ids`` refuses and the episode renders
    each prompt with ``conversation_ids`` instead.

    ``end_of_turn_token`` defaults to the first token the template writes after an
    assistant message's content (``<|im_end|>`` for ChatML, ``<|eot_id|>`` for Llama 3).
    """

    def __init__(self, tokenizer: Any, end_of_turn_token: str | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ChatTemplateError("the tokenizer has no chat_template; pass a chat (instruct) tokenizer")
        self.tokenizer = tokenizer
        self._probe_history = [
            {"role": "user", "content": _PROBE_USER},
            {"role": "assistant", "content": _PROBE_ASSISTANT},
        ]
        history_text = self._render(self._probe_history, add_generation_prompt=False)
        # What the template writes after the assistant content: the end-of-turn token and
        # whatever closes the turn (ChatML: "<|im_end|>\n").
        cut = history_text.rfind(_PROBE_ASSISTANT)
        if cut < 0:
            raise ChatTemplateError("the chat template does not render assistant content verbatim")
        after_content = history_text[cut + len(_PROBE_ASSISTANT):]
        if end_of_turn_token is None:
            end_of_turn_token = self._first_special_token(after_content)
        if not after_content.startswith(end_of_turn_token):
            raise ChatTemplateError(
                f"the chat template writes {after_content[:40]!r} after assistant content, "
                f"not the end-of-turn token {end_of_turn_token!r}"
            )
        eot_id = tokenizer.convert_tokens_to_ids(end_of_turn_token)
        if eot_id is None or eot_id == tokenizer.unk_token_id:
            raise ChatTemplateError(f"end-of-turn token {end_of_turn_token!r} is not in the vocabulary")
        self.end_of_turn_token = end_of_turn_token
        self.end_of_turn_id: int = int(eot_id)
        self._history_text = history_text
        self._turn_close_text = after_content[len(end_of_turn_token):]
        # The actor tokenizes every observation on its event loop, beside the engine's client: the Rust
        # tokenizer directly (when it gives the same ids as the transformers wrapper around it, which adds
        # Python work per call), and each observation's continuation once (environments repeat them).
        self._backend = self._same_ids_backend(history_text)
        self._continuations: OrderedDict[str, list[int]] = OrderedDict()
        self._prompts: OrderedDict[tuple[str, str | None], list[int]] = OrderedDict()
        # Probed once: whether a conversation's rendering only ever grows at its end.
        self.append_only: bool = all(self._renders_append_only(reply) for reply in (_PROBE_ASSISTANT, _PROBE_THINKING))

    # ------------------------------------------------------------------ public API

    @property
    def stop_token_ids(self) -> list[int]:
        """Ids that end generation: the end-of-turn token, then eos if it is different."""
        ids = [self.end_of_turn_id]
        eos = self.tokenizer.eos_token_id
        if eos is not None and eos not in ids:
            ids.append(int(eos))
        return ids

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce (special tokens included)."""
        return len(self.tokenizer)

    def prompt_ids(self, first_observation: str, system_prompt: str | None = None) -> list[int]:
        """The episode's first prompt: [system?, user(first_observation)] + assistant header."""
        key = (first_observation, system_prompt)
        cached = self._prompts.get(key)
        if cached is not None:
            self._prompts.move_to_end(key)
        else:  # a group's n episodes start from the same observation
            messages = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
            messages.append({"role": "user", "content": first_observation})
            cached = self._prompts[key] = self.encode(self._render(messages, add_generation_prompt=True))
            if len(self._prompts) > CONTINUATION_CACHE_SIZE:
                self._prompts.popitem(last=False)
        return list(cached)

    def continuation_ids(self, observation: str, generated_ids: Sequence[int]) -> list[int]:
        """Ids to append after a generated assistant turn: turn end + user(observation) + header.

        When ``generated_ids`` does not end with the end-of-turn token (generation was cut
        by max_tokens, or stopped on eos), the returned list starts with that token, so the
        sequence always closes the assistant turn the way the template does.
        """
        ids = [] if generated_ids and generated_ids[-1] == self.end_of_turn_id else [self.end_of_turn_id]
        return ids + self._observation_ids(observation)

    def conversation_ids(self, observations: Sequence[str], replies: Sequence[str],
                         system_prompt: str | None = None) -> list[int]:
        """The template's full rendering of [system?, user(o0), assistant(r0), user(o1), ...] plus the
        generation prompt: the next prompt of a conversation whose template is not append-only.
        ``observations`` has one entry more than ``replies`` (the conversation ends with a user turn)."""
        if len(observations) != len(replies) + 1:
            raise ValueError(f"{len(observations)} observations for {len(replies)} replies; expected one more")
        messages = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
        for i, observation in enumerate(observations):
            messages.append({"role": "user", "content": observation})
            if i < len(replies):
                messages.append({"role": "assistant", "content": replies[i]})
        return self.encode(self._render(messages, add_generation_prompt=True))

    def _observation_ids(self, observation: str) -> list[int]:
        cached = self._continuations.get(observation)
        if cached is not None:
            self._continuations.move_to_end(observation)
            return cached
        full = self._render(
            [*self._probe_history, {"role": "user", "content": observation}], add_generation_prompt=True
        )
        if not self.append_only or not full.startswith(self._history_text):
            raise ChatTemplateError(
                "the chat template is not append-only: adding a user message changed the rendering "
                "of the earlier turns, so the sequence cannot be built incrementally (render it with "
                "conversation_ids)"
            )
        ids = self.encode(self._turn_close_text + full[len(self._history_text):])
        self._continuations[observation] = ids
        if len(self._continuations) > CONTINUATION_CACHE_SIZE:
            self._continuations.popitem(last=False)
        return ids

    def assistant_ids(self, reply: str) -> list[int]:
        """A reply's ids as the model would generate them: tokenize(reply) + end-of-turn.

        Used only for text that did not come from the model (warm-up data, tests).
        """
        return self.encode(reply) + [self.end_of_turn_id]

    def encode(self, text: str) -> list[int]:
        """Plain tokenization, no BOS/EOS added (special tokens written in text are recognised)."""
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=False).ids
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; by default without special tokens (what an environment should see)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ internals

    def _same_ids_backend(self, sample: str):
        """The wrapped ``tokenizers.Tokenizer`` if it tokenizes like the wrapper on sample texts (chat markup,
        special tokens, spaces, newlines, unicode), else None (the wrapper is used)."""
        backend = getattr(self.tokenizer, "_tokenizer", None)
        if backend is None or not callable(getattr(backend, "encode", None)):
            return None
        samples = [sample, " leading space", "two\n\nlines  and\ttabs", "naïve café 東京 🙂", "",
                   self.end_of_turn_token + "x" + self.end_of_turn_token]
        try:
            same = all(backend.encode(t, add_special_tokens=False).ids
                       == list(self.tokenizer.encode(t, add_special_tokens=False)) for t in samples)
        except Exception:  # noqa: BLE001 - any other backend: keep the wrapper
            return None
        return backend if same else None

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False
        )

    def _first_special_token(self, text: str) -> str:
        special = sorted(
            {*self.tokenizer.all_special_tokens, *getattr(self.tokenizer, "get_added_vocab", dict)().keys()},
            key=len,
            reverse=True,
        )
        for token in special:
            if token and text.startswith(token):
                return token
        raise ChatTemplateError(
            f"cannot find the end-of-turn token: the chat template writes {text[:40]!r} after "
            "assistant content, which does not start with a special token; pass end_of_turn_token="
        )

    def _renders_append_only(self, reply: str) -> bool:
        """Whether, with ``reply`` as the assistant's turn, the generation prompt followed by the reply is
        how the history renders that turn, and adding a user message leaves the earlier turns as they were.
        Either failing means the ids generated after a prompt differ from the ids the next prompt holds."""
        prompt = self._render(self._probe_history[:1], add_generation_prompt=True)
        history = self._render([self._probe_history[0], {"role": "assistant", "content": reply}],
                               add_generation_prompt=False)
        grown = self._render([self._probe_history[0], {"role": "assistant", "content": reply},
                              {"role": "user", "content": _PROBE_USER}], add_generation_prompt=True)
        return history.startswith(prompt + reply) and grown.startswith(history)


def load_chat_tokenizer(model_path: str) -> ChatTokenizer:
    """The model's tokenizer (``model_path``: a Hugging Face model directory) as a :class:`ChatTokenizer`."""
    from transformers import AutoTokenizer  # transformers (and torch under it) only where a tokenizer is loaded

    return ChatTokenizer(AutoTokenizer.from_pretrained(model_path))
