"""One headless Chromium per worker process (per event loop), driven by Playwright directly.

Every episode gets its own browser context (cookies, storage, pages) from the shared browser; a
semaphore caps how many run at once. The browser is the Debian package ``chromium-headless-shell``
(``make system-deps``); Playwright's own browser download is neither needed nor possible offline.

A browser that crashed or hangs is an infrastructure failure: the call raises
:class:`EnvironmentFailure`, the browser process (which this host started, known by pid) is
killed, and the next episode launches a fresh one.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import shutil
import signal
import weakref
from typing import Any

from horizonrl.envs.base import EnvironmentFailure

BROWSER_CANDIDATES = ("/usr/lib/chromium/chromium-headless-shell", "/usr/bin/chromium-headless-shell",
                      "/usr/bin/chromium", "/usr/bin/chromium-browser")
# No network, no background services: the machine is offline and each saves memory and time.
BROWSER_ARGS = ("--no-sandbox", "--disable-background-networking", "--disable-component-update",
                "--disable-default-apps", "--disable-extensions", "--disable-sync", "--no-first-run",
                "--disable-domain-reliability", "--disable-breakpad", "--metrics-recording-only",
                "--disable-dev-shm-usage", "--mute-audio", "--disable-gpu")
VIEWPORT = {"width": 1280, "height": 720}

_STARTED_PIDS: set[int] = set()


def find_browser(path: str | None = None) -> str:
    """The Chromium executable to use; a clear error when there is none."""
    if path:
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            raise FileNotFoundError(f"WebArena browser {path!r} (setting browser_path) is not an executable file")
        return path
    installed = shutil.which("chromium-headless-shell")
    for candidate in (os.environ.get("HORIZONRL_CHROMIUM"), *BROWSER_CANDIDATES, installed):
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    raise FileNotFoundError(
        "WebArena needs Chromium and none was found: install Debian's chromium-headless-shell (`make system-deps`, "
        "or `apt-get install chromium-headless-shell`), or set the environment setting browser_path / "
        "HORIZONRL_CHROMIUM to a Chromium executable. (Playwright's own browser download is not used.)")


def _descendant_browsers(executable: str) -> set[int]:
    """Pids of this process's descendants that are Chromium *browser* processes (not renderers)."""
    import psutil

    found = set()
    real = os.path.realpath(executable)
    for child in psutil.Process().children(recursive=True):
        try:
            cmd = child.cmdline()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if cmd and os.path.realpath(cmd[0]) == real and not any(a.startswith("--type=") for a in cmd):
            found.add(child.pid)
    return found


def _parent(pid: int) -> int | None:
    import psutil

    try:
        return psutil.Process(pid).ppid()
    except psutil.NoSuchProcess:
        return None


def _kill(pid: int) -> None:
    """SIGKILL a browser this module started (by pid, never by name)."""
    if pid in _STARTED_PIDS:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _STARTED_PIDS.discard(pid)


def _processes_under(pids: set[int]) -> list[Any]:
    """Every live process below ``pids`` (Playwright drivers this module started: the browsers they launched and
    the browsers' own children), as psutil processes, which remember their start time."""
    import psutil

    found = []
    for pid in pids:
        try:
            found.extend(psutil.Process(pid).children(recursive=True))
        except psutil.NoSuchProcess:
            pass
    return found


def _kill_processes(processes: list[Any]) -> None:
    """SIGKILL what :func:`_processes_under` found and is still running (psutil checks that a pid still names the
    same process, so a reused pid is never hit)."""
    import psutil

    for proc in processes:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass


atexit.register(lambda: [_kill(pid) for pid in list(_STARTED_PIDS)])


