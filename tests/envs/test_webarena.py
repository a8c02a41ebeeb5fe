"""WebArena on the local shop and forum in a real browser (one browser and one set of sites for the
module): the observation, the expert in-process and through the server, bad actions, evaluation,
reset restoring the database, concurrent episodes isolated."""

from __future__ import annotations

import asyncio
import json
import random
import re
import urllib.error
import urllib.request

import pytest
import pytest_asyncio

from horizonrl.apps.env_cli import run_check
from horizonrl.envs.registry import env_names, make_env
from horizonrl.envs.webarena import WebArenaEnv
from horizonrl.envs.webarena.browser import close_browser

from env_server_proc import ServerProcess
from webarena_helpers import run_expert

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.system]  # Chromium (WebArena's browser)

NODE_LINE = re.compile(r"^\t*\[\d+\] \S+ '.*'")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def env():
    env = WebArenaEnv()
    yield env
    await env.close()
    await close_browser()


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess(["webarena"], timeout_s=120)
    yield proc
    proc.stop()


def task_with(env: WebArenaEnv, text: str) -> int:
    return next(i for i, t in enumerate(env.tasks) if text in t["intent"])


async def test_registered_and_splits(env):
    assert "webarena" in env_names()
    train, test = set(env.task_ids("train")), set(env.task_ids("test"))
    assert not train & test and len(train | test) == env.num_tasks >= 40 and len(test) >= 20
    kinds = {env.task_category(i).split("/")[1] for i in range(env.num_tasks)}
    sites = {env.task_category(i).split("/")[0] for i in range(env.num_tasks)}
    assert kinds == {"info", "navigation", "state"} and sites == {"shopping", "reddit"}


async def test_observation_format(env):
    first = await env.reset(0)
    assert first.startswith(env.instructions) and "```click [12]```" in first
    body = first[len(env.instructions):]
    assert body.startswith("OBSERVATION:\nTab 0 (current): Home - Corner Shop\n\n[1] RootWebArea 'Home - Corner Shop'")
    tree = body.split("\n\n", 1)[1].split("\nURL: ")[0]
    assert all(NODE_LINE.match(line) for line in tree.splitlines())
    assert body.endswith("\nURL: http://shop.test/\nOBJECTIVE: What is the price of the Steel Kettle?\n"
                         "PREVIOUS ACTION: None")
    assert "\t[2] navigation 'Main'" in tree and "link 'Kitchen' url: http://shop.test/category/kitchen" in tree
    assert "focusable" not in tree and "StaticText ''" not in tree
    assert [int(m) for m in re.findall(r"^\t*\[(\d+)\]", tree, re.M)] == list(range(1, len(env.snapshot.nodes) + 1))
    again = await env.reset(0)
    assert again == first  # same task, same text


async def test_expert_solves_the_local_tasks(env):
    wins = 0
    for task_id in range(env.num_tasks):
        result = await run_expert(env, task_id)
        wins += result.success and result.reward == 1.0
    assert wins / env.num_tasks >= 0.95


async def test_wrong_answers_and_wrong_pages_score_zero(env):
    await env.reset(task_with(env, "price of the Steel Kettle"))
    result = await env.step("```stop [$10.00]```")
    assert result.done and result.reward == 0.0 and not result.success
    await env.reset(task_with(env, "Show me the Toys category"))
    result = await env.step("```stop []```")  # still on the home page
    assert result.done and result.reward == 0.0
    await env.reset(task_with(env, "Add the Bluetooth Speaker to my cart"))
    assert (await env.step("```stop []```")).reward == 0.0  # nothing in the cart


