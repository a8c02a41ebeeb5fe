"""The real ``openai`` client against ``horizonrl endpoint`` in front of a live vLLM-CPU engine (one engine for the
module): a tool session recorded token for token (checked against the engine's answers and against transformers'
log-probabilities of the recorded sequence), a history-rewriting agent whose episode branches, 50 concurrent
sessions none mixed up, and bad input answered with 4xx while the server stays up.

The tiny model writes ReAct replies, not tool calls: its replies here are plain content, and the tools reach it
through its chat template (tools in the system turn, a tool call and its result in the history). The tool-call
round trip itself (parsed, answered, sent back, appended) is tested with scripted replies in
``tests/test_openai_endpoint_http.py``.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import urllib.error
import urllib.request

import openai
import pytest

from horizonrl.core.outbox import read_outbox
from horizonrl.protocol.arrays import LOGPROB_DTYPE, MASK_DTYPE, TOKEN_DTYPE, unpack
from openai_endpoint_helpers import HERMES_TOOLS_TEMPLATE, EndpointProcess

pytestmark = pytest.mark.slow

KEY = "live-test-key"
TEMPERATURE = 0.8
# Float32 on both sides: the engine's logprobs of a token and transformers' agree to ~1e-6 (DESIGN.md); one token
# of another context moves them by far more.
LOGPROB_BOUND = 2e-3
TOOLS = [{"type": "function", "function": {"name": "act", "description": "take one step",
                                           "parameters": {"type": "object",
                                                          "properties": {"action": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def endpoint_model(tiny_model, tmp_path_factory):
    model = tmp_path_factory.mktemp("endpoint") / "model"
    shutil.copytree(tiny_model, model)
    (model / "chat_template.jinja").write_text(HERMES_TOOLS_TEMPLATE)
    return model


@pytest.fixture(scope="module")
def live(endpoint_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("endpoint-out")
    proc = EndpointProcess(endpoint_model, out, "--max-context-tokens", "1024", "--max-tokens", "24", key=KEY)
    proc.out = out
    yield proc
    assert proc.stop() == 0, "".join(proc.log)[-3000:]


def post(url: str, body: object = None, raw: bytes | None = None, key: str | None = KEY) -> tuple[int, dict]:
    data = raw if raw is not None else json.dumps(body or {}).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers), timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def open_session(live) -> tuple[str, openai.AsyncOpenAI]:
    status, answer = post(f"{live.url}/v1/sessions")
    assert status == 200, answer
    return answer["id"], openai.AsyncOpenAI(base_url=answer["base_url"], api_key=KEY, max_retries=0)


def trajectories(live) -> dict:
    return {t.trajectory_id: t for segment in read_outbox(live.out) for _, t in segment.unacked}


def arrays(t):
    return (unpack(t.token_ids, TOKEN_DTYPE).tolist(), unpack(t.loss_mask, MASK_DTYPE).tolist(),
            unpack(t.logprobs, LOGPROB_DTYPE).tolist())


def transformers_logprobs(model_dir, ids: list[int], spans, temperature: float) -> list[list[float]]:
    """The learner's log-probabilities (learner/policy_loss.py's function) of each span's tokens in ``ids``."""
    import torch
    from transformers import AutoModelForCausalLM

    from horizonrl.learner.policy_loss import token_logprobs

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    return [token_logprobs(logits[s - 1:e - 1], torch.tensor(ids[s:e]), temperature).tolist() for s, e in spans]


async def call(client, messages, **extra):
    return await client.chat.completions.create(model="tiny", messages=messages, temperature=TEMPERATURE,
                                                logprobs=True, extra_body={"return_token_ids": True}, **extra)


async def test_a_tool_session_is_recorded_token_for_token(live, endpoint_model):
    sid, client = open_session(live)
    messages = [{"role": "system", "content": "Follow the signs to the exit."},
                {"role": "user", "content": "Follow the signs to the exit. Actions: go left, go right, go straight."},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_0", "type": "function", "function": {"name": "act",
                                                                      "arguments": "{\"action\": \"go left\"}"}}]},
                {"role": "tool", "tool_call_id": "call_0", "content": "A sign points straight."}]
    calls = []
    for turn in range(4):
        answer = await call(client, messages, tools=TOOLS, stream=False)
        choice = answer.choices[0]
        calls.append((answer.model_extra["prompt_token_ids"], choice.model_extra["token_ids"],
                      [p.logprob for p in choice.logprobs.content]))
        messages.append(choice.message)
        for tool_call in choice.message.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": tool_call.id, "content": "A sign points left."})
        if not choice.message.tool_calls:
            messages.append({"role": "user", "content": f"A sign points {['left', 'right', 'straight'][turn % 3]}."})
    status, summary = post(f"{live.url}/sessions/{sid}/close")
    assert status == 200 and summary["turns"] == 4 and summary["samples"] == 1
    t = trajectories(live)[sid]
    ids, mask, logprobs = arrays(t)
    assert not t.sample_starts and t.num_turns == 4 and t.prompt_length == len(calls[0][0])
    for (prompt, generated, returned_logprobs), (start, end) in zip(calls, t.turn_spans):
        assert ids[:start] == prompt  # what the engine was prompted with, token for token
        assert ids[start:end] == generated and mask[start:end] == [1] * len(generated)
        assert logprobs[start:end] == pytest.approx(returned_logprobs, abs=1e-6)
    assert ids[t.turn_spans[-1][1]:] == []  # the episode ends with the last reply
    learner = transformers_logprobs(endpoint_model, ids, t.turn_spans, TEMPERATURE)
    worst = max(abs(a - b) for (s, e), ours in zip(t.turn_spans, learner) for a, b in zip(ours, logprobs[s:e]))
    assert worst < LOGPROB_BOUND, worst


