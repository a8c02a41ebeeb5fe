"""No group waits forever: a training run whose environment hangs on some steps (the step never answers)
ends those episodes at ``rollout.episode_timeout_s`` as timeout failures, and the run goes on to its end.

The environment is real — ``horizonrl env serve signpost`` in its own process — behind a small HTTP
proxy in this test that forwards everything, except that a step of an episode of a task id divisible
by 3 is held forever.
"""

from __future__ import annotations

import asyncio
import glob
import json
import threading
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from env_server_proc import ServerProcess
from helpers import horizonrl_cmd, start_process, stop_process

from horizonrl.protocol.transport import free_port

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "signpost_test.yaml"


class HangingProxy(threading.Thread):
    """Forwards to ``upstream``; a /step of a session reset with a task id divisible by 3 never answers."""

    def __init__(self, upstream: str) -> None:
        super().__init__(daemon=True)
        self.upstream = upstream
        self.port = free_port()
        self.task_of: dict[int, int] = {}
        self.held = 0
        self.ready = threading.Event()
        self.loop = asyncio.new_event_loop()
        self._stopped: asyncio.Event | None = None

    def run(self) -> None:
        self.loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        self._stopped = asyncio.Event()
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", self._forward)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        async with aiohttp.ClientSession() as self.session:
            self.ready.set()
            await self._stopped.wait()
        await runner.cleanup()

    async def _forward(self, request: web.Request) -> web.Response:
        body = await request.read()
        payload = json.loads(body) if body else {}
        path = request.match_info["path"]
        if path == "reset":
            self.task_of[payload["id"]] = payload["data_idx"]
        if path == "step" and self.task_of.get(payload.get("id"), 1) % 3 == 0:
            self.held += 1
            await self._stopped.wait()  # hung: never answers
        async with self.session.request(request.method, f"{self.upstream}/{path}", data=body,
                                        params=request.query, headers={"Content-Type": "application/json"}) as r:
            return web.Response(body=await r.read(), status=r.status, content_type="application/json")

    def stop(self) -> None:
        if self._stopped is not None:
            self.loop.call_soon_threadsafe(self._stopped.set)
        self.join(10)


def test_a_hung_environment_step_ends_the_episode_at_its_limit_and_the_run_goes_on(tiny_model, tmp_path):
    server = ServerProcess(["signpost"], "--settings", json.dumps({"signpost": {"length": 2}}))
    proxy = HangingProxy(server.url)
    proxy.start()
    proxy.ready.wait(30)
    total = 6
    run_dir, log = tmp_path / "run", tmp_path / "train.log"
    envs = json.dumps([{"name": "http", "settings": {"url": f"http://127.0.0.1:{proxy.port}", "env": "signpost"}}])
    proc = start_process(horizonrl_cmd(
        "train", str(CONFIG), f"model.path={tiny_model}", f"run.output_dir={run_dir}", f"envs={envs}",
        "rollout.num_actors=1", "rollout.n=4", "learner.groups_per_step=2", f"learner.total_steps={total}",
        "rollout.episode_timeout_s=4", "buffer.skip_equal_reward_groups=false"), log)
    try:
        rc = proc.wait(timeout=900)
    finally:
        stop_process(proc)
        proxy.stop()
        server.stop()
    assert rc == 0, log.read_text(errors="replace")[-5000:]
    assert f"step {total}/{total}" in log.read_text(errors="replace")
    assert proxy.held > 0  # some steps did hang
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(glob.glob(str(run_dir / "tensorboard" / "events.*"))[0])
    acc.Reload()
    assert max(e.value for e in acc.Scalars("rollout/failures/timeout")) > 0  # counted, never trained on
