"""WebArena in a real browser: the common async environment over Playwright and Chromium.

Settings (all optional; ``sites: local`` runs the bundled shop and forum tasks):

- ``sites``: ``"local"`` (default: this process serves a small shop as ``shopping`` and a small
  forum as ``reddit`` on 127.0.0.1, which the browser reaches as ``http://shop.test`` and
  ``http://forum.test``) or ``{site: base URL}`` for a user's own WebArena deployment
  (``shopping``, ``shopping_admin``, ``reddit``, ``gitlab``, ``wikipedia``, ``map``, ``homepage``).
- ``tasks``: a task file or directory in WebArena's format (required with a deployment; default the
  bundled ``data/local_tasks.json``). ``skip_tasks_without_sites``: drop tasks that need a site not
  configured (default: such tasks are an error at start).
- ``auth_dir`` / ``storage_states {site: file}``: where WebArena's ``./.auth/<site>_state.json``
  log-in files are.
- ``judge {url, model, api_key_env?}``: an OpenAI-compatible endpoint for ``fuzzy_match``; without
  it those tasks are unscorable and left out of the splits (``include_unscorable`` keeps them; an
  episode of one then ends in :class:`EnvironmentFailure`, never in a guessed score).
- ``max_observation_chars`` (0 = whole tree), ``viewport_only`` (True, WebArena's), ``link_urls``
  (True: links show ``url:``), ``instructions`` (``full`` | ``short`` | ``none``: the text above the
  first observation).
- ``max_concurrent_episodes`` (8: episodes of this process at once; more wait),
  ``page_load_timeout_s`` (30), ``action_timeout_s`` (15), ``browser_path`` (default: Debian's
  ``chromium-headless-shell``), ``test_every`` (2: every 2nd task is a test task).

The browser is shared by every instance in a process (one per event loop), one context per
episode. A browser that crashes or hangs raises :class:`EnvironmentFailure` and is relaunched for
the next episode; a page that does not load at reset is one too. What the agent gets wrong — a
malformed reply, an unknown id, a goto off the task's sites — is an observation saying so.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from horizonrl.envs.base import EnvironmentFailure, StepResult
import horizonrl.envs.webarena.actions as grammar
from horizonrl.envs.webarena.actions import Action, ActionError, parse_action
from horizonrl.envs.webarena.browser import browser_host
from horizonrl.envs.webarena.evaluators import Judge, Unscorable, evaluate
from horizonrl.envs.webarena.observation import Snapshot, layout_boxes, render_tree, truncate
from horizonrl.envs.webarena.tasks import (LOCAL_EXPERT, LOCAL_TASKS, PLACEHOLDERS, fill_placeholders, load_tasks,
                                           needs_judge, storage_state_path, task_category)

INSTRUCTIONS = {
    "full": ("You are an agent using a web browser to complete an objective. Each observation shows the open tabs, "
             "then the page's accessibility tree, one element per line as [id] role 'name', then the page URL, the "
             "objective and your previous action. Reply with exactly one action between triple backticks, e.g. "
             f"```click [12]```. Actions: {grammar.GRAMMAR}. Answer questions, or finish a task, with "
             "```stop [answer]```.\n\n"),
    "short": "Reply with one action in triple backticks, e.g. ```click [12]```; finish with ```stop [answer]```.\n\n",
    "none": "",
}
CLICKABLE = frozenset({"link", "button", "checkbox", "radio", "tab", "menuitem", "option", "combobox"})
TYPEABLE = frozenset({"textbox", "searchbox", "combobox"})
_REACHABLE: dict[str, str | None] = {}  # base URL -> None when reachable, else the error (per process)


class AgentError(Exception):
    """Something the agent got wrong; the message goes into the observation."""


def check_reachable(site: str, url: str, timeout_s: float = 10.0) -> None:
    """Fail at start, with the site's name, when a configured site does not answer (cached per process)."""
    if url not in _REACHABLE:
        try:
            with urllib.request.urlopen(url, timeout=timeout_s):
                _REACHABLE[url] = None
        except urllib.error.HTTPError:
            _REACHABLE[url] = None  # it answers (a login redirect or 404 page is fine)
        except Exception as error:  # noqa: BLE001 - any reason makes the same clear error
            _REACHABLE[url] = repr(error)
    if _REACHABLE[url] is not None:
        raise ValueError(f"WebArena site {site!r} at {url} is not reachable ({_REACHABLE[url]}); start the site or "
                         "fix the webarena setting sites")