async def test_an_agent_that_rewrites_its_history_branches_the_episode(live, endpoint_model):
    sid, client = open_session(live)
    messages = [{"role": "user", "content": "Follow the signs to the exit. A sign points left."}]
    first = await call(client, messages)
    messages += [first.choices[0].message, {"role": "user", "content": "A sign points right."}]
    stream = await client.chat.completions.create(model="tiny", messages=messages, stream=True,
                                                  temperature=TEMPERATURE)  # one streamed call: the reply in chunks
    text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "A sign points right."}]
    # The agent keeps a summary instead of its history: the next prompt does not extend what was generated.
    summary = [{"role": "user", "content": "So far: two signs followed. A sign points straight."}]
    third = await call(client, summary)
    post(f"{live.url}/sessions/{sid}/close")
    t = trajectories(live)[sid]
    ids, mask, logprobs = arrays(t)
    assert t.num_turns == 3 and len(t.sample_starts) == 1  # the streamed reply came back as sent: appended
    start, prompt = t.sample_starts[0], third.model_extra["prompt_token_ids"]
    assert ids[:len(first.model_extra["prompt_token_ids"])] == first.model_extra["prompt_token_ids"]
    assert ids[start:start + len(prompt)] == prompt and mask[start:start + len(prompt)] == [0] * len(prompt)
    assert ids[start + len(prompt):] == third.choices[0].model_extra["token_ids"]
    spans = [(s, e) for s, e in t.turn_spans]
    learner = transformers_logprobs(endpoint_model, ids[:start], spans[:2], TEMPERATURE)
    learner += transformers_logprobs(endpoint_model, ids[start:], [(s - start, e - start) for s, e in spans[2:]],
                                     TEMPERATURE)
    worst = max(abs(a - b) for ours, (s, e) in zip(learner, spans) for a, b in zip(ours, logprobs[s:e]))
    assert worst < LOGPROB_BOUND, worst


async def test_fifty_concurrent_sessions_none_mixed_up(live, endpoint_model):
    sessions = [open_session(live) for _ in range(50)]

    async def play(k: int, client) -> list[tuple[list[int], list[int]]]:
        messages = [{"role": "user", "content": f"You are agent {k:02d}. Follow the signs."}]
        seen = []
        for turn in range(3):
            answer = await call(client, messages, max_tokens=12)
            seen.append((answer.model_extra["prompt_token_ids"], answer.choices[0].model_extra["token_ids"]))
            messages += [answer.choices[0].message, {"role": "user", "content": f"Agent {k:02d}, turn {turn}."}]
        return seen

    played = await asyncio.gather(*(play(k, client) for k, (_, client) in enumerate(sessions)))
    for sid, _ in sessions:
        assert post(f"{live.url}/sessions/{sid}/close")[0] == 200
    recorded = trajectories(live)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(endpoint_model)
    for k, ((sid, _), seen) in enumerate(zip(sessions, played)):
        ids, _, _ = arrays(recorded[sid])
        assert [ids[s:e] for s, e in recorded[sid].turn_spans] == [generated for _, generated in seen]
        assert ids[:len(seen[-1][0])] == seen[-1][0]
        text = tokenizer.decode(ids)
        others = {f"agent {j:02d}" for j in range(50)} - {f"agent {k:02d}"}
        assert text.lower().count(f"agent {k:02d}") == 3 and not any(o in text.lower() for o in others)


def test_bad_input_gets_a_4xx_and_the_server_stays_up(live):
    sid, _ = open_session(live)
    chat = f"{live.url}/sessions/{sid}/v1/chat/completions"
    good = {"model": "tiny", "messages": [{"role": "user", "content": "Follow the signs."}], "max_tokens": 8}
    cases = [
        (post(chat, raw=b'{"model": "tiny", "messages": ['), 400, "invalid_json"),
        (post(f"{live.url}/sessions/nosuch/v1/chat/completions", good), 404, "unknown_session"),
        (post(chat, raw=b" " * (5 << 20)), 413, "request_too_large"),
        (post(chat, {**good, "tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "string"}}}]}), 400, "template_error"),
        (post(chat, {**good, "messages": [{"role": "user", "content": "sign " * 2000}]}), 400,
         "context_length_exceeded"),
        (post(chat, good, key=None), 401, "invalid_api_key"),
        (post(chat, good, key="wrong"), 401, "invalid_api_key"),
    ]
    for (status, answer), expected_status, code in cases:
        assert (status, answer["error"]["code"]) == (expected_status, code), answer
        assert answer["error"]["message"]
    status, answer = post(chat, good)
    assert status == 200 and answer["choices"][0]["message"]["role"] == "assistant"  # still serving
    assert live.health()["status"] == "ok"
