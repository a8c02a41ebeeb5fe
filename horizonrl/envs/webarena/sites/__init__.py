"""The local sites (a shop and a forum) served in-process on 127.0.0.1 free ports.

One :class:`LocalSites` per process (``local_sites()``), on its own thread and event loop, so
that it serves the browser whatever loop (or thread) the environment runs in. It writes the
seed databases and WebArena-style storage-state files (``.auth/shopping_state.json``,
``.auth/reddit_state.json``) into a temporary directory it removes at exit.

The browser reaches them under fixed names, ``http://shop.test`` and ``http://forum.test``
(Chromium's ``--host-resolver-rules`` maps each to its 127.0.0.1 port), so observations, URLs
and evaluations read the same in every process whatever ports the sites got.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import shutil
import tempfile
import threading
import uuid
from pathlib import Path

from aiohttp import web

from horizonrl.envs.webarena.sites import forum, shop
from horizonrl.envs.webarena.sites.common import SANDBOX_COOKIE, session_token

__all__ = ["LocalSites", "local_sites", "SANDBOX_COOKIE"]

HOSTNAMES = {"shopping": "shop.test", "reddit": "forum.test"}
STORAGE_STATES = {"shopping": ("shopping_state.json", shop.COOKIE, "emma"),
                  "reddit": ("reddit_state.json", forum.COOKIE, "max")}


class LocalSites:
    """Serves the shop (``shopping``) and the forum (``reddit``).

    ``urls`` maps a site to the base URL the browser uses (``http://shop.test``), ``ports`` to the
    127.0.0.1 port it listens on; ``resolver_rules`` is the Chromium flag value joining the two.
    """

    def __init__(self, host: str = "127.0.0.1", start_timeout_s: float = 30.0) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="horizonrl-webarena-"))
        self.apps = {"shopping": shop.ShopApp(str(self.dir / "shop.sqlite")),
                     "reddit": forum.ForumApp(str(self.dir / "forum.sqlite"))}
        self.ports: dict[str, int] = {}
        self._loop = asyncio.new_event_loop()
        self._runners: list[web.AppRunner] = []
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(host,), name="webarena-local-sites", daemon=True)
        self._thread.start()
        if not self._started.wait(start_timeout_s):
            raise RuntimeError(f"the local WebArena sites did not start within {start_timeout_s} s")
        if self._error is not None:
            raise RuntimeError(f"the local WebArena sites failed to start: {self._error!r}") from self._error
        self.urls = {site: f"http://{HOSTNAMES[site]}" for site in self.apps}
        self.resolver_rules = ", ".join(f"MAP {HOSTNAMES[site]}:80 {host}:{port}" for site, port in self.ports.items())
        self.auth_dir = self.dir / ".auth"
        self.auth_dir.mkdir()
        for site, (filename, cookie, user) in STORAGE_STATES.items():
            state = {"cookies": [{"name": cookie, "value": session_token(site, user), "domain": HOSTNAMES[site],
                                  "path": "/", "expires": -1, "httpOnly": False, "secure": False, "sameSite": "Lax"}],
                     "origins": []}
            (self.auth_dir / filename).write_text(json.dumps(state))

    def _run(self, host: str) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._start(host))
        except BaseException as error:  # reported to the constructor
            self._error = error
            self._started.set()
            return
        self._started.set()
        self._loop.run_forever()

    async def _start(self, host: str) -> None:
        for site, app in self.apps.items():
            runner = web.AppRunner(app.app(), access_log=None)
            await runner.setup()
            await web.TCPSite(runner, host, 0).start()
            self._runners.append(runner)
            self.ports[site] = runner.addresses[0][1]

    def new_sandbox(self) -> str:
        """A fresh copy of every site's seed database; the browser context names it in a cookie."""
        name = uuid.uuid4().hex
        for app in self.apps.values():
            app.db.create(name)
        return name

    def drop_sandbox(self, name: str) -> None:
        for app in self.apps.values():
            app.db.drop(name)

    def open_sandboxes(self) -> int:
        return len(self.apps["shopping"].db) - 1

    def stop(self) -> None:
        async def cleanup() -> None:
            for runner in self._runners:
                await runner.cleanup()

        if self._loop.is_running():
            asyncio.run_coroutine_threadsafe(cleanup(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        for app in self.apps.values():
            app.db.close()
        shutil.rmtree(self.dir, ignore_errors=True)


_SITES: LocalSites | None = None
_LOCK = threading.Lock()


def local_sites() -> LocalSites:
    """This process's local sites, started on first use and stopped at exit."""
    global _SITES
    with _LOCK:
        if _SITES is None:
            _SITES = LocalSites()
            atexit.register(_SITES.stop)
        return _SITES