class WebArenaEnv:
    """One WebArena episode at a time in its own browser context (see the module docstring)."""

    name = "webarena"
    reply_format = "backticks"  # the action is between ``` ``` (the server passes bare actions through unchanged)

    def __init__(self, sites: str | dict[str, str] = "local", tasks: str | None = None, expert: str | None = None,
                 auth_dir: str | None = None, storage_states: dict[str, str] | None = None,
                 judge: dict[str, Any] | None = None, max_observation_chars: int = 0, viewport_only: bool = True,
                 link_urls: bool = True, instructions: str = "full", max_concurrent_episodes: int = 8,
                 page_load_timeout_s: float = 30.0, action_timeout_s: float = 15.0, browser_path: str | None = None,
                 test_every: int = 2, include_unscorable: bool = False, skip_tasks_without_sites: bool = False,
                 episode_wait_timeout_s: float = 600.0) -> None:
        if instructions not in INSTRUCTIONS:
            raise ValueError(f"instructions must be one of {sorted(INSTRUCTIONS)}, got {instructions!r}")
        if test_every < 2:
            raise ValueError("test_every must be >= 2 (every n-th task is a test task)")
        self.local = None
        if sites == "local":
            from horizonrl.envs.webarena.sites import local_sites

            self.local = local_sites()
            self.urls = dict(self.local.urls)
            auth_dir = auth_dir or str(self.local.auth_dir)
            tasks = tasks or str(LOCAL_TASKS)
            expert = expert or (str(LOCAL_EXPERT) if tasks == str(LOCAL_TASKS) else None)
        elif isinstance(sites, dict) and sites:
            unknown = set(sites) - set(PLACEHOLDERS)
            if unknown:
                raise ValueError(f"unknown WebArena sites {sorted(unknown)}; known: {sorted(PLACEHOLDERS)}")
            self.urls = {k: str(v).rstrip("/") for k, v in sites.items()}
            if tasks is None:
                raise ValueError("with your own WebArena sites, set tasks: WebArena's config_files directory or a "
                                 "JSON list of tasks (e.g. test.raw.json)")
        else:
            raise ValueError("sites must be 'local' or a mapping {site: base URL}")
        self.judge = Judge(**judge) if judge else None
        all_tasks = load_tasks(tasks)
        missing = {s for t in all_tasks for s in t.get("sites", []) if s not in self.urls}
        if missing and not skip_tasks_without_sites:
            raise ValueError(f"WebArena tasks need sites that are not configured: {sorted(missing)}; add their URLs to "
                             "sites, or set skip_tasks_without_sites: true")
        usable = [t for t in all_tasks if set(t.get("sites", [])) <= set(self.urls)]
        if not include_unscorable and self.judge is None:
            usable = [t for t in usable if not needs_judge(t)]
        if not usable:
            raise ValueError("no WebArena task is usable with these sites and settings")
        if self.local is None:
            for site in sorted({s for t in usable for s in t.get("sites", [])}):
                check_reachable(site, self.urls[site])
        self.tasks = usable
        self.expert_plans: dict[str, list[dict[str, Any]]] = json.loads(Path(expert).read_text()) if expert else {}
        self.auth_dir, self.storage_states = auth_dir, storage_states
        self.max_observation_chars, self.viewport_only, self.link_urls = max_observation_chars, viewport_only, link_urls
        self.instructions = INSTRUCTIONS[instructions]
        self.max_concurrent_episodes = max_concurrent_episodes
        self.page_load_timeout_s, self.action_timeout_s = page_load_timeout_s, action_timeout_s
        self.browser_path, self.test_every = browser_path, test_every
        self.episode_wait_timeout_s = episode_wait_timeout_s
        self._origins = {_origin(u) for u in self.urls.values()}
        self._host: Any = None
        self._context: Any = None
        self._pages: list[Any] = []
        self._active = 0
        self._cdp: dict[Any, Any] = {}
        self._navigations: dict[Any, int] = {}  # navigation requests of each tab's main frame
        self._loads: dict[Any, int] = {}  # load events of each tab
        self._sandbox: str | None = None
        self._slot = False
        self._evaluating = False
        self.task: dict[str, Any] | None = None
        self.task_id: int | None = None
        self.snapshot = Snapshot("")
        self._done = True
        self._success = False
        self._last_page_text = ""

    # -------------------------------------------------------------- ids
    @property
    def num_tasks(self) -> int:
        return len(self.tasks)

    def task_ids(self, split: str) -> list[int]:
        if split == "train":
            return [i for i in range(self.num_tasks) if i % self.test_every != 0]
        if split == "test":
            return [i for i in range(self.num_tasks) if i % self.test_every == 0]
        raise ValueError(f"unknown split {split!r}; use 'train' or 'test'")

    def task_category(self, task_id: int) -> str:
        return task_category(self.tasks[task_id])

    # ---------------------------------------------------------- episode
    async def reset(self, task_id: int) -> str:
        if not isinstance(task_id, int) or isinstance(task_id, bool) or not 0 <= task_id < self.num_tasks:
            raise ValueError(f"webarena task id must be an integer in 0..{self.num_tasks - 1}, got {task_id!r}")
        self._done = True  # until this reset has succeeded
        await self._end_episode()
        self.task, self.task_id = self.tasks[task_id], task_id
        self._host = browser_host(self.browser_path, self.max_concurrent_episodes,
                                  resolver_rules=self.local.resolver_rules if self.local is not None else None)
        try:
            await asyncio.wait_for(self._host.slots.acquire(), self.episode_wait_timeout_s)
        except asyncio.TimeoutError as error:
            raise EnvironmentFailure(f"no browser slot free within {self.episode_wait_timeout_s:.0f} s "
                                     f"({self._host.max_episodes} episodes at once)") from error
        self._slot = True
        try:
            await self._open_context()
            start_urls = [fill_placeholders(u.strip(), self.urls) for u in self.task["start_url"].split(" |AND| ")]
            for index, url in enumerate(start_urls):
                page = self._pages[0] if index == 0 else await self._guard(self._context.new_page(), "new tab")
                try:
                    await self._guard(page.goto(url, wait_until="load", timeout=self.page_load_timeout_s * 1000),
                                      "loading the start page", self.page_load_timeout_s)
                except AgentError as error:  # the start page itself does not load: the site's fault
                    raise EnvironmentFailure(f"task {task_id}: the start page {url} did not load: {error}") from error
            self._active = 0
            await self._guard(self._pages[0].bring_to_front(), "focusing the tab")
            observation = await self._observe("None")
        except BaseException:
            await self._end_episode()
            raise
        self._done, self._success = False, False
        return self.instructions + observation

    async def step(self, action_text: str) -> StepResult:
        if self._done or self.task is None:
            return StepResult("The episode is over; no more actions are accepted.", 0.0, True, self._success,
                              float(self._success), {"invalid_action": True})
        try:
            action = parse_action(action_text or "")
        except ActionError as error:
            return self._feedback(str(error), grammar.extract(action_text or "") or "(no action)")
        if action.name == "stop":
            return await self._stop(action.text)
        try:
            note = await self._apply(action)
        except AgentError as error:
            return self._feedback(str(error), str(action))
        observation = await self._observe(str(action) + (f" ({note})" if note else ""))
        return StepResult(observation, 0.0, False, info={"invalid_action": False})

    async def close(self) -> None:
        await self._end_episode()
        self._done = True

    # ------------------------------------------------------------ actions
    async def _apply(self, action: Action) -> str:
        """Carry out ``action`` on the active tab; returns a note for PREVIOUS ACTION ('' if none)."""
        page = self._pages[self._active]
        name = action.name
        if name in ("click", "hover", "type"):
            x, y = await self._point(action.element)
            if name == "hover":
                await self._guard(page.mouse.move(x, y), "hover")
                return ""
            before = self._navigations.get(page, 0)
            await self._guard(page.mouse.click(x, y), name)
            if name == "type":
                await self._guard(page.keyboard.press("Control+a"), "type")
                await self._guard(page.keyboard.press("Delete"), "type")
                await self._guard(page.keyboard.type(action.text), "type")
                if action.enter:
                    await self._guard(page.keyboard.press("Enter"), "type")
            return await self._settle(page, before)
        if name == "press":
            before = self._navigations.get(page, 0)
            await self._guard(page.keyboard.press(action.text), "press")
            return await self._settle(page, before)
        if name == "scroll":
            sign = 1 if action.text == "down" else -1
            await self._guard(page.evaluate(f"window.scrollBy(0, {sign} * window.innerHeight * 0.8)"), "scroll")
            return ""
        if name == "goto":
            url = urllib.parse.urljoin(page.url, action.text)
            if _origin(url) not in self._origins:
                raise AgentError(f"{action.text} is outside the sites of this task; stay on "
                                 f"{', '.join(sorted(self.urls.values()))}")
            return await self._navigate(page.goto(url, wait_until="load", timeout=self.page_load_timeout_s * 1000),
                                        page)
        if name in ("go_back", "go_forward"):
            call = page.go_back if name == "go_back" else page.go_forward
            return await self._navigate(call(wait_until="load", timeout=self.page_load_timeout_s * 1000), page)
        if name == "new_tab":
            self._add_page(await self._guard(self._context.new_page(), "new tab"))
            self._active = len(self._pages) - 1
            return ""
        if name == "tab_focus":
            index = int(action.text)
            if not 0 <= index < len(self._pages):
                raise AgentError(f"there is no tab {index}; open tabs: 0..{len(self._pages) - 1}")
            self._active = index
            await self._guard(self._pages[index].bring_to_front(), "tab_focus")
            return ""
        if name == "close_tab":
            closing = self._pages.pop(self._active)
            self._cdp.pop(closing, None)
            await self._guard(closing.close(), "close_tab")
            if not self._pages:
                self._add_page(await self._guard(self._context.new_page(), "new tab"))
            self._active = len(self._pages) - 1
            return ""
        raise AgentError(f"unknown action {name}")

    async def _point(self, element: int | None) -> tuple[float, float]:
        node = self.snapshot.nodes.get(element or -1)
        if node is None or node.backend_id is None:
            raise AgentError(f"there is no element [{element}] on this page; use an id shown in the observation")
        cdp = await self._cdp_session(self._pages[self._active])
        try:
            await self._guard(cdp.send("DOM.scrollIntoViewIfNeeded", {"backendNodeId": node.backend_id}), "scroll")
        except AgentError:
            pass  # text nodes cannot always be scrolled to; their quads still tell where they are
        quads = (await self._guard(cdp.send("DOM.getContentQuads", {"backendNodeId": node.backend_id}),
                                   f"locating [{element}]")).get("quads") or []
        if not quads:
            raise AgentError(f"element [{element}] ({node.role} {node.name!r}) is not visible and cannot be used")
        quad = quads[0]
        return sum(quad[0::2]) / 4, sum(quad[1::2]) / 4

    async def _settle(self, page: Any, before: int, grace_s: float = 0.25) -> str:
        """After an input that may navigate: if it started a navigation, wait for the new document's
        ``load`` event (counted per page; Playwright's wait_for_load_state would see the old one).

        Whether it started one is known only from the navigation request's event, which comes some time after the
        input. So the grace starts once the page itself has run a task queued after the input's (its default action,
        a link's navigation, comes first), and lasts at least four times that round trip: on a loaded machine the
        renderer and the browser are slow alike, and a fixed 0.25 s from the click missed a link's navigation (the
        observation was the old page's: `env check --server` counted a mismatch under a full test run)."""
        loop = asyncio.get_running_loop()
        loads = self._loads.get(page, 0)
        started = loop.time()
        with contextlib.suppress(Exception):  # the document may be gone already: a navigation, which is counted
            await asyncio.wait_for(page.evaluate("() => new Promise(r => setTimeout(r, 0))"), self.action_timeout_s)
        round_trip = loop.time() - started
        deadline = loop.time() + max(grace_s, 4 * round_trip)
        while self._navigations.get(page, 0) == before and loop.time() < deadline:
            await asyncio.sleep(0.01)
        if self._navigations.get(page, 0) == before:
            return ""
        deadline = loop.time() + self.page_load_timeout_s
        while self._loads.get(page, 0) == loads:
            if loop.time() > deadline:
                await self._stop_loading(page)
                return f"the page did not finish loading within {self.page_load_timeout_s:.0f} s"
            if not self._host.alive:
                await self._host.mark_broken()
                raise EnvironmentFailure("the browser died while a page was loading")
            await asyncio.sleep(0.01)
        return ""

    async def _navigate(self, call: Any, page: Any) -> str:
        try:
            await self._guard(call, "navigation", self.page_load_timeout_s)
        except AgentError as error:
            await self._stop_loading(page)
            return f"the page did not finish loading: {str(error).splitlines()[0][:200]}"
        return ""

    async def _stop_loading(self, page: Any) -> None:
        """Give up a navigation that does not finish; the page keeps its last document (a pending
        navigation would block reading the accessibility tree)."""
        cdp = await self._cdp_session(page)
        try:
            await self._guard(cdp.send("Page.stopLoading"), "stopping the page load")
        except AgentError:
            pass

    async def _stop(self, answer: str) -> StepResult:
        page = self._pages[self._active]
        self._evaluating = True
        try:
            score = await evaluate(self.task, answer, page.url, self.urls, self._fetch, self.judge)
        except Unscorable as error:
            self._done = True
            raise EnvironmentFailure(f"webarena task {self.task_id} is unscorable here: {error}") from error
        except AgentError as error:
            raise EnvironmentFailure(f"evaluating webarena task {self.task_id} failed: {error}") from error
        finally:
            self._evaluating = False
        self._done, self._success = True, score >= 1.0
        return StepResult(f"The episode ended with the answer {answer!r}.", score, True, self._success, score,
                          {"invalid_action": False, "answer": answer})

    async def _fetch(self, url: str, locator: str) -> str:
        """The text a program_html check reads: ``locator`` (a JS expression) evaluated on ``url``."""
        current = self._pages[self._active]
        page = current if url == current.url else await self._guard(self._context.new_page(), "evaluation tab")
        try:
            if page is not current:
                await self._guard(page.goto(url, wait_until="load", timeout=self.page_load_timeout_s * 1000),
                                  "loading the evaluation page", self.page_load_timeout_s)
            if not locator.strip():
                text = await self._guard(page.evaluate("document.body ? document.body.innerText : ''"), "evaluation")
                return text + "\n" + await self._guard(page.content(), "evaluation")
            try:
                value = await self._guard(page.evaluate(f"() => {{ try {{ return String({locator}); }} "
                                                        "catch (e) { return ''; } }"), "evaluation")
            except AgentError:
                value = ""
            return value or ""
        finally:
            if page is not current:
                await self._guard(page.close(), "closing the evaluation tab")

    # -------------------------------------------------------- observation
    async def _observe(self, previous: str) -> str:
        page = self._pages[self._active]
        cdp = await self._cdp_session(page)
        tree = await self._guard(cdp.send("Accessibility.getFullAXTree"), "reading the page")
        boxes = viewport = None
        if self.viewport_only:
            snap = await self._guard(cdp.send("DOMSnapshot.captureSnapshot", {"computedStyles": []}),
                                     "reading the layout")
            boxes = layout_boxes(snap)
            viewport = tuple(await self._guard(page.evaluate(
                "[window.scrollX, window.scrollY, window.innerWidth, window.innerHeight]"), "reading the viewport"))
        snapshot = render_tree(tree.get("nodes", []), boxes, viewport, self.link_urls)
        text, cut = truncate(snapshot.text, self.max_observation_chars)
        if cut:
            shown = {int(line.strip()[1:].split("]", 1)[0]) for line in text.splitlines() if line.strip()}
            snapshot.nodes = {k: v for k, v in snapshot.nodes.items() if k in shown}
            text += f"\n... ({cut} more lines; scroll down or use ids above)"
        self.snapshot = snapshot
        titles = []
        for index, tab in enumerate(self._pages):
            title = await self._guard(tab.title(), "reading the title")
            titles.append(f"Tab {index}{' (current)' if index == self._active else ''}: {title}")
        self._last_page_text = f"{' | '.join(titles)}\n\n{text}"
        return self._format(page.url, previous)

    def _format(self, url: str, previous: str) -> str:
        return (f"OBSERVATION:\n{self._last_page_text}\nURL: {url}\nOBJECTIVE: {self.task['intent']}\n"
                f"PREVIOUS ACTION: {previous}")

    def _feedback(self, message: str, action: str) -> StepResult:
        """The current page again, with what was wrong in PREVIOUS ACTION."""
        url = self._pages[self._active].url if self._pages else ""
        observation = self._format(url, f"{action} (failed: {message})")
        return StepResult(observation, 0.0, False, info={"invalid_action": True, "error": message})

    # ------------------------------------------------------------ browser
    async def _open_context(self) -> None:
        options: dict[str, Any] = {}
        state = storage_state_path(self.task, self.auth_dir, self.storage_states) \
            if self.task.get("require_login", bool(self.task.get("storage_state"))) else None
        if state is not None:
            if not state.is_file():
                raise ValueError(f"task {self.task['task_id']}: storage state {state} does not exist")
            options["storage_state"] = str(state)
        self._context = await self._host.new_context(self.action_timeout_s + 10, **options)
        self._context.set_default_timeout(self.action_timeout_s * 1000)
        self._context.set_default_navigation_timeout(self.page_load_timeout_s * 1000)
        if self.local is not None:
            from horizonrl.envs.webarena.sites import SANDBOX_COOKIE

            self._sandbox = await asyncio.to_thread(self.local.new_sandbox)
            await self._guard(self._context.add_cookies(
                [{"name": SANDBOX_COOKIE, "value": self._sandbox, "url": url} for url in self.urls.values()]),
                "cookies")
        await self._guard(self._context.route("**/*", self._route), "routing")
        self._context.on("page", self._on_page)
        self._pages, self._active = [], 0
        self._add_page(await self._guard(self._context.new_page(), "new tab"))

    def _add_page(self, page: Any) -> None:
        if page in self._pages:
            return
        self._pages.append(page)
        self._navigations[page] = 0
        self._loads[page] = 0

        def on_load(_: Any) -> None:
            self._loads[page] = self._loads.get(page, 0) + 1

        page.on("load", on_load)

        def on_request(request: Any) -> None:
            if request.is_navigation_request() and request.frame == page.main_frame:
                self._navigations[page] = self._navigations.get(page, 0) + 1

        page.on("request", on_request)

    def _on_page(self, page: Any) -> None:
        if not self._evaluating and page not in self._pages:  # a link that opens a new tab: follow it
            self._add_page(page)
            self._active = len(self._pages) - 1

    async def _route(self, route: Any) -> None:
        url = route.request.url
        if url.startswith(("data:", "about:", "blob:")) or _origin(url) in self._origins:
            await route.continue_()
        else:  # off the task's sites: the machine is offline and the agent must stay on the sites
            await route.abort("blockedbyclient")

    async def _cdp_session(self, page: Any) -> Any:
        if page not in self._cdp:
            self._cdp[page] = await self._guard(self._context.new_cdp_session(page), "opening a CDP session")
        return self._cdp[page]

    async def _guard(self, call: Any, what: str, timeout_s: float | None = None) -> Any:
        """Await a browser call with a deadline. A hung or dead browser -> EnvironmentFailure (and the
        browser is killed and relaunched later); Playwright's own errors and timeouts -> AgentError."""
        from playwright.async_api import Error as PlaywrightError

        deadline = (timeout_s or self.action_timeout_s) + 10
        try:
            return await asyncio.wait_for(call, deadline)
        except asyncio.TimeoutError as error:
            await self._host.mark_broken()
            raise EnvironmentFailure(f"the browser did not answer within {deadline:.0f} s ({what}): "
                                     "killed, it will be relaunched") from error
        except PlaywrightError as error:
            message = str(error)
            if not self._host.alive or _browser_gone(message):
                await self._host.mark_broken()
                raise EnvironmentFailure(f"the browser died ({what}): {message.splitlines()[0]}") from error
            raise AgentError(f"{what} failed: {message.splitlines()[0][:300]}") from error

    async def _end_episode(self) -> None:
        context, self._context = self._context, None
        self._pages, self._cdp, self._navigations, self._loads = [], {}, {}, {}
        if context is not None:
            try:
                await asyncio.wait_for(context.close(), 10)
            except Exception:
                pass  # a dead browser's contexts are gone with it
        if self._sandbox is not None and self.local is not None:
            await asyncio.to_thread(self.local.drop_sandbox, self._sandbox)
        self._sandbox = None
        if self._slot:
            self._host.slots.release()
            self._slot = False

    # ---------------------------------------------------------- policies
    def random_action(self, rng: random.Random) -> str:
        """A well-formed action on the current page, uniformly among its elements (and a few globals)."""
        choices: list[str] = ["scroll [down]", "scroll [up]", "go_back"]
        words = [n.name.split()[0] for n in self.snapshot.nodes.values() if n.name.strip()][:40] or ["yes"]
        for nid, node in self.snapshot.nodes.items():
            if node.role in TYPEABLE:
                choices.append(f"type [{nid}] [{rng.choice(words)}] [1]")
            elif node.role in CLICKABLE:
                choices.append(f"click [{nid}]")
        if rng.random() < 0.15:
            return f"```stop [{rng.choice(words)}]```"
        return f"```{rng.choice(choices)}```"

    def expert_action(self, state: int | None = None) -> tuple[str, int]:
        """The scripted expert's next reply for a local task (its plan step resolved against the ids on
        the current page) and the state to pass next time."""
        index = state or 0
        plan = self.expert_plans.get(str(self.task["task_id"]))
        if plan is None:
            raise ValueError(f"webarena task {self.task['task_id']} has no expert plan")
        if index >= len(plan):
            return "```stop []```", index + 1
        return f"```{self._resolve(plan[index])}```", index + 1

    def _resolve(self, step: dict[str, Any]) -> str:
        kind, target = next(iter(step.items()))
        if kind in ("click", "hover", "type"):
            role, name = target
            found = [nid for nid, n in self.snapshot.nodes.items() if n.role == role and n.name == name]
            if not found:
                raise RuntimeError(f"expert for task {self.task['task_id']}: no {role} {name!r} on the page")
            if kind == "type":
                return f"type [{found[0]}] [{step['text']}] [{step.get('enter', 1)}]"
            return f"{kind} [{found[0]}]"
        if kind == "goto":
            return f"goto [{fill_placeholders(target, self.urls)}]"
        return f"{kind} [{target}]" if target is not None else kind


def _origin(url: str) -> str:
    parts = urllib.parse.urlparse(url)
    return f"{parts.scheme}://{parts.netloc}".lower()


def _browser_gone(message: str) -> bool:
    lowered = message.lower()
    return any(s in lowered for s in ("browser has been closed", "target page, context or browser has been closed",
                                      "connection closed", "browser closed", "page crashed", "target crashed",
                                      "websocket", "has been disconnected"))
