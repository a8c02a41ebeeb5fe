"""The viewer over HTTP, without a browser: filters from query parameters, the learner-step pages,
live updates through the JSON endpoint, replays (BabyAI frames, TextCraft inventory, SciWorld score),
the comparison page, and the command itself (its errors, its URL, its clean exit on SIGTERM and SIGINT)."""

from __future__ import annotations

import asyncio
import io
import json
import re
import signal
import subprocess
import time

import msgspec
import pytest
from aiohttp.test_utils import TestClient, TestServer
from helpers import BABYAI_SETTINGS, horizonrl_cmd, make_trajectory, start_process, stop_process, wait_until
from PIL import Image
from viewer_records import played_record, synthetic_record

from horizonrl.core.episode_records import EpisodeRecordWriter, episode_record, trained_record
from horizonrl.protocol import EpisodeText
from horizonrl.protocol.arrays import LOGPROB_DTYPE, MASK_DTYPE, TOKEN_DTYPE, pack
from horizonrl.protocol.validation import trajectory_problem
from horizonrl.apps.viewer.server import make_app

BABYAI_REPLIES = ["Action: turn left", "Thought: go.\nAction: move forward", "no action at all", "Action: turn right"]


def row_keys(page: str) -> list[str]:
    return re.findall(r'<tr data-key="([^"]+)"', page)