async def test_bad_actions_get_helpful_observations(env):
    await env.reset(0)
    cases = {
        "no backticks at all": "triple backticks",
        "```dance [3]```": "Unknown action 'dance'",
        "```click [9999]```": "no element [9999]",
        "```click [abc]```": "numeric element id",
        "```click```": "needs its argument",
        "```type [11]```": "type needs an id and a text",
        "```type [11] [x] [7]```": "1 (press Enter after typing) or 0",
        "```scroll [left]```": "[up] or [down]",
        "```goto [http://example.com/]```": "outside the sites of this task",
        "```tab_focus [5]```": "there is no tab 5",
        "```press []```": "key combination",
        "\udcff\x00``` click [1] ```": None,  # odd bytes around a valid action are fine
    }
    for reply, expected in cases.items():
        result = await env.step(reply)
        assert not result.done and result.reward == 0.0, reply
        if expected is not None:
            assert expected in result.observation and result.info["invalid_action"], (reply, result.observation[-300:])
            assert "OBSERVATION:\nTab 0 (current)" in result.observation  # the page is shown again
    assert (await env.step("```goto [http://example.com/]```")).observation.endswith(
        "(failed: http://example.com/ is outside the sites of this task; stay on "
        f"{', '.join(sorted(env.urls.values()))})")
    for bad_id in (-1, env.num_tasks, "1", None, True):
        with pytest.raises(ValueError):
            await env.reset(bad_id)


async def test_tabs_history_and_keys(env):
    await env.reset(0)
    kitchen = next(i for i, n in env.snapshot.nodes.items() if n.name == "Kitchen")
    assert "URL: " + env.urls["shopping"] + "/category/kitchen" in (await env.step(f"```click [{kitchen}]```")).observation
    assert (await env.step("```go_back```")).observation.count("Home - Corner Shop") >= 1
    assert "/category/kitchen\n" in (await env.step("```go_forward```")).observation
    opened = await env.step("```new_tab```")
    assert "Tab 0: Kitchen - Corner Shop | Tab 1 (current): " in opened.observation
    assert "Tab 0 (current): Kitchen" in (await env.step("```tab_focus [0]```")).observation
    await env.step("```tab_focus [1]```")
    closed = await env.step("```close_tab```")  # the blank tab: back to the kitchen
    assert "Tab 0 (current): Kitchen - Corner Shop\n" in closed.observation and "Tab 1" not in closed.observation
    search = next(i for i, n in env.snapshot.nodes.items() if n.name == "Search products")
    typed = await env.step(f"```type [{search}] [kettle] [0]```")
    assert "/search" not in typed.observation.split("URL: ")[1].splitlines()[0]
    pressed = await env.step("```press [enter]```")
    assert "search?q=kettle" in pressed.observation and "Steel Kettle" in pressed.observation
    assert not (await env.step("```scroll [down]```")).done
    assert not (await env.step("```hover [1]```")).done


async def test_actions_after_done(env):
    result = await run_expert(env, 0)
    assert result.done and result.success
    after = await env.step("```click [1]```")
    assert after.done and after.reward == 0.0


async def test_reset_restores_the_database(env):
    task = task_with(env, "Add the Bluetooth Speaker to my cart")
    assert (await run_expert(env, task)).success
    await env.reset(task)
    assert (await env.step("```stop []```")).reward == 0.0  # the cart is empty again
    review = task_with(env, "Write a review of the Chef Knife")
    assert (await run_expert(env, review)).success
    await env.reset(review)
    assert (await env.step("```stop []```")).reward == 0.0


async def test_concurrent_episodes_do_not_see_each_other(env):
    task = task_with(env, "Subscribe me to the forum f/books")
    a, b = WebArenaEnv(), WebArenaEnv()
    try:
        await asyncio.gather(a.reset(task), b.reset(task))
        state = None
        for _ in range(3):  # a subscribes; b does nothing
            reply, state = a.expert_action(state)
            await a.step(reply)
        result_a, result_b = await asyncio.gather(a.step("```stop []```"), b.step("```stop []```"))
        assert result_a.success and not result_b.success
    finally:
        await asyncio.gather(a.close(), b.close())
    assert env.local.open_sandboxes() <= 1  # closed episodes gave their databases back (env's own may be open)


