"""WebArena's infrastructure failures: a browser killed or hung mid-episode (EnvironmentFailure, the
browser relaunched, the next episode fine), a page that never loads, missing or unreachable sites,
a missing browser, the cap on concurrent episodes. Each test runs in its own event loop with its
own browser and checks that no browser process it started is left."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from horizonrl.envs.base import EnvironmentFailure
from horizonrl.envs.webarena import WebArenaEnv
from horizonrl.envs.webarena.browser import _descendant_browsers, browser_host, close_browser, find_browser
from horizonrl.protocol.transport import free_port

from helpers import still_running, wait_until
from webarena_helpers import run_expert

pytestmark = pytest.mark.system  # Chromium (WebArena's browser)


def run(scenario, timeout_s: float = 240.0):
    """Run ``scenario()`` in a fresh loop (fresh browser); close that browser; no browser left behind."""
    async def wrapped():
        try:
            return await asyncio.wait_for(scenario(), timeout_s)
        finally:
            await close_browser()

    result = asyncio.run(wrapped())
    left = browsers_of_this_session()
    assert not left, f"a browser process was left behind: {describe(left)}"
    return result


def parents_below_this_process(pid: int) -> list:
    """The processes between this one and ``pid`` (a browser's driver, ...), nearest first."""
    import psutil

    chain = []
    for parent in psutil.Process(pid).parents():
        if parent.pid == os.getpid():
            break
        chain.append(parent)
    return chain


def browsers_of_this_session() -> set[int]:
    """The browsers under this process, less those under a process of another session: the suite's background
    model builders run in sessions of their own (tests/conftest.py), and the WebArena model's build plays WebArena,
    so its browsers are this process's descendants too but no test's (stop 48's CI failed on one)."""
    import psutil

    found = set()
    for pid in _descendant_browsers(find_browser()):
        try:
            if all(os.getsid(p.pid) == os.getsid(0) for p in parents_below_this_process(pid)):
                found.add(pid)
        except (psutil.Error, ProcessLookupError):  # ended meanwhile
            continue
    return found


def describe(pids: set[int]) -> list[str]:
    """Each process with its age and its parents up to this one: which test's browser, under which driver."""
    import psutil

    lines = []
    for pid in pids:
        try:
            chain = [f"{p.pid} {' '.join(p.cmdline()[:3])[:120]}" for p in parents_below_this_process(pid)]
            lines.append(f"{pid} started {time.time() - psutil.Process(pid).create_time():.0f} s ago, under {chain}")
        except psutil.Error as error:
            lines.append(f"{pid}: {error}")
    return lines


def test_browser_killed_mid_episode_is_an_infrastructure_failure():
    async def scenario():
        env = WebArenaEnv()
        await env.reset(2)
        host = browser_host(None, 8)
        first_pid = host.pid
        assert first_pid is not None and host.launches == 1
        os.kill(first_pid, signal.SIGKILL)  # the browser this test's environment started
        with pytest.raises(EnvironmentFailure, match="browser"):
            for _ in range(3):  # the first step may still see the old page; none may return a reward
                result = await env.step("```click [4]```")
                assert result.reward == 0.0
        result = await run_expert(env, 2)  # relaunched: the next episode is fine
        assert result.success and host.launches == 2 and host.pid not in (None, first_pid)
        await env.close()

    run(scenario)


def test_hung_browser_is_killed_and_replaced():
    async def scenario():
        env = WebArenaEnv(action_timeout_s=2)
        await env.reset(0)
        host = browser_host(None, 8)
        hung = host.pid
        os.kill(hung, signal.SIGSTOP)  # frozen, not dead
        try:
            with pytest.raises(EnvironmentFailure, match="did not answer"):
                await env.step("```click [4]```")
        finally:
            if hung in _descendant_browsers(find_browser()):
                os.kill(hung, signal.SIGCONT)
        assert (await run_expert(env, 0)).success and host.pid != hung
        await env.close()

    run(scenario)


def test_abandoning_a_host_also_ends_a_hung_browser_it_lost_track_of():
    """A host whose loop has ended is abandoned: its driver is killed, and with it every browser that driver
    launched, the one the host knows by pid or not (a launch cut short; a pid mistaken for the browser's child). A
    browser that is well ends itself when its driver's pipe closes; a hung one would live on, an orphan no one
    can name."""
    import psutil

    async def scenario():
        host = browser_host(None, 8)
        await host.browser()
        return host, psutil.Process(host.pid)

    host, browser = asyncio.run(scenario())
    browser.suspend()  # hung
    host.pid = None  # and lost track of
    try:
        host.abandon()
        wait_until(lambda: not still_running(browser), 30, "the hung browser the host lost track of to end with "
                                                           "its driver")
    finally:
        if browser.is_running():  # this test's browser: psutil checks the pid still names it
            browser.kill()


class SlowSite(BaseHTTPRequestHandler):
    """``/`` answers at once; ``/slow`` never finishes (until the test releases it)."""

    release = threading.Event()

    def do_GET(self):  # noqa: N802
        if self.path.startswith("/slow"):
            self.release.wait(120)
            return
        body = b"<html><head><title>Slow shop</title></head><body><a href='/slow'>Slow page</a></body></html>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def slow_site(tmp_path):
    SlowSite.release.clear()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), SlowSite)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    SlowSite.release.set()
    httpd.shutdown()
    thread.join(timeout=10)


