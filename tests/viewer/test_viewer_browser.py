"""The viewer in a real headless Chromium (Debian's chromium-headless-shell, driven by Playwright)
on a real recorded CPU run: a short BabyAI training run with the tiny model (every group recorded)
plus an evaluation recorded into the same directory whose tiny context makes its episodes fail
(prompt_too_long) — conftest.py's ``recorded_babyai_run``, shared with the whole-loop BabyAI test.

Through the page's own controls: filter to failures, open an episode, step through its turns with
the next button; the BabyAI image loads at every turn; the learner-step link leads to the episodes
that step trained on; early vs late shows two grids; an episode appended to the files appears in
the open list page. Screenshots go to the test's directory (and ``$HORIZONRL_ARTIFACTS/viewer``)
and are checked for content. A missing browser is a failure that says how to install it."""

from __future__ import annotations

import json
import os
import re
import shutil
import urllib.request
from pathlib import Path

import pytest
from helpers import horizonrl_cmd, start_process, stop_process, wait_until
from PIL import Image

pytestmark = [pytest.mark.slow, pytest.mark.system]  # Chromium

CHROMIUM_CANDIDATES = ("/usr/bin/chromium-headless-shell", "/usr/lib/chromium/chromium-headless-shell")
TIMEOUT_MS = 30_000


def chromium_path() -> str:
    for candidate in (os.environ.get("HORIZONRL_CHROMIUM", ""), shutil.which("chromium-headless-shell") or "",
                      *CHROMIUM_CANDIDATES):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    pytest.fail("no headless Chromium: install Debian's chromium-headless-shell (`make system-deps` as root, or "
                "`apt-get install chromium-headless-shell`), or point HORIZONRL_CHROMIUM at a Chromium binary; "
                "Playwright is never allowed to download one", pytrace=False)


@pytest.fixture(scope="module")
def recorded_run(recorded_babyai_run, tmp_path_factory) -> Path:
    """A copy of the session's recorded BabyAI run (conftest.py): this test appends an episode to its files."""
    copy = tmp_path_factory.mktemp("viewed") / "run"
    shutil.copytree(recorded_babyai_run, copy)
    return copy


@pytest.fixture
def viewer_url(recorded_run, tmp_path):
    log = tmp_path / "view.log"
    proc = start_process(horizonrl_cmd("view", str(recorded_run), "--port", "0"), log)
    try:
        yield wait_until(lambda: re.search(r"http://127\.0\.0\.1:\d+/", log.read_text()), 60,
                         "the viewer's URL").group(0)
    finally:
        stop_process(proc)


@pytest.fixture
def page(tmp_path):
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("playwright is not installed: `.venv/bin/pip install -e '.[dev]'`", pytrace=False)
    executable = chromium_path()
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, timeout=TIMEOUT_MS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(TIMEOUT_MS)
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            yield page
            assert not errors, f"script errors in the page: {errors}"
        finally:
            browser.close()


