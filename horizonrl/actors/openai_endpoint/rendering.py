"""An agent's conversation as the text the model's chat template makes of it.

The endpoint renders each request's messages (and tools) with the model's own chat template, as a stock
OpenAI-compatible server would, so the model sees what its template promises. Two cases:

- the template renders tools (it writes the tools it is given into the prompt: Qwen2.5, Qwen3, Hermes, Llama 3.1):
  messages and tools go to it as they are, tool-call arguments as objects (what Hugging Face templates take);
- it does not (SmolLM2's ChatML, the tiny test models): with ``tool_prompt="hermes"`` the endpoint writes the
  tools into the system message in the hermes convention, an assistant's earlier tool calls as ``<tool_call>``
  blocks and tool results as ``<tool_response>`` blocks in user turns, then renders those plain messages with the
  template; with ``tool_prompt="refuse"`` such a request is refused (HTTP 400).

Rendering text is for prompts only: the tokens a model generated are never rendered again (``session.py``).
"""

from __future__ import annotations

from typing import Any, Sequence

from horizonrl.actors.openai_endpoint.tool_calls import (
    TOOL_CALL_FORMATS,
    hermes_call_text,
    hermes_response_text,
    hermes_tools_text,
)
from horizonrl.actors.openai_endpoint.wire import ChatMessage, RequestError
from horizonrl.core.chat import ChatTemplateError, ChatTokenizer

TOOL_PROMPTS = ("hermes", "refuse")
_PROBE_TOOL = {"type": "function", "function": {"name": "horizonrlprobetool", "description": "probe",
                                                "parameters": {"type": "object", "properties": {}}}}


class ChatRenderer:
    """Renders requests with ``chat``'s tokenizer's template; ``native_tools`` says which case above applies."""

    def __init__(self, chat: ChatTokenizer, tool_format: str = "hermes", tool_prompt: str = "hermes") -> None:
        if tool_format not in TOOL_CALL_FORMATS or tool_prompt not in TOOL_PROMPTS:
            raise ValueError(f"tool_format one of {TOOL_CALL_FORMATS}, tool_prompt one of {TOOL_PROMPTS}")
        self.chat = chat
        self.tool_format = tool_format
        self.tool_prompt = tool_prompt
        self.native_tools = self._template_renders_tools()
        if not self.native_tools and tool_prompt == "hermes" and tool_format != "hermes":
            raise ChatTemplateError(f"the chat template cannot render tools and the endpoint's own tool prompt is "
                                    f"hermes; parsing {tool_format} replies would never find a call (use "
                                    "tool_call_format=hermes, or a template that renders tools)")

    def render(self, messages: Sequence[ChatMessage], tools: Sequence[dict], add_generation_prompt: bool) -> str:
        """The template's text of the conversation; RequestError (400) when the template cannot render it."""
        uses_tools = bool(tools) or any(m.tool_calls or m.role == "tool" for m in messages)
        if self.native_tools or not uses_tools:
            plain = [m.for_template() for m in messages]
            return self._apply(plain, list(tools) or None, add_generation_prompt)
        if self.tool_prompt == "refuse":
            raise RequestError(400, "this model's chat template cannot render tools (it ignores them), and the "
                                    "endpoint is set to refuse tool requests (tool_prompt=refuse)",
                               "unsupported_tools", "tools")
        return self._apply(hermes_messages(messages, tools), None, add_generation_prompt)

    def encode(self, text: str) -> list[int]:
        return self.chat.encode(text)

    def _apply(self, messages: list[dict[str, Any]], tools: list[dict] | None, add_generation_prompt: bool) -> str:
        try:
            return self.chat.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                           add_generation_prompt=add_generation_prompt)
        except Exception as error:  # noqa: BLE001 - a template's own errors (jinja's, raise_exception, a None)
            raise RequestError(400, f"the model's chat template cannot render this request: {type(error).__name__}: "
                                    f"{error}"[:500], "template_error", "messages") from None

    def _template_renders_tools(self) -> bool:
        try:
            text = self.chat.tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tools=[_PROBE_TOOL],
                                                           tokenize=False, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - a template that fails on tools does not render them
            return False
        return _PROBE_TOOL["function"]["name"] in text


def hermes_messages(messages: Sequence[ChatMessage], tools: Sequence[dict]) -> list[dict[str, Any]]:
    """Plain messages that carry the tools in the hermes convention, for a template that cannot render tools:
    the tools' description in the system message (one is added at the start when there is none), tool calls as
    ``<tool_call>`` blocks after the assistant's content, each run of tool results as one user turn of
    ``<tool_response>`` blocks."""
    out: list[dict[str, Any]] = []
    if tools:
        described = hermes_tools_text(list(tools))
        if messages and messages[0].role == "system":
            first, rest = messages[0], messages[1:]
            out.append({"role": "system", "content": f"{first.content}\n\n{described}" if first.content else described})
        else:
            rest = messages
            out.append({"role": "system", "content": described})
    else:
        rest = messages
    for m in rest:
        if m.role == "tool":
            block = hermes_response_text(m.content)
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "tool_results": True})
        elif m.tool_calls:
            calls = "\n".join(hermes_call_text(c.name, c.arguments) for c in m.tool_calls)
            out.append({"role": "assistant", "content": f"{m.content}\n{calls}" if m.content else calls})
        else:
            out.append({"role": m.role, "content": m.content})
    for message in out:
        message.pop("tool_results", None)
    return out
