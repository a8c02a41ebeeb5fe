"""The endpoint over HTTP with the real ``openai`` client (``AsyncOpenAI``), a scripted generator in place of the
engine: the API's shapes (tool calls, n, stream, logprobs, token ids, models), sessions named by base URL or
header, rewards, environments bound to a session, keys, and bad input answered with 4xx while the server stays up.
"""

from __future__ import annotations

import copy
import json

import aiohttp
import openai
import pytest
from aiohttp import web

from horizonrl.actors.openai_endpoint.endpoint import AgentEndpoint, EndpointSettings
from horizonrl.actors.openai_endpoint.http_app import SESSION_HEADER, EndpointApp, check_binding
from horizonrl.apps.tiny_model import build_tokenizer
from horizonrl.core.chat import ChatTokenizer
from horizonrl.envs.registry import make_env
from openai_endpoint_helpers import HERMES_TOOLS_TEMPLATE, ScriptedGenerator

TOOLS = [{"type": "function", "function": {"name": "act", "description": "act in the world",
                                           "parameters": {"type": "object", "properties": {"action": {"type": "string"}}}}}]
CALL = '<tool_call>\n{"name": "act", "arguments": {"action": "go left"}}\n</tool_call>'
KEY = "test-key-123"


@pytest.fixture(scope="module")
def chat():
    tokenizer = build_tokenizer(["Follow the signs.", "Action: go left", "<tool_call>", "arguments"] * 20, 400)
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = HERMES_TOOLS_TEMPLATE
    return ChatTokenizer(tokenizer)


class Served:
    def __init__(self, http: EndpointApp, runner: web.AppRunner, generator: ScriptedGenerator, finished: list):
        self.http, self.runner, self.generator, self.finished = http, runner, generator, finished
        self.url = http.public_url

    def client(self, session_id: str | None = None, key: str = KEY, header: bool = False) -> openai.AsyncOpenAI:
        if header:
            return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0,
                                      default_headers={SESSION_HEADER: session_id})
        return openai.AsyncOpenAI(base_url=self.http.base_url(session_id) if session_id else f"{self.url}/v1",
                                  api_key=key, max_retries=0)

    async def post(self, path: str, body=None, raw: bytes | None = None, key: str | None = KEY):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with aiohttp.ClientSession() as http:
            async with http.post(self.url + path, data=raw if raw is not None else json.dumps(body or {}),
                                 headers=headers) as response:
                return response.status, await response.json()


@pytest.fixture
async def served(chat):
    generator = ScriptedGenerator(chat, [])
    finished = []

    async def on_finished(session, episode):
        finished.append((session, episode))

    async def open_env(name, task_id):
        env = make_env(name)
        return env, await env.reset(task_id)

    endpoint = AgentEndpoint(generator, chat, EndpointSettings(model_name="tiny-model", max_context_tokens=1024),
                             on_finished=on_finished)
    http = EndpointApp(endpoint, api_key=KEY, max_body_bytes=64 * 1024, open_sessions=True, make_env=open_env)
    runner = web.AppRunner(http.app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    http.public_url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    yield Served(http, runner, generator, finished)
    await runner.cleanup()


async def open_session(served: Served, **body) -> dict:
    status, answer = await served.post("/v1/sessions", body)
    assert status == 200, answer
    return answer


async def test_a_tool_session_through_the_openai_client(served):
    served.generator.replies = ["I go.\n" + CALL, "Action: done"]
    session = await open_session(served)
    client = served.client(session["id"])
    assert [m.id for m in (await client.models.list()).data] == ["tiny-model"]
    messages = [{"role": "user", "content": "Follow the signs."}]
    first = await client.chat.completions.create(model="anything", messages=messages, tools=TOOLS, logprobs=True,
                                                 extra_body={"return_token_ids": True})
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "I go."
    call = choice.message.tool_calls[0]
    assert call.function.name == "act" and json.loads(call.function.arguments) == {"action": "go left"}
    assert first.model == "tiny-model" and first.system_fingerprint == "horizonrl-e0-v0"
    assert [round(p.logprob, 6) for p in choice.logprobs.content][:2] == [-0.25, -0.26]  # the engine's, as sampled
    assert len(choice.logprobs.content) == len(choice.model_extra["token_ids"]) == first.usage.completion_tokens
    assert first.model_extra["prompt_token_ids"] == served.generator.prompts[0]
    messages += [choice.message, {"role": "tool", "tool_call_id": call.id, "content": "A sign points left."}]
    second = await client.chat.completions.create(model="anything", messages=messages, tools=TOOLS)
    assert second.choices[0].message.content == "Action: done" and second.choices[0].finish_reason == "stop"
    held = served.generator.prompts[0] + choice.model_extra["token_ids"]
    assert served.generator.prompts[1][:len(held)] == held  # appended: the message object came back as sent
    status, reward = await served.post(f"/sessions/{session['id']}/reward", {"reward": 1.0})
    assert status == 200
    status, summary = await served.post(f"/sessions/{session['id']}/close")
    assert status == 200 and summary["turns"] == 2 and summary["reward"] == 1.0 and summary["samples"] == 1
    (_, episode), = served.finished
    assert episode.turn_rewards == [0.0, 1.0] and episode.success


async def test_the_session_header_n_choices_and_streaming(served):
    served.generator.replies = ["Action: a", "Action: b", "Action: c"]
    session = await open_session(served)
    client = served.client(session["id"], header=True)
    several = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Go."}], n=2)
    assert [c.message.content for c in several.choices] == ["Action: a", "Action: b"]
    stream = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Go."}],
                                                  stream=True)
    text, finish = "", None
    async for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert text == "Action: c" and finish == "stop"
    status, summary = await served.post(f"/sessions/{session['id']}/close", {"reward": 0.5, "success": False})
    assert status == 200 and summary["reward"] == 0.5 and summary["success"] is False  # the reward in the close
    (_, episode), = served.finished
    assert episode.num_turns == 2 and len(episode.sample_starts) == 1  # the second call re-sent the first prompt


