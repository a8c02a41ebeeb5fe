"""AgentGym's own environment clients against ``horizonrl env serve``, request by request.

The replay clients below send exactly what agentenv's ``BabyAIEnvClient``, ``SciworldEnvClient``,
``TextCraftEnvClient`` and ``SearchQAEnvClient`` send (paths, bodies, the way each cuts the bare
action out of the model's reply) and read exactly the fields they read, asserting HTTP 200 as they
do. They are written here from reading those clients, independently of ``envs/agentgym_api.py``,
so that a mistake there shows up as a failure here. One server process hosts all four
environments; each client uses its environment's base URL ``http://HOST:PORT/<env>``.
"""

from __future__ import annotations

import json
import re
import urllib.request

import pytest

from env_server_proc import ServerProcess
from horizonrl.envs.babyai import BOT_UNSUPPORTED_LEVELS
from horizonrl.envs.registry import make_env

pytestmark = pytest.mark.system  # Java 17 (the fleet serves SciWorld)


def http(method: str, url: str, body: object = ...) -> tuple[int, object]:
    data = None if body is ... else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def ok(method: str, url: str, body: object = ...) -> object:
    status, answer = http(method, url, body)
    assert status == 200, (url, body, answer)  # the clients' `assert res.status_code == 200`
    return answer


class BabyAIClient:
    """agentenv's BabyAIEnvClient: empty create; reads id; bare action; reward is ``score``."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.env_id = ok("POST", f"{base}/create")["id"]

    def _post(self, path: str, data: dict) -> dict:
        data["id"] = self.env_id
        return ok("POST", f"{self.base}/{path}", data)

    def cut_action(self, reply: str) -> str:
        if reply.endswith("</s>"):
            reply = reply[:-5]
        parts = reply.split("Action:")
        return parts[1].strip() if len(parts) > 1 else parts[0].strip()

    def reset(self, data_idx: int) -> str:
        r = self._post("reset", {"data_idx": data_idx})
        self.info = {"observation": r["observation"], "reward": r["reward"], "score": r["score"], "done": r["done"]}
        return self.info["observation"]

    def step(self, reply: str) -> tuple[str, float, bool]:
        r = self._post("step", {"action": self.cut_action(reply)})
        self.info = {"observation": r["observation"], "reward": r["reward"], "score": r["score"], "done": r["done"]}
        return r["observation"], r["score"], r["done"]


class SciWorldClient(BabyAIClient):
    """agentenv's SciworldEnvClient: as BabyAI's, but reset shows task_description + observation."""

    def reset(self, data_idx: int) -> str:
        r = self._post("reset", {"data_idx": data_idx})
        return r["task_description"] + "\n" + r["observation"]


class TextCraftClient:
    """agentenv's TextCraftEnvClient: create posts the recipe dir and reads an observation;
    the action is the rest of the ``Action:`` line with all but letters, digits, commas and
    spaces removed; ``close`` posts the id."""

    def __init__(self, base: str) -> None:
        self.base = base
        r = ok("POST", f"{base}/create", {"minecraft_dir": "agentenv_textcraft/", "commands": None, "goal": None})
        self.env_id = r["id"]
        self.info = {"observation": r["observation"], "reward": 0, "done": False}

    def _post(self, path: str, data: dict) -> dict:
        data["id"] = self.env_id
        return ok("POST", f"{self.base}/{path}", data)

    def cut_action(self, reply: str) -> str:
        matches = re.findall(r"Action:\s*(.*?)(?=\n|$)", reply, re.DOTALL)
        action = re.sub(r"[^A-Za-z0-9, ]+", "", matches[-1] if matches else "")
        action = " ".join(action.split()).strip()
        return "inventory" if action.lower() == "look" else action

    def reset(self, idx: int) -> str:
        return self._post("reset", {"data_idx": idx})["observation"]

    def step(self, reply: str) -> tuple[str, float, bool]:
        r = self._post("step", {"action": self.cut_action(reply)})
        return r["observation"], r["reward"], r["done"]

    def close(self) -> object:
        return self._post("close", {})


class SearchQAClient:
    """agentenv's SearchQAEnvClient: create posts {"id": 0} and takes the whole answer as the
    session id, which it sends as ``env_idx``; reset sends the task as ``id``; the whole reply is
    the action; observation is a GET with ``env_idx``."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.env_id = ok("POST", f"{base}/create", {"id": 0})

    def _post(self, path: str, data: dict) -> object:
        data["env_idx"] = self.env_id
        return ok("POST", f"{self.base}/{path}", data)

    def observe(self) -> object:
        return ok("GET", f"{self.base}/observation?env_idx={self.env_id}")

    def reset(self, id: int) -> object:
        return self._post("reset", {"id": id})

    def step(self, reply: str) -> tuple[str, float, bool]:
        r = self._post("step", {"action": reply})
        return r["observation"], r["reward"], r["done"]

    def close(self) -> object:
        return self._post("close", {})


@pytest.fixture(scope="module")
def fleet():
    proc = ServerProcess(["babyai", "textcraft", "sciworld", "searchqa"])
    yield proc
    proc.stop()


async def play(client, twin, replies, task_id: int, first_observation: str) -> tuple[float, bool, int]:
    """Step the client and the in-process twin with the same replies; every observation the
    client shows must be the twin's."""
    assert first_observation == await twin.reset(task_id)
    reward, done, turns = 0.0, False, 0
    for reply in replies(twin):
        observation, reward, done = client.step(reply)
        assert observation == (await twin.step(reply)).observation
        turns += 1
        if done:
            break
    return reward, done, turns