@pytest.fixture
def records(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    # the run's settings: the viewer replays BabyAI episodes with them
    (run_dir / "config.yaml").write_text(f"envs:\n  - name: babyai\n    settings: {json.dumps(BABYAI_SETTINGS)}\n")
    writer = EpisodeRecordWriter(run_dir / "episodes")
    writer.write(played_record("babyai", 3, BABYAI_REPLIES, group="g1", version=0))
    writer.write(played_record("babyai", 3, BABYAI_REPLIES[:2], group="g2", version=2))
    writer.write(synthetic_record("g3", 0, env="sciworld", task_id=9, turns=3, rewards=[0.25, 0.0, 0.5],
                                  versions=[1, 1, 1]))
    writer.write(synthetic_record("e1", 0, env="babyai", task_id=0, failure="prompt_too_long", turns=0,
                                  evaluation=True, first_observation="Goal: go to the red ball"))
    writer.write(trained_record(1, ["g1", "g3"]))
    writer.write(trained_record(2, ["g2"]))
    yield run_dir, writer
    writer.close()


@pytest.fixture
async def client(records):
    run_dir, _ = records
    async with TestClient(TestServer(make_app(run_dir / "episodes"))) as c:
        yield c


async def text_of(client, url: str, status: int = 200) -> str:
    response = await client.get(url)
    assert response.status == status, url
    return await response.text()


async def test_list_filters_come_from_query_parameters(client):
    assert row_keys(await text_of(client, "/")) == ["e1-0", "g3-0", "g2-0", "g1-0"]
    assert row_keys(await text_of(client, "/?outcome=failed&failure=prompt_too_long")) == ["e1-0"]
    assert row_keys(await text_of(client, "/?env=babyai&kind=training")) == ["g2-0", "g1-0"]
    assert row_keys(await text_of(client, "/?step_min=2&step_max=2")) == ["g2-0"]
    assert row_keys(await text_of(client, "/?turns_min=3")) == ["g3-0", "g1-0"]
    assert row_keys(await text_of(client, "/?version_min=1&version_max=1")) == ["g3-0"]
    assert row_keys(await text_of(client, "/?q=move+forward")) == ["g2-0", "g1-0"]
    page = await text_of(client, "/?turns_min=x")
    assert "turns_min must be a whole number" in page and len(row_keys(page)) == 4
    # the form shows the filters it applied
    assert '<option value="prompt_too_long" selected>' in await text_of(client, "/?failure=prompt_too_long")


async def test_learner_steps_link_to_the_episodes_they_trained_on(client):
    steps = await text_of(client, "/steps")
    assert 'href="/step/1"' in steps and 'href="/step/2"' in steps
    assert row_keys(await text_of(client, "/step/1")) == ["g3-0", "g1-0"]
    assert row_keys(await text_of(client, "/step/2")) == ["g2-0"]
    assert row_keys(await text_of(client, "/step/9")) == []
    episode = await text_of(client, "/episode/g2-0")
    assert '<a href="/step/2">step 2</a>' in episode


async def test_new_episodes_appear_through_the_json_endpoint(client, records):
    _, writer = records
    first = await (await client.get("/api/episodes?failure=none&format=rows")).json()
    assert first["total"] == 3 and first["latest"] == 3
    writer.write(synthetic_record("g4", 0, env="babyai", task_id=5, turns=1))
    writer.write(synthetic_record("g5", 0, env="babyai", task_id=5, failure="timeout", turns=1))
    body = await wait_for_episodes(client, f"/api/episodes?failure=none&format=rows&after={first['latest']}")
    assert body["total"] == 4 and body["latest"] == 5 and body["indexed"] == 6
    assert [row_keys(r)[0] for r in body["rows"]] == ["g4-0"]  # the timeout is filtered out
    summaries = (await (await client.get("/api/episodes?after=3")).json())["episodes"]
    assert [(s["key"], s["failure"]) for s in summaries] == [("g5-0", "timeout"), ("g4-0", "")]


async def wait_for_episodes(client, url: str, timeout: float = 10.0) -> dict:
    # the index reads at most every half second
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        body = await (await client.get(url)).json()
        if body["rows"]:
            return body
        await asyncio.sleep(0.2)
    raise TimeoutError(f"no new rows from {url} in {timeout} s")


async def test_babyai_episode_replays_with_a_frame_per_turn(client):
    page = await text_of(client, "/episode/g1-0?turn=2")
    assert "Thought: go.\nAction: move forward" in page and "Goal: go to the red ball" in page
    assert 'class="position current" data-position="2"' in page
    assert page.count("<section") == len(BABYAI_REPLIES) + 1
    assert "(the reply names no action)" in page  # turn 3's reply names none
    sizes = set()
    for position in range(len(BABYAI_REPLIES) + 1):
        response = await client.get(f"/frame/g1-0/{position}.png")
        assert response.status == 200 and response.content_type == "image/png"
        image = Image.open(io.BytesIO(await response.read()))
        sizes.add(image.size)
        assert len(image.convert("RGB").getcolors(1 << 16)) > 3  # a drawn grid, not a blank
    assert len(sizes) == 1 and min(sizes.pop()) >= 64
    assert (await client.get(f"/frame/g1-0/{len(BABYAI_REPLIES) + 1}.png")).status == 404
    assert (await client.get("/frame/nope/0.png")).status == 404
    assert (await client.get("/episode/nope")).status == 404


async def test_a_replay_that_stops_matching_the_record_says_so(records):
    run_dir, writer = records
    record = played_record("babyai", 4, BABYAI_REPLIES, group="g9")
    record["turns"][1]["observation"] = "something the environment never said"
    writer.write(record)
    wrong = played_record("babyai", 5, BABYAI_REPLIES[:1], group="g10", settings={"observation": "compact"})
    writer.write(wrong)  # settings neither config.yaml nor the defaults have
    async with TestClient(TestServer(make_app(run_dir / "episodes"))) as client:
        page = await text_of(client, "/episode/g9-0")
        assert "stops reproducing the record at turn 2" in page
        assert (await client.get("/frame/g9-0/1.png")).status == 200
        assert (await client.get("/frame/g9-0/2.png")).status == 404
        page = await text_of(client, "/episode/g10-0")
        assert "no settings reproduce the recorded first observation" in page and "--env-settings babyai=" in page
    given = {"babyai": {"observation": "compact"}}
    async with TestClient(TestServer(make_app(run_dir / "episodes", given))) as client:
        assert (await client.get("/frame/g10-0/1.png")).status == 200


async def test_textcraft_inventory_and_sciworld_score(client, records, tmp_path):
    _, writer = records
    # task 0: craft acacia planks
    writer.write(played_record("textcraft", 0, ["Action: inventory", "Action: get 2 acacia logs",
                                                "Action: craft 4 acacia planks using 1 acacia logs"], group="g6"))
    await wait_for_episodes(client, "/api/episodes?env=textcraft&format=rows")
    page = await text_of(client, "/episode/g6-0")
    inventories = re.findall(r'<table class="inventory">(.*?)</table>', page, re.S)
    assert len(inventories) == 4
    assert "empty" in inventories[0] and "empty" in inventories[1]
    assert "<td>acacia logs</td><td>2</td>" in inventories[2]
    assert "<td>acacia logs</td><td>1</td>" in inventories[3] and "<td>acacia planks</td><td>4</td>" in inventories[3]
    assert "✓ success" in page
    score = re.findall(r"Score <b>(\d+)</b> / 100", await text_of(client, "/episode/g3-0"))
    assert score == ["0", "25", "25", "75"]  # position 0, then after each turn


async def test_early_and_late_side_by_side(client):
    index = await text_of(client, "/compare")
    assert "/compare?env=babyai&amp;task=3" in index
    page = await text_of(client, "/compare?env=babyai&task=3&turn=1")
    assert "Earlier: policy v0" in page and "Later: policy v2" in page
    assert page.count('class="replay"') == 2
    assert 'src="/frame/g1-0/1.png"' in page and 'src="/frame/g2-0/1.png"' in page
    assert (await client.get("/compare?env=babyai&task=0")).status == 404  # one episode: nothing to compare
    assert 'id="compare-link"' in await text_of(client, "/episode/g1-0")


async def test_pages_escape_record_text(client, records):
    _, writer = records
    writer.write(synthetic_record("g7", 0, reply="Action: <script>alert(1)</script>"))
    await wait_for_episodes(client, "/api/episodes?q=alert&format=rows")
    page = await text_of(client, "/episode/g7-0")
    assert "<script>alert" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    response = await client.get("/")
    assert "default-src 'self'" in response.headers["Content-Security-Policy"]


def test_view_without_episodes_says_what_to_do(tmp_path):
    out = subprocess.run(horizonrl_cmd("view", str(tmp_path), "--port", "0"), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2
    assert "no episodes directory" in out.stderr and "record_fraction" in out.stderr


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT])
def test_view_serves_on_loopback_and_stops_cleanly(records, tmp_path, stop_signal):
    import urllib.request

    run_dir, _ = records
    log = tmp_path / "view.log"
    proc = start_process(horizonrl_cmd("view", str(run_dir), "--port", "0"), log)
    try:
        url = wait_until(lambda: re.search(r"http://127\.0\.0\.1:\d+/", log.read_text()), 60,
                         "the viewer's URL").group(0)
        with urllib.request.urlopen(url + "?failure=any", timeout=10) as response:
            assert row_keys(response.read().decode()) == ["e1-0"]
        proc.send_signal(stop_signal)
        assert proc.wait(timeout=15) == 0
    finally:
        stop_process(proc)