async def test_a_session_with_a_project_environment_takes_its_rewards_from_it(served):
    session = await open_session(served, env="signpost", task_id=0)
    assert session["observation"].startswith("Follow the signs")
    client = served.client(session["id"])
    messages = [{"role": "user", "content": session["observation"]}]
    status, step = 0, {"done": False, "observation": session["observation"]}
    for _ in range(10):
        sign = step["observation"].rsplit("A sign points ", 1)[1].rstrip(".")
        served.generator.replies = [f"Action: go {sign}"]  # a model that reads the signs
        reply = await client.chat.completions.create(model="m", messages=messages)
        status, step = await served.post(f"/sessions/{session['id']}/env/step",
                                         {"action": reply.choices[0].message.content})
        assert status == 200
        if step["done"]:
            break
        messages += [reply.choices[0].message, {"role": "user", "content": step["observation"]}]
    assert step["done"]
    status, refused = await served.post(f"/sessions/{session['id']}/reward", {"reward": 5.0})
    assert status == 409  # the environment verifies this episode, not the agent
    with pytest.raises(openai.BadRequestError, match="episode_over|episode is over"):
        await client.chat.completions.create(model="m", messages=messages)
    await served.post(f"/sessions/{session['id']}/close")
    (_, episode), = served.finished
    assert episode.stop_reason == "done" and episode.success and episode.turn_rewards == [0.25] * 4  # one per sign


async def test_bad_input_gets_a_4xx_and_the_server_stays_up(served):
    session = await open_session(served)
    sid = session["id"]
    status, answer = await served.post(f"/sessions/{sid}/v1/chat/completions", raw=b"{not json")
    assert status == 400 and answer["error"]["code"] == "invalid_json"
    status, answer = await served.post(f"/sessions/{sid}/v1/chat/completions", raw=b"x" * (65 * 1024))
    assert status == 413 and "bytes" in answer["error"]["message"]
    status, answer = await served.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
    assert status == 400 and answer["error"]["code"] == "missing_session"
    with pytest.raises(openai.NotFoundError, match="no open session"):
        await served.client("nosuchsession").chat.completions.create(model="m", messages=[{"role": "user",
                                                                                           "content": "x"}])
    with pytest.raises(openai.AuthenticationError):
        await served.client(sid, key="wrong").chat.completions.create(model="m", messages=[{"role": "user",
                                                                                            "content": "x"}])
    status, _ = await served.post(f"/sessions/{sid}/close", key=None)
    assert status == 401
    status, answer = await served.post(f"/sessions/{sid}/reward", {"reward": "much"})
    assert status == 400 and "reward" in answer["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="tools"):
        await served.client(sid).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                                         tools=[{"type": "function", "function": {"name": ""}}])
    served.generator.replies = ["Action: fine"]
    ok = await served.client(sid).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert ok.choices[0].message.content == "Action: fine"  # still serving, the session unharmed
    async with aiohttp.ClientSession() as http:
        async with http.get(served.url + "/health") as response:
            health = await response.json()
    assert response.status == 200 and health["stats"]["refused_calls"] == 0 and health["stats"]["calls"] == 1


def test_a_key_is_required_off_loopback():
    check_binding("127.0.0.1", None)
    check_binding("::1", None)
    check_binding("0.0.0.0", "key")
    with pytest.raises(ValueError, match="not loopback"):
        check_binding("0.0.0.0", None)


async def test_in_training_only_the_trainer_opens_sessions(served):
    served.http.open_sessions = False  # as the actor serves it
    status, answer = await served.post("/v1/sessions", {})
    assert status == 403 and answer["error"]["code"] == "sessions_closed_to_clients"