def babyai_bot(twin):
    bot = None
    for _ in range(200):
        reply, bot = twin.expert_action(bot)
        yield "Thought:\nThe bot knows the way.\n\nAction:\n" + reply.removeprefix("Action: ")


def from_plan(twin):
    yield from (f"Thought:\nnext step.\n\nAction:\n{r.removeprefix('Action: ')}" for r in twin.expert_plan())


async def test_babyai_client_expert_reaches_success(fleet):
    twin = make_env("babyai")
    ids = [i for i in twin.task_ids("test") if twin.task_category(i) not in BOT_UNSUPPORTED_LEVELS][:3]
    client = BabyAIClient(f"{fleet.url}/babyai")
    for task_id in ids:
        reward, done, turns = await play(client, twin, babyai_bot, task_id, client.reset(task_id))
        assert done and reward > 0, (task_id, turns, client.info)


async def test_sciworld_client_expert_reaches_success(fleet):
    twin = make_env("sciworld", {"gold_path": True})
    client = SciWorldClient(f"{fleet.url}/sciworld")
    try:
        for task_id in (4333, 3461):  # test-split tasks with short gold paths (4 and 7 actions)
            reward, done, turns = await play(client, twin, from_plan, task_id, client.reset(task_id))
            assert done and reward >= 100, (task_id, turns, client.info)
    finally:
        await twin.close()


async def test_textcraft_client_expert_reaches_success_and_closes_twice(fleet):
    twin = make_env("textcraft")
    client = TextCraftClient(f"{fleet.url}/textcraft")
    assert client.info["observation"].startswith("Crafting commands:")  # read from /create
    played = 0
    for task_id in twin.task_ids("test"):
        await twin.reset(task_id)
        if any(re.search(r"[^A-Za-z0-9, ]", r.removeprefix("Action: ")) for r in twin.expert_plan()):
            continue  # AgentGym's client would mangle this plan's item names (e.g. an apostrophe)
        reward, done, turns = await play(client, twin, from_plan, task_id, client.reset(task_id))
        assert done and reward > 0, (task_id, turns)
        played += 1
        if played == 3:
            break
    assert played == 3
    assert client.close() == {"closed": True}
    assert client.close() == {"closed": True}  # a second close is not an error


async def test_searchqa_client_expert_reaches_success(fleet):
    twin = make_env("searchqa")
    client = SearchQAClient(f"{fleet.url}/searchqa")
    assert isinstance(client.env_id, int)
    for task_id in twin.task_ids("test")[:3]:
        first = client.reset(task_id)
        assert isinstance(first, str) and client.observe() == first
        reward, done, turns = await play(client, twin, lambda t: iter(t.expert_plan()), task_id, first)
        assert done and reward > 0, (task_id, turns)
    client.close()


def test_bare_and_whole_reply_actions(fleet):
    base = f"{fleet.url}/babyai"
    sid = ok("POST", f"{base}/create")["id"]
    ok("POST", f"{base}/reset", {"id": sid, "data_idx": 0})
    invalid_action = ok("POST", f"{base}/step", {"id": sid, "action": "fly to the moon"})["observation"]
    whole_reply_without_action = ok("POST", f"{fleet.url}/step",
                                    {"id": sid, "action": "fly to the moon", "whole_reply": True})["observation"]
    assert invalid_action.startswith("The action is not recognized")
    assert whole_reply_without_action.startswith("Invalid format")
    moved = ok("POST", f"{base}/step", {"id": sid, "action": "turn left"})
    assert not moved["observation"].startswith(("Invalid", "The action is not recognized"))
    assert moved["info"]["invalid_action"] is False
    empty = ok("POST", f"{base}/step", {"id": sid, "action": ""})  # TextCraft's client sends "" for no Action:
    assert empty["observation"].startswith("Invalid format")


def test_routes_name_the_environment(fleet):
    status, answer = http("POST", f"{fleet.url}/create")  # several served, none named
    assert status == 400 and "/<env>" in answer["error"]
    assert http("POST", f"{fleet.url}/webshop/create")[0] == 404
    sid = ok("POST", f"{fleet.url}/babyai/create")["id"]
    status, answer = http("POST", f"{fleet.url}/textcraft/reset", {"id": sid, "data_idx": 0})
    assert status == 404 and "babyai session" in answer["error"]
    # SearchQA's client pointed at the root routes: refused with the URL to use, not misread
    status, answer = http("POST", f"{fleet.url}/reset", {"id": 3, "env_idx": sid})
    assert status == 400 and "/searchqa" in answer["error"]
    status, answer = http("POST", f"{fleet.url}/textcraft/create", {"minecraft_dir": "x", "commands": "a", "goal": "b"})
    assert status == 400 and "not supported" in answer["error"]


async def test_one_environment_at_the_root_with_agentgym_errors():
    proc = ServerProcess(["textcraft"], "--agentgym-errors")
    try:
        client = TextCraftClient(proc.url)  # the root routes serve AgentGym's TextCraft client too
        twin = make_env("textcraft")
        task_id = twin.task_ids("train")[0]
        reward, done, _ = await play(client, twin, from_plan, task_id, client.reset(task_id))
        assert done and reward > 0
        status, answer = http("POST", f"{proc.url}/step", {"id": 12345, "action": "inventory"})
        assert status == 200 and "no session 12345" in answer["error"]  # AgentGym's error shape
    finally:
        proc.stop()