async def test_random_actions_are_well_formed(env):
    rng = random.Random(0)
    await env.reset(3)
    for _ in range(15):
        reply = env.random_action(rng)
        assert reply.startswith("```") and reply.endswith("```")
        result = await env.step(reply)
        assert "Invalid format" not in result.observation and "Unknown action" not in result.observation
        if result.done:
            await env.reset(3)


async def test_expert_through_the_server(server):
    summary = await run_check("webarena", 12, server=server.url)
    assert summary["success_rate"] >= 0.95 and summary["episodes"] == 12
    assert summary["mismatches"] == 0  # the server's pages read exactly as the local twin's


async def test_http_client_is_a_webarena_env(server):
    remote = make_env("http", {"url": server.url, "env": "webarena"})
    try:
        first = await remote.reset(1)
        assert "OBSERVATION:\nTab 0 (current): Home - Corner Shop" in first
        bad = await remote.step("click [3]")  # a bare action, no backticks: the format is explained
        assert not bad.done and "triple backticks" in bad.observation
        assert remote.task_category(1) == WebArenaEnv().task_category(1)
    finally:
        await remote.close()


# ------------------------------------------------------------------ AgentGym's WebArena client, unchanged


def http(method: str, url: str, body: object = ...) -> tuple[int, object]:
    data = None if body is ... else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


class AgentGymWebArenaClient:
    """What agentenv's ``WebarenaEnvClient`` (agentenv/envs/webarena.py) sends and reads, written here from reading
    it: ``/create`` with no body, the session read from ``env_idx``; ``env_idx`` added to every body and to the
    observation's query; reset ``{"seed": 0, "idx"}``; the model's whole output as the step's action; the step's
    ``observation``, ``reward`` and ``terminated`` (no ``done``); every answer must be HTTP 200."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.env_id = self._ok("POST", f"{base}/create")["env_idx"]

    @staticmethod
    def _ok(method: str, url: str, body: object = ...) -> object:
        status, answer = http(method, url, body)
        assert status == 200, (url, body, answer)  # the client's `assert res.status_code == 200`
        return answer

    def _post(self, path: str, data: dict) -> dict:
        data["env_idx"] = self.env_id
        return self._ok("POST", f"{self.base}/{path}", data)

    def observe(self) -> object:
        return self._ok("GET", f"{self.base}/observation?env_idx={self.env_id}")

    def reset(self, idx: int) -> dict:
        return self._post("reset", {"seed": 0, "idx": idx})

    def step(self, action: str) -> tuple[str, float, bool]:
        r = self._post("step", {"action": action})
        return r["observation"], r["reward"], r["terminated"]

    def close(self) -> object:  # the server's /close (the client itself has no close)
        return self._post("close", {})


@pytest.mark.parametrize("route", ["", "/webarena"])  # the root routes (one environment served) and its own base URL
async def test_agentgym_webarena_client_plays_the_expert_to_success(env, server, route):
    client = AgentGymWebArenaClient(server.url + route)
    assert isinstance(client.env_id, int)
    task = task_with(env, "Subscribe me to the forum f/books")
    first = client.reset(task)["observation"]
    assert first == await env.reset(task)
    observed = client.observe()
    assert (observed if route else observed["observation"]) == first  # WebArena's server answers a bare string
    state, reward, terminated, turns = None, 0.0, False, 0
    while not terminated and turns < 20:
        reply, state = env.expert_action(state)
        said = f"Let's think step by step. In summary, the next action I will perform is {reply}"  # the whole output
        observation, reward, terminated = client.step(said)
        assert observation == (await env.step(said)).observation
        turns += 1
    assert terminated and reward == 1.0 and turns >= 3
    assert client.close() == {"closed": True}
    status, answer = http("POST", f"{server.url}{route}/step", {"env_idx": client.env_id, "action": "```stop []```"})
    assert status == 404 and "no session" in answer["error"]
