"""``HTTPEnv(protocol="agentgym")`` against servers that answer as AgentGym's own do.

The fake servers below reproduce, from reading agentenv-babyai / -textcraft / -sciworld /
-searchqa's server code, the bodies those servers accept (a body that lacks a field they require
gets FastAPI's 422) and the answers they give: no ``success`` field, every failure as HTTP 200
with ``{"error": ...}``, SciWorld's task description apart and its reward in points, SearchQA's
bare id and bare observation strings, session key ``env_idx``, WebArena's ``env_idx``, ``idx`` and
``terminated``. BabyAI, TextCraft and SearchQA
play the real environments behind those shapes (the server applies the bare action it receives);
SciWorld and WebArena are scripted tasks so that no JVM or browser is needed. Each server records what it was
sent, so the tests check the client's requests as well as the outcome.
"""

from __future__ import annotations

import pytest
from aiohttp import web

from horizonrl.envs.babyai import BOT_UNSUPPORTED_LEVELS
from horizonrl.envs.base import EnvironmentFailure
from horizonrl.envs.client import HTTPEnv
from horizonrl.envs.registry import make_env


class FakeAgentGymServer:
    """One AgentGym environment server: ``name`` picks the shapes."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.envs: dict[int, object] = {}
        self.requests: list[tuple[str, object]] = []

    def app(self) -> web.Application:
        app = web.Application()
        for path in ("create", "reset", "step", "close"):
            app.router.add_post(f"/{path}", getattr(self, path))
        return app

    async def _body(self, request: web.Request, *required: str) -> dict | None:
        body = await request.json() if request.can_read_body else None
        self.requests.append((request.path, body))
        if required and (not isinstance(body, dict) or any(k not in body for k in required)):
            raise web.HTTPUnprocessableEntity(text="field required")  # FastAPI's answer to a bad body
        return body

    @property
    def key(self) -> str:
        return "env_idx" if self.name in ("searchqa", "webarena") else "id"

    async def create(self, request: web.Request) -> web.Response:
        await self._body(request, *(("id",) if self.name == "searchqa" else ()))
        new_id = len(self.envs)
        self.envs[new_id] = None if self.name in ("sciworld", "webarena") else make_env(self.name)
        if self.name == "searchqa":
            return web.json_response(new_id)
        if self.name == "webarena":
            return web.json_response({"env_idx": new_id})
        if self.name == "textcraft":  # its create starts task `id` and answers the observation
            observation = await self.envs[new_id].reset(new_id)
            return web.json_response({"id": new_id, "observation": observation, "done": False, "reward": 0})
        return web.json_response({"id": new_id})

    async def reset(self, request: web.Request) -> web.Response:
        if self.name == "searchqa":
            body = await self._body(request, "env_idx")
            env = self.envs.get(body["env_idx"])
            return web.json_response(await env.reset(body["id"]))
        if self.name == "webarena":  # its server reads seed and idx (a KeyError, HTTP 500, without them)
            body = await self._body(request, "env_idx", "seed", "idx")
            self.envs[body["env_idx"]] = body["idx"]
            return web.json_response({"observation": f"OBSERVATION: task {body['idx']}"})
        body = await self._body(request, "id", "data_idx")
        if body["id"] not in self.envs:
            return web.json_response({"error": f"The id {body['id']} is not valid."})
        if self.name == "sciworld":
            self.envs[body["id"]] = 0  # points scored so far
            return web.json_response({"task_name": "boil", "var_num": 0, "task_description": "Your task is to boil water.",
                                      "observation": "This room is called the kitchen.", "reward": 0, "score": 0,
                                      "deleted": False, "done": False})
        observation = await self.envs[body["id"]].reset(body["data_idx"])
        return web.json_response({"observation": observation, "reward": 0, "score": 0, "deleted": False, "done": False})

    async def step(self, request: web.Request) -> web.Response:
        body = await self._body(request, self.key, "action")
        if body[self.key] not in self.envs:
            return web.json_response({"error": f"The id {body[self.key]} is not valid."})
        if self.name == "sciworld":
            gained = {"open door to kitchen": 50, "boil water": 50}.get(body["action"], 0)
            self.envs[body["id"]] += gained
            score = self.envs[body["id"]]
            return web.json_response({"observation": f"You did {body['action']}.", "reward": gained, "score": score,
                                      "done": score >= 100})
        if self.name == "webarena":  # a scripted task: the reply that stops with the right answer wins
            won = "```stop [42]```" in body["action"]
            return web.json_response({"observation": "PREVIOUS ACTION: " + body["action"], "reward": float(won),
                                      "terminated": "```stop" in body["action"], "truncated": False, "info": {}})
        env = self.envs[body[self.key]]
        reply = body["action"] if self.name == "searchqa" else f"Action: {body['action']}"
        result = await env.step(reply)
        if self.name == "searchqa":
            return web.json_response({"observation": result.observation, "reward": result.reward,
                                      "done": result.done, "info": None})
        answer = {"observation": result.observation, "reward": result.reward, "done": result.done}
        if self.name == "babyai":
            answer["score"] = result.score
        return web.json_response(answer)

    async def close(self, request: web.Request) -> web.Response:
        body = await self._body(request, self.key)
        self.envs.pop(body[self.key], None)
        return web.Response(text="closed") if self.name == "webarena" else web.json_response(True)

    def sent(self, path: str) -> list[object]:
        return [body for p, body in self.requests if p == path]


@pytest.fixture
async def fake():
    runners = []

    async def start(name: str) -> tuple[FakeAgentGymServer, str]:
        server = FakeAgentGymServer(name)
        runner = web.AppRunner(server.app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        return server, f"http://127.0.0.1:{runner.addresses[0][1]}"

    yield start
    for runner in runners:
        await runner.cleanup()


async def test_babyai_bare_actions_and_a_success_without_a_success_field(fake):
    server, url = await fake("babyai")
    twin = make_env("babyai")
    task_id = next(i for i in twin.task_ids("test") if twin.task_category(i) not in BOT_UNSUPPORTED_LEVELS)
    env = HTTPEnv(url, env="babyai", protocol="agentgym", retry_for_s=5)
    assert await env.reset(task_id) == await twin.reset(task_id)
    bot, result = None, None
    for _ in range(100):
        reply, bot = twin.expert_action(bot)
        result = await env.step(f"Thought:\nthe bot's move\n\nAction:\n{reply.removeprefix('Action: ')}")
        await twin.step(reply)
        if result.done:
            break
    assert result.done and result.success and result.reward > 0
    assert server.sent("/create") == [None]  # AgentGym's BabyAI client posts no body
    actions = [b["action"] for b in server.sent("/step")]
    assert actions and all("Action" not in a and "Thought" not in a and a == a.strip() for a in actions)
    await env.close()
    assert server.sent("/close") == [{"id": 0}]


async def test_textcraft_actions_as_its_client_cleans_them(fake):
    server, url = await fake("textcraft")
    twin = make_env("textcraft")
    env = HTTPEnv(url, env="textcraft", protocol="agentgym", retry_for_s=5)
    task_id = twin.task_ids("test")[1]
    await twin.reset(task_id)
    assert await env.reset(task_id) == await twin.reset(task_id)
    result = await env.step("Thought: first, what do I hold?\nAction: look.")
    assert result.observation.startswith("Inventory:")  # "look." -> "look" -> "inventory"
    for reply in twin.expert_plan():
        result = await env.step(reply + ".")  # a trailing full stop is stripped by the client
    assert result.done and result.success and result.reward == 1.0
    assert set(server.sent("/create")[0]) == {"minecraft_dir", "commands", "goal"}
    assert all(a == " ".join(a.split()) and "." not in a for a in (b["action"] for b in server.sent("/step")))
    await env.close()


async def test_sciworld_task_description_and_points(fake):
    server, url = await fake("sciworld")
    env = HTTPEnv(url, env="sciworld", protocol="agentgym", retry_for_s=5)
    assert await env.reset(7) == "Your task is to boil water.\nThis room is called the kitchen."
    assert server.sent("/reset") == [{"id": 0, "data_idx": 7}]
    first = await env.step("Thought:\nopen it\n\nAction:\nopen door to kitchen")
    assert (first.reward, first.score, first.done, first.success) == (0.5, 50.0, False, False)
    last = await env.step("Action: boil water")
    assert (last.reward, last.score, last.done, last.success) == (0.5, 100.0, True, True)
    await env.close()


async def test_searchqa_env_idx_bare_answers_and_whole_replies(fake):
    server, url = await fake("searchqa")
    twin = make_env("searchqa")
    env = HTTPEnv(url, env="searchqa", protocol="agentgym", retry_for_s=5)
    task_id = twin.task_ids("test")[0]
    assert await env.reset(task_id) == await twin.reset(task_id)
    plan = twin.expert_plan()
    for reply in plan:
        result = await env.step(reply)
    assert result.done and result.success and result.reward == 1.0
    assert server.sent("/create") == [{"id": 0}]
    assert server.sent("/reset") == [{"env_idx": 0, "id": task_id}]
    assert [b["action"] for b in server.sent("/step")] == plan  # the whole reply, as AgentGym's client sends
    await env.close()
    assert server.sent("/close") == [{"env_idx": 0}]


async def test_webarena_env_idx_idx_seed_and_terminated(fake):
    server, url = await fake("webarena")
    env = HTTPEnv(url, env="webarena", protocol="agentgym", retry_for_s=5)
    assert await env.reset(5) == "OBSERVATION: task 5"
    assert server.sent("/create") == [None]
    assert server.sent("/reset") == [{"env_idx": 0, "idx": 5, "seed": 0}]
    first = await env.step("In summary, the next action I will perform is ```click [3]```")
    assert not first.done and first.observation.endswith("```click [3]```")  # the whole reply was sent
    last = await env.step("In summary, the next action I will perform is ```stop [42]```")
    assert (last.done, last.success, last.reward) == (True, True, 1.0)  # done read from `terminated`
    await env.close()
    assert server.sent("/close") == [{"env_idx": 0}]


async def test_errors_with_status_200_are_environment_failures(fake):
    server, url = await fake("babyai")
    env = HTTPEnv(url, env="babyai", protocol="agentgym", retry_for_s=5)
    await env.reset(0)
    server.envs.clear()  # the server lost the session (e.g. it restarted)
    with pytest.raises(EnvironmentFailure, match="is not valid"):
        await env.step("Action: turn left")
    with pytest.raises(EnvironmentFailure, match="no task ids"):
        env.task_ids("train")
    await env.close()