def write_tasks(path, start_urls):
    tasks = [{"task_id": i, "sites": ["shopping"], "require_login": False, "storage_state": None, "start_url": url,
              "intent": "Open the slow page.", "eval": {"eval_types": ["url_match"], "reference_answers": None,
                                                        "reference_url": "__SHOPPING__/slow", "program_html": []}}
             for i, url in enumerate(start_urls)]
    path.write_text(json.dumps(tasks))
    return str(path)


def test_a_page_that_never_loads(slow_site, tmp_path):
    tasks = write_tasks(tmp_path / "tasks.json", ["__SHOPPING__/slow", "__SHOPPING__/"])

    async def scenario():
        env = WebArenaEnv(sites={"shopping": slow_site}, tasks=tasks, page_load_timeout_s=2, action_timeout_s=2)
        started = time.monotonic()
        with pytest.raises(EnvironmentFailure, match="did not load"):
            await env.reset(0)  # the start page itself: the site's fault, not the agent's
        assert time.monotonic() - started < 60
        first = await env.reset(1)
        assert "link 'Slow page'" in first
        link = next(i for i, n in env.snapshot.nodes.items() if n.name == "Slow page")
        result = await env.step(f"```click [{link}]```")  # the agent's navigation: an observation says so
        assert not result.done and "did not finish loading" in result.observation
        result = await env.step(f"```goto [{slow_site}/slow?again=1]```")
        assert not result.done and "did not finish loading" in result.observation
        assert (await env.step("```goto [http://127.0.0.2:9/]```")).info["invalid_action"]  # off-site
        await env.close()

    run(scenario)


def test_missing_and_unreachable_sites_fail_at_start(tmp_path, slow_site):
    tasks = write_tasks(tmp_path / "tasks.json", ["__SHOPPING__/"])
    both = json.loads(open(tasks).read())
    both.append({**both[0], "task_id": 1, "sites": ["reddit"], "start_url": "__REDDIT__/"})
    (tmp_path / "both.json").write_text(json.dumps(both))
    with pytest.raises(ValueError, match=r"not configured: \['reddit'\]"):
        WebArenaEnv(sites={"shopping": slow_site}, tasks=str(tmp_path / "both.json"))
    env = WebArenaEnv(sites={"shopping": slow_site}, tasks=str(tmp_path / "both.json"), skip_tasks_without_sites=True)
    assert env.num_tasks == 1
    started = time.monotonic()
    with pytest.raises(ValueError, match="'shopping' at http://127.0.0.1:.* is not reachable"):
        WebArenaEnv(sites={"shopping": f"http://127.0.0.1:{free_port()}"}, tasks=tasks)
    assert time.monotonic() - started < 30
    with pytest.raises(ValueError, match="set tasks"):
        WebArenaEnv(sites={"shopping": slow_site})
    with pytest.raises(ValueError, match="unknown WebArena sites"):
        WebArenaEnv(sites={"shop": slow_site}, tasks=tasks)


def test_missing_browser_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="not an executable"):
        find_browser(str(tmp_path / "no-chromium"))

    async def scenario():
        env = WebArenaEnv(browser_path=str(tmp_path / "no-chromium"))
        with pytest.raises(FileNotFoundError, match="browser_path"):
            await env.reset(0)

    asyncio.run(scenario())


def test_concurrent_episodes_are_capped():
    async def scenario():
        a = WebArenaEnv(max_concurrent_episodes=1, episode_wait_timeout_s=2)
        b = WebArenaEnv(max_concurrent_episodes=1, episode_wait_timeout_s=2)
        await a.reset(0)
        with pytest.raises(EnvironmentFailure, match="no browser slot"):
            await b.reset(0)
        waiting = asyncio.ensure_future(WebArenaEnv(max_concurrent_episodes=1, episode_wait_timeout_s=60).reset(1))
        await asyncio.sleep(0.5)
        assert not waiting.done()
        await a.close()  # frees the slot
        assert "OBJECTIVE:" in await asyncio.wait_for(waiting, 60)
        await b.close()

    run(scenario)


def test_env_check_command_in_process_and_through_the_server():
    """`horizonrl env check webarena --episodes 20`, as a user runs it, in-process and through
    `horizonrl env serve webarena`."""
    import subprocess
    import sys

    from env_server_proc import ServerProcess

    def check(*extra):
        out = subprocess.run([sys.executable, "-m", "horizonrl.apps.env_cli", "check", "webarena", "--episodes", "20",
                              *extra], capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    summary = check()
    assert summary["episodes"] == 20 and summary["success_rate"] >= 0.95
    server = ServerProcess(["webarena"], timeout_s=120)
    try:
        summary = check("--server", server.url)
        assert summary["episodes"] == 20 and summary["success_rate"] >= 0.95 and summary["mismatches"] == 0
    finally:
        server.stop()