async def test_an_episode_of_several_samples_is_one_episode_that_says_so(client, records):
    """A chat template that rewrites history trains an episode as several samples: the viewer lists it once and
    its page says how many, and each turn's record says which sample it is in."""
    _, writer = records
    mask = [0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 1, 1]  # sample 0: prompt + turn 1; sample 1 (from 6): prompt + turn 2
    trajectory = msgspec.structs.replace(
        make_trajectory("g8", 0), token_ids=pack(list(range(12)), TOKEN_DTYPE), loss_mask=pack(mask, MASK_DTYPE),
        logprobs=pack([-0.5 * m for m in mask], LOGPROB_DTYPE), prompt_length=3, turn_spans=[(3, 6), (10, 12)],
        turn_versions=[0, 0], turn_epochs=[0, 0], turn_rewards=[0.0, 1.0], reward=1.0, num_turns=2,
        sample_starts=[6], text=EpisodeText(first_observation="Find the exit.", replies=["a", "b"],
                                            actions=["", ""], observations=["o1", "o2"]))
    assert trajectory_problem(trajectory, 100) is None
    record = episode_record(trajectory)
    assert record["samples"] == 2 and [t["sample"] for t in record["turns"]] == [0, 1]
    writer.write(record)
    await wait_for_episodes(client, "/api/episodes?q=g8&format=rows")
    assert row_keys(await text_of(client, "/?q=g8")) == ["g8-0"]
    assert "trained as 2 samples" in await text_of(client, "/episode/g8-0")
