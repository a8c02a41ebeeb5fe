"""Environment server and client: the expert through the server, status codes, bad input,
disconnects, concurrency without cross-talk, session reaping and a leak check."""

from __future__ import annotations

import asyncio
import json
import socket

import aiohttp
import pytest

from horizonrl.envs.base import EnvironmentFailure
from horizonrl.apps.env_cli import run_check
from horizonrl.envs.client import HTTPEnv
from horizonrl.envs.registry import make_env
from horizonrl.protocol.transport import free_port

from env_server_proc import ServerProcess


@pytest.mark.parametrize("name", ["babyai", "textcraft", "searchqa"])
async def test_expert_through_server_matches_in_process(server, name):
    summary = await run_check(name, 15, server=server.url)
    assert summary["success_rate"] >= 0.95 and summary["mismatches"] == 0


async def test_client_is_an_environment(server):
    env = make_env("http", {"url": server.url, "env": "babyai"})
    local = make_env("babyai")
    assert env.task_ids("test")[:5] == local.task_ids("test")[:5]
    assert env.task_category(41) == local.task_category(41)
    assert await env.reset(7) == await local.reset(7)
    reply = env.random_action(__import__("random").Random(0))
    assert reply.startswith("Action: ")
    result = await env.step(reply)
    assert result.observation == (await local.step(reply)).observation
    await env.close()
    await env.close()  # idempotent


async def post(session, url, body, raw=None):
    data = raw if raw is not None else json.dumps(body)
    async with session.post(url, data=data) as r:
        return r.status, await r.json()


async def test_status_codes_and_bad_input(server):
    u = server.url
    async with aiohttp.ClientSession() as s:
        assert (await post(s, u + "/create", None, raw=b"not json"))[0] == 400
        assert (await post(s, u + "/create", {"env": "nope"}))[0] == 400
        status, body = await post(s, u + "/create", {"env": "babyai"})
        assert status == 200
        sid = body["id"]
        assert (await post(s, u + "/step", {"id": sid, "action": "Action: turn left"}))[0] == 409
        assert (await post(s, u + "/reset", {"id": sid, "data_idx": -5}))[0] == 400
        assert (await post(s, u + "/reset", {"id": sid, "data_idx": "x"}))[0] == 400
        assert (await post(s, u + "/reset", {"id": sid, "data_idx": 3}))[0] == 200
        for action in ["gibberish", "", "Action: \u2603\x00", "Action: go to nowhere 9"]:
            status, body = await post(s, u + "/step", {"id": sid, "action": action})
            assert status == 200 and body["done"] is False
        assert (await post(s, u + "/step", {"id": sid, "action": 5}))[0] == 400
        assert (await post(s, u + "/step", {"id": 10**9, "action": "x"}))[0] == 404
        assert (await post(s, u + "/step", {"id": "abc", "action": "x"}))[0] == 400
        assert (await post(s, u + "/step", [1, 2]))[0] == 400
        for depth in (65, 100_000):  # past the limit; past the parser's recursion (a 500 before the limit)
            status, body = await post(s, u + "/step", None, raw=b'{"id": ' + b"[" * depth + b"]" * depth + b"}")
            assert (status, body["kind"]) == (400, "too_deep"), (depth, status, body)
        big = json.dumps({"id": sid, "action": "x" * (2 << 20)})
        status, body = await post(s, u + "/step", None, raw=big)
        assert status == 413 and "error" in body
        async with s.get(u + "/observation", params={"id": "zz"}) as r:
            assert r.status == 400
        async with s.get(u + "/nowhere") as r:
            assert r.status == 404
        assert (await post(s, u + "/close", {"id": sid}))[0] == 200
        assert (await post(s, u + "/close", {"id": sid})) == (200, {"closed": True})  # idempotent
        assert (await post(s, u + "/close", {"id": 10**9}))[0] == 404  # never created
        assert (await post(s, u + "/step", {"id": sid, "action": "turn left"}))[0] == 404  # closed
        async with s.get(u + "/health") as r:
            assert r.status == 200 and (await r.json())["status"] == "ok"


async def test_actions_after_done_through_server(server):
    env = HTTPEnv(server.url, env="textcraft")
    local = make_env("textcraft")
    await env.reset(10)
    await local.reset(10)
    for reply in local.expert_plan():
        result = await env.step(reply)
    assert result.done and result.success
    after = await env.step("Action: inventory")
    assert after.done and after.reward == 0.0
    await env.close()