class Shots:
    """Screenshots into the test's directory, copied to $HORIZONRL_ARTIFACTS/viewer when it is set."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.paths: list[Path] = []

    def take(self, page, name: str) -> Path:
        path = self.directory / f"{len(self.paths):02d}-{name}.png"
        page.screenshot(path=str(path), full_page=False)
        self.paths.append(path)
        artifacts = os.environ.get("HORIZONRL_ARTIFACTS")
        if artifacts:
            target = Path(artifacts) / "viewer"
            target.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, target / path.name)
        return path


def colours_in(path: Path, box: dict | None = None) -> int:
    image = Image.open(path).convert("RGB")
    if box is not None:
        image = image.crop((int(box["x"]), int(box["y"]), int(box["x"] + box["width"]),
                            int(box["y"] + box["height"])))
    return len(image.getcolors(1 << 20))


def record_of(url: str, key: str) -> dict:
    with urllib.request.urlopen(f"{url}api/episode/{key}", timeout=10) as response:
        return json.loads(response.read())


def current_frame(page):
    """The BabyAI image of the turn shown, once the browser has it decoded."""
    image = page.locator(".replay .position.current img.frame")
    image.wait_for()
    page.wait_for_function("""() => { const img = document.querySelector('.replay .position.current img.frame');
                                      return img && img.complete && img.naturalWidth > 0; }""")
    return image


def apply_filters(page, **values: str) -> None:
    for name, value in values.items():
        control = page.locator(f"#filter-{name}")
        if control.evaluate("e => e.tagName") == "SELECT":
            control.select_option(value)
        else:
            control.fill(value)
    with page.expect_navigation():
        page.click("#apply-filters")


def test_browse_filter_and_replay_a_recorded_run(viewer_url, recorded_run, page, tmp_path):
    shots = Shots(tmp_path)
    page.goto(viewer_url)
    assert page.locator("#episodes tbody tr").count() > 10
    page.wait_for_function("() => document.getElementById('live').textContent.startsWith('live')")
    shots.take(page, "list")

    # failures, through the form
    apply_filters(page, outcome="failed")
    assert "outcome=failed" in page.url
    outcomes = page.locator("#episodes tbody td.outcome").all_inner_texts()
    assert outcomes and all("failed" in o for o in outcomes)
    apply_filters(page, failure="prompt_too_long")
    failures = page.locator("#episodes tbody td.failure").all_inner_texts()
    assert len(failures) == 2 and set(failures) == {"prompt_too_long"}
    shots.take(page, "failures-prompt-too-long")
    page.locator("#episodes tbody a.episode-link").first.click()
    page.wait_for_load_state()
    key = page.url.rsplit("/", 1)[-1].split("?")[0]
    record = record_of(viewer_url, key)
    assert record["failure"] == "prompt_too_long" and record["evaluation"] is True
    assert record["first_observation"] in page.locator(".position.current pre.observation").inner_text()
    assert "prompt_too_long" in page.locator("dl.facts").inner_text()
    current_frame(page)  # the task's start is drawn even though the model never played it
    shots.take(page, "failed-episode")

    # a failed episode the model played for several turns
    page.go_back()
    apply_filters(page, failure="none", turns_min="3", step_min="1")  # trained on by some learner step
    page.locator("#episodes tbody a.episode-link").first.click()
    page.wait_for_load_state()
    key = page.url.rsplit("/", 1)[-1].split("?")[0]
    record = record_of(viewer_url, key)
    turns = record["turns"]
    assert not record["success"] and len(turns) >= 3
    assert page.locator("#position").inner_text().startswith("Start")
    assert page.locator(".position.current pre.observation").inner_text() == record["first_observation"].strip()
    frame = current_frame(page)
    start = shots.take(page, "episode-start")
    assert colours_in(start, frame.bounding_box()) > 4  # walls, floor, the agent, the ball: not a blank

    sources = {frame.get_attribute("src")}
    for k, turn in enumerate(turns, start=1):
        page.click("#next")
        assert page.locator("#position").inner_text() == f"Turn {k} of {len(turns)}"
        shown = page.locator(".replay .position.current")
        assert shown.get_attribute("data-position") == str(k)
        assert shown.locator("pre.reply").inner_text() == turn["reply"].strip()
        assert shown.locator("pre.observation").inner_text() == turn["observation"].strip()
        frame = current_frame(page)
        sources.add(frame.get_attribute("src"))
        if k in (1, len(turns)):
            shot = shots.take(page, f"episode-turn-{k}")
            assert colours_in(shot, frame.bounding_box()) > 4
    assert len(sources) == len(turns) + 1  # a frame of its own at every turn
    assert "disabled" in page.locator("#next").get_attribute("class")
    assert f"turn={len(turns)}" in page.url
    page.keyboard.press("ArrowLeft")
    assert page.locator("#position").inner_text() == f"Turn {len(turns) - 1} of {len(turns)}"

    # the learner step that trained on it, and the episodes of that step
    assert record["trained_step"] is not None
    page.click(f'dl.facts a[href="/step/{record["trained_step"]}"]')
    page.wait_for_load_state()
    assert page.locator("h1").inner_text() == f"Learner step {record['trained_step']}"
    step_keys = page.locator("#episodes tbody tr").evaluate_all("rows => rows.map(r => r.dataset.key)")
    assert key in step_keys and len(step_keys) >= 8  # a group of 8 at least
    shots.take(page, "learner-step")

    # the same task early and late in training
    page.goto(viewer_url + "compare")
    assert page.locator("#tasks a").count() > 0, "the run recorded no task at two policy versions"
    page.locator("#tasks a").first.click()
    page.wait_for_load_state()
    titles = page.locator(".side h2").all_inner_texts()
    assert len(titles) == 2 and titles[0].startswith("Earlier") and titles[1].startswith("Later")
    assert titles[0].split(": ")[1] != titles[1].split(": ")[1]  # played by different policy versions
    page.wait_for_function("""() => Array.from(document.querySelectorAll('.position.current img.frame'))
                                    .filter(img => img.complete && img.naturalWidth > 0).length === 2""")
    page.click("#next")
    page.wait_for_function("""() => Array.from(document.querySelectorAll('.position.current img.frame'))
                                    .filter(img => img.complete && img.naturalWidth > 0).length === 2""")
    shots.take(page, "early-vs-late")

    # an episode recorded while the page is open appears at the top of the list
    page.goto(viewer_url + "?env=babyai")
    page.wait_for_function("() => document.getElementById('live').textContent.startsWith('live')")
    parts = sorted((recorded_run / "episodes").glob("episodes-*.jsonl"))
    line = json.loads(parts[-1].read_text().splitlines()[0])
    line = {**line, "trajectory_id": "arrived-while-watching", "group_id": "arrived"}
    with open(parts[-1], "a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")
    page.wait_for_selector('#episodes tbody tr[data-key="arrived-while-watching"]', timeout=15_000)
    assert page.locator("#episodes tbody tr").first.get_attribute("data-key") == "arrived-while-watching"
    shots.take(page, "live-update")

    print("screenshots:", *[str(p) for p in shots.paths], sep="\n  ")
