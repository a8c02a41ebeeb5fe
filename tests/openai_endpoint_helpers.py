"""What the OpenAI endpoint's tests share: a chat template that renders tools (written here in the hermes
convention Qwen2.5 uses, so that the native-tools path is tested without a hub model), a scripted generator,
and an endpoint served on a free port in the test's event loop."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from helpers import AddressPrintingProcess

# Tools in the system turn, tool calls as <tool_call> blocks after the assistant's content, each run of tool
# results as one user turn of <tool_response> blocks. Like some real templates it refuses what it cannot render
# (raise_exception): here a tool whose parameters are not an object schema.
HERMES_TOOLS_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}"
    "{%- for tool in tools %}"
    "{%- if tool.function.parameters is defined and tool.function.parameters.type is defined"
    " and tool.function.parameters.type != 'object' %}"
    "{{- raise_exception('tool ' + tool.function.name + ': parameters must be an object schema') }}"
    "{%- endif %}"
    "{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\nCall one as <tool_call>\\n{\"name\": <name>, \"arguments\": <object>}\\n</tool_call>"
    "<|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + (message.content or '') }}"
    "{%- for call in (message.tool_calls or []) %}"
    "{%- if message.content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + call.function.name + '\", \"arguments\": ' + (call.function.arguments | tojson)"
    " + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass
class Generation:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    version_spans: list[tuple[int, int, int]] = field(default_factory=list)


class ScriptedGenerator:
    """Answers each prompt with the next scripted reply: given as text (tokenized + end of turn) or as ids."""

    def __init__(self, chat, replies, version: int = 0) -> None:
        self.chat, self.replies, self.version = chat, list(replies), version
        self.prompts: list[list[int]] = []
        self.sampled: list[tuple[float, float, int]] = []  # (temperature, top_p, max_tokens) per request

    async def generate(self, prompt_ids, *, max_tokens, temperature, top_p, stop_token_ids):
        self.prompts.append(list(prompt_ids))
        self.sampled.append((temperature, top_p, max_tokens))
        reply = self.replies.pop(0) if self.replies else "Action: wait"
        ids = list(reply) if isinstance(reply, list) else self.chat.encode(reply) + [self.chat.end_of_turn_id]
        ids = ids[:max_tokens]
        logprobs = [-0.25 - 0.01 * i for i in range(len(ids))]
        finish = "stop" if ids[-1] in stop_token_ids else "length"
        return Generation(ids, logprobs, finish, [(len(ids), 0, self.version)])


_LISTENING = re.compile(r"serving the OpenAI endpoint on (http://127\.0\.0\.1:\d+)")


class EndpointProcess(AddressPrintingProcess):
    """``horizonrl endpoint`` in its own process on a free port it binds itself (its address read from stderr);
    ended by its pid with SIGINT."""

    def __init__(self, model_dir: Path, out_dir: Path, *extra: str, key: str | None = None,
                 timeout_s: float = 180.0) -> None:
        args = [sys.executable, "-m", "horizonrl", "endpoint", "--model", str(model_dir),
                "--port", "0", "--out", str(out_dir), *extra]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
        if key:
            env["HORIZONRL_ENDPOINT_KEY"] = key
        try:
            self.url = self._start(args, env, _LISTENING, "the endpoint", timeout_s)
        except BaseException:
            self.stop()
            raise

    def health(self) -> dict:
        import urllib.request

        with urllib.request.urlopen(self.url + "/health", timeout=10) as response:
            return json.loads(response.read())

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        return self.proc.returncode