async def test_abrupt_disconnects_do_not_hurt_the_server(server):
    host, port = "127.0.0.1", server.port
    for payload in [b"POST /step HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"id\": 1",
                    b"POST /create HTTP/1.1\r\n", b"\x16\x03\x01garbage"]:
        with socket.create_connection((host, port), timeout=5) as sock:
            sock.sendall(payload)
    # a client that sends a whole request and goes away before the answer
    body = b'{"env": "babyai"}'
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.sendall(b"POST /create HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    ok = HTTPEnv(server.url, env="babyai")
    assert (await ok.reset(0)).startswith("Your goal:")
    await ok.close()


async def test_client_raises_environment_failure_when_server_is_gone():
    env = HTTPEnv(f"http://127.0.0.1:{free_port()}", env="babyai", timeout_s=2, retry_for_s=1)
    with pytest.raises(EnvironmentFailure):
        await env.reset(0)
    await env.close()


async def test_the_client_waits_for_a_server_that_comes_back():
    """A server restarted by the launcher: session creation is retried with back-off until it is back;
    an episode in progress when it died fails as the environment's fault."""
    first = ServerProcess(["babyai"])
    env = HTTPEnv(first.url, env="babyai", timeout_s=5, retry_for_s=120)
    await env.reset(3)
    first.proc.kill()  # kill -9
    first.proc.wait(15)
    with pytest.raises(EnvironmentFailure):
        await env.step("Action: turn left")  # sent once: never repeated
    await env.close()
    reset = asyncio.ensure_future(HTTPEnv(first.url, env="babyai", timeout_s=5, retry_for_s=120).reset(3))
    await asyncio.sleep(2)
    assert not reset.done()  # nothing listens: it keeps trying
    second = ServerProcess(["babyai"], "--port", str(first.port))
    try:
        assert (await asyncio.wait_for(reset, 60)).startswith("Your goal:")
    finally:
        second.stop()
        first.stop()


async def test_lost_session_is_environment_failure(server):
    env = HTTPEnv(server.url, env="babyai")
    await env.reset(0)
    async with aiohttp.ClientSession() as s:
        await post(s, server.url + "/close", {"id": env._id})
    with pytest.raises(EnvironmentFailure, match="lost session"):
        await env.step("Action: turn left")
    await env.close()


async def test_bad_task_id_through_client_is_value_error(server):
    env = HTTPEnv(server.url, env="textcraft")
    with pytest.raises(ValueError):
        await env.reset(10**6)
    await env.close()


async def test_64_concurrent_sessions_without_cross_talk(server):
    async def episode(k: int) -> bool:
        remote, local = HTTPEnv(server.url, env="babyai"), make_env("babyai")
        try:
            task = 40 * k + (k % 3)
            if await remote.reset(task) != await local.reset(task):
                return False
            rng = __import__("random").Random(k)
            for _ in range(10):
                reply = local.random_action(rng)
                a, b = await remote.step(reply), await local.step(reply)
                if a.observation != b.observation or a.done != b.done:
                    return False
                if a.done:
                    break
            return True
        finally:
            await remote.close()

    results = await asyncio.wait_for(asyncio.gather(*(episode(k) for k in range(64))), timeout=180)
    assert all(results)


@pytest.mark.slow
async def test_leak_and_reaping():
    proc = ServerProcess(["signpost", "babyai"], "--idle-timeout", "1", "--reap-interval", "0.5")
    try:
        async with aiohttp.ClientSession() as s:
            async def health():
                async with s.get(proc.url + "/health") as r:
                    return await r.json()

            async def lifecycle(k: int, close: bool) -> None:
                _, body = await post(s, proc.url + "/create", {"env": "babyai" if k % 4 == 0 else "signpost"})
                sid = body["id"]
                await post(s, proc.url + "/reset", {"id": sid, "data_idx": k})
                await post(s, proc.url + "/step", {"id": sid, "action": "Action: turn left"})
                if close:
                    await post(s, proc.url + "/close", {"id": sid})

            for k in range(100):  # warm up caches and allocator before measuring
                await lifecycle(k, True)
            baseline = (await health())["rss_bytes"]
            for start in range(0, 1000, 50):
                await asyncio.gather(*(lifecycle(start + k, True) for k in range(50)))
            reaped_before = (await health())["reaped"]
            await asyncio.gather(*(lifecycle(k, False) for k in range(200)))
            h = await health()
            # every unclosed session is still open or already reaped (the reaper may start meanwhile)
            assert h["sessions"] + h["reaped"] - reaped_before == 200
            for _ in range(100):
                await asyncio.sleep(0.1)
                h = await health()
                if h["sessions"] == 0:
                    break
            assert h["sessions"] == 0 and h["reaped"] - reaped_before == 200
            assert h["rss_bytes"] - baseline < 40 * 2**20, (baseline, h["rss_bytes"])
    finally:
        proc.stop()


def test_json_depth_counts_nesting_and_not_brackets_inside_strings():
    from horizonrl.envs.server import json_depth

    assert json_depth(b"{}") == 1 and json_depth(b'{"a": [1, {"b": 2}]}') == 3
    assert json_depth(b'{"action": "[[[[{{{{"}') == 1  # text, not nesting
    assert json_depth(b'{"action": "a \\" [[[[ \\\\"}') == 1  # escaped quotes stay inside the string
    assert json_depth(b"[" * 5000 + b"]" * 5000) == 5000 and json_depth(b"") == 0