class BrowserHost:
    """The process's browser for one event loop: launch, contexts under a cap, restart."""

    def __init__(self, executable: str, max_episodes: int, launch_timeout_s: float = 60.0,
                 resolver_rules: str | None = None) -> None:
        self.executable = executable
        self.resolver_rules = resolver_rules  # --host-resolver-rules (the local sites' names)
        self._stale = False
        self.launch_timeout_s = launch_timeout_s
        self.slots = asyncio.Semaphore(max_episodes)
        self.max_episodes = max_episodes
        self.pid: int | None = None
        self.driver_pids: set[int] = set()  # Playwright's driver process
        self.launches = 0
        self._playwright: Any = None
        self._browser: Any = None
        self._lock = asyncio.Lock()

    @property
    def alive(self) -> bool:
        return self._browser is not None and self._browser.is_connected()

    async def browser(self) -> Any:
        async with self._lock:
            if not self.alive or self._stale:
                await self._launch()
            return self._browser

    async def _launch(self) -> None:
        await self._discard()
        try:
            from playwright.async_api import async_playwright
        except ModuleNotFoundError as error:
            raise ModuleNotFoundError("WebArena drives Chromium with Playwright: pip install playwright (the project's "
                                      "dev extra has it); no browser download is needed") from error

        try:
            if self._playwright is None:
                import psutil

                children = {p.pid for p in psutil.Process().children()}
                self._playwright = await asyncio.wait_for(async_playwright().start(), self.launch_timeout_s)
                self.driver_pids = {p.pid for p in psutil.Process().children()} - children
                _STARTED_PIDS.update(self.driver_pids)
            before = _descendant_browsers(self.executable)
            self._browser = await asyncio.wait_for(self._playwright.chromium.launch(
                executable_path=self.executable, headless=True, args=self._args(),
                timeout=self.launch_timeout_s * 1000, handle_sigint=False, handle_sigterm=False,
                handle_sighup=False), self.launch_timeout_s + 5)
        except Exception as error:
            raise EnvironmentFailure(f"could not launch the browser {self.executable}: {error}") from error
        self._stale = False
        new = _descendant_browsers(self.executable) - before
        # The browser is the driver's child; one of its own children caught between fork and exec (a zygote being
        # started) looks like a browser too, and with pids wrapping around (pid_max 32768) may have the lower pid.
        launched = {pid for pid in new if _parent(pid) in self.driver_pids} or new
        self.pid = min(launched) if launched else None
        if self.pid is not None:
            _STARTED_PIDS.add(self.pid)
        self.launches += 1

    def _args(self) -> list[str]:
        rules = [f"--host-resolver-rules={self.resolver_rules}"] if self.resolver_rules else []
        return [*BROWSER_ARGS, *rules]

    def use_resolver_rules(self, rules: str) -> None:
        """Map host names (the local sites'); a browser launched without them is relaunched."""
        if rules != self.resolver_rules:
            self.resolver_rules, self._stale = rules, True

    async def _discard(self) -> None:
        """Forget the current browser; kill its process if it is still there (crashed or hung)."""
        browser, self._browser = self._browser, None
        if self.pid is not None:
            _kill(self.pid)
            self.pid = None
        if browser is not None:
            try:
                await asyncio.wait_for(browser.close(), 5)
            except Exception:
                pass

    async def mark_broken(self) -> None:
        """Called after a crash or hang: kill the browser now; the next episode launches another."""
        async with self._lock:
            await self._discard()

    async def new_context(self, timeout_s: float, **options: Any) -> Any:
        browser = await self.browser()
        try:
            return await asyncio.wait_for(browser.new_context(viewport=VIEWPORT, **options), timeout_s)
        except Exception as error:
            await self.mark_broken()
            raise EnvironmentFailure(f"the browser could not open a context: {error!r}") from error

    async def close(self) -> None:
        async with self._lock:
            # Whatever the driver launched, the browser we know of or another (a launch cut short, a pid taken
            # for the browser's child): once the driver is gone they would be orphans no one can name.
            leftovers = _processes_under(self.driver_pids)
            await self._discard()
            if self._playwright is not None:
                try:
                    await asyncio.wait_for(self._playwright.stop(), 10)
                except Exception:
                    pass
                self._playwright = None
            for pid in self.driver_pids:
                _kill(pid)
            _kill_processes(leftovers)
            self.driver_pids = set()

    def abandon(self) -> None:
        """Its event loop is gone: kill the browser and the driver (they cannot be closed politely), and whatever
        else the driver launched."""
        leftovers = _processes_under(self.driver_pids)
        for pid in [self.pid, *self.driver_pids]:
            if pid is not None:
                _kill(pid)
        _kill_processes(leftovers)
        self.pid, self.driver_pids = None, set()


_HOSTS: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, BrowserHost]" = weakref.WeakKeyDictionary()
_LOOPS: list[tuple["weakref.ReferenceType[asyncio.AbstractEventLoop]", BrowserHost]] = []


def browser_host(executable: str | None, max_episodes: int, launch_timeout_s: float = 60.0,
                 resolver_rules: str | None = None) -> BrowserHost:
    """The browser of the running event loop (created on first use; its settings are the first caller's,
    except ``resolver_rules``, which a later caller may add)."""
    loop = asyncio.get_running_loop()
    host = _HOSTS.get(loop)
    if host is None:
        for ref, old in list(_LOOPS):  # browsers of loops that have ended (asyncio.run called again)
            if ref() is None or ref().is_closed():
                old.abandon()
                _LOOPS.remove((ref, old))
        host = _HOSTS[loop] = BrowserHost(find_browser(executable), max_episodes, launch_timeout_s)
        _LOOPS.append((weakref.ref(loop), host))
    if resolver_rules:
        host.use_resolver_rules(resolver_rules)
    return host


async def close_browser() -> None:
    """Close the running loop's browser (tests and programs that want no process left behind)."""
    host = _HOSTS.pop(asyncio.get_running_loop(), None)
    if host is not None:
        await host.close()
        _LOOPS[:] = [(ref, h) for ref, h in _LOOPS if h is not host]


def browser_processes(pid: int | None) -> list[Any]:
    """The browser process and its children (renderers, GPU, utility) as psutil processes."""
    import psutil

    if pid is None:
        return []
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def pss_bytes(pid: int | None) -> int:
    """Proportional set size of the browser's process tree (shared pages split fairly)."""
    total = 0
    for proc in browser_processes(pid):
        try:
            total += proc.memory_full_info().pss
        except Exception:
            pass
    return total


__all__ = ["BrowserHost", "browser_host", "close_browser", "find_browser", "pss_bytes"]
