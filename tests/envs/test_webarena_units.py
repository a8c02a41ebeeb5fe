"""WebArena without a browser: the action grammar, the AX-tree text, the evaluators (with a fake
OpenAI-compatible judge), task loading and placeholders, and the bundled task files."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from horizonrl.envs.webarena.actions import Action, ActionError, parse_action
from horizonrl.envs.webarena.data import generate
from horizonrl.envs.webarena.evaluators import Judge, Unscorable, evaluate, string_match, url_match
from horizonrl.envs.webarena.observation import render_tree, truncate
from horizonrl.envs.webarena.tasks import (LOCAL_EXPERT, LOCAL_TASKS, fill_placeholders, load_tasks, needs_judge,
                                           storage_state_path)


@pytest.mark.parametrize("reply, action", [
    ("Let's think. In summary, the next action I will perform is ```click [12]```", Action("click", 12)),
    ("```type [7] [blue shirt] [0]```", Action("type", 7, "blue shirt", False)),
    ("```type [7] [blue shirt]```", Action("type", 7, "blue shirt", True)),
    ("```type [7] [a [b] c] [1]```", Action("type", 7, "a [b] c", True)),
    ("```hover [3]```", Action("hover", 3)),
    ("```press [ctrl+a]```", Action("press", text="Control+a")),
    ("```press [Enter]```", Action("press", text="Enter")),
    ("```scroll [DOWN]```", Action("scroll", text="down")),
    ("```goto [http://x.test/a?b=1]```", Action("goto", text="http://x.test/a?b=1")),
    ("```go_back``` and ```click [1]```", Action("go_back")),
    ("```\nstop [The answer is [x] 42]\n```", Action("stop", text="The answer is [x] 42")),
    ("```stop```", Action("stop", text="")),
    ("```text\nclick [5]\n```", Action("click", 5)),
    ("```new_tab```", Action("new_tab")),
    ("```tab_focus [1]```", Action("tab_focus", text="1")),
])
def test_parse_action(reply, action):
    assert parse_action(reply) == action


@pytest.mark.parametrize("reply", ["click [12]", "``click [1]``", "```fly [2]```", "```click [x]```", "```click```",
                                   "```type [2]```", "```scroll [sideways]```", "```tab_focus [a]```", "```press [+]```",
                                   "", "```type [1] [a] [yes]```"])
def test_malformed_actions(reply):
    with pytest.raises(ActionError):
        parse_action(reply)


def ax(node_id, role, name=None, children=(), props=(), backend=None, ignored=False, parent=None):
    node = {"nodeId": str(node_id), "role": {"value": role}, "childIds": [str(c) for c in children],
            "backendDOMNodeId": backend or node_id, "ignored": ignored,
            "properties": [{"name": k, "value": {"value": v}} for k, v in props]}
    if name is not None:
        node["name"] = {"value": name}
    if parent is not None:
        node["parentId"] = str(parent)
    return node


def test_render_tree_prunes_like_webarena():
    nodes = [
        ax(1, "RootWebArea", "Shop", [2, 9], [("focusable", True), ("focused", True)]),
        ax(2, "generic", "", [3, 5, 7], parent=1),  # nameless generic: not printed, children one level up
        ax(3, "link", "Books", [4], [("url", "http://s/books")], parent=2),
        ax(4, "StaticText", "Books", parent=3),  # repeats the link's name: dropped
        ax(5, "textbox", "Search", [], [("editable", "plaintext"), ("required", False), ("invalid", "false")], parent=2),
        ax(7, "listitem", "", [8], parent=2),  # nameless listitem: never printed
        ax(8, "StaticText", "Price: $3", parent=7),
        ax(9, "none", None, [10], ignored=True, parent=1),  # ignored: not printed
        ax(10, "button", "Go", parent=9),
    ]
    snap = render_tree(nodes)
    assert snap.text == ("[1] RootWebArea 'Shop' focused: True\n\t[2] link 'Books' url: http://s/books\n"
                         "\t[3] textbox 'Search'\n\t[4] StaticText 'Price: $3'\n\t[5] button 'Go'")
    assert snap.nodes[2].backend_id == 3 and snap.nodes[5].role == "button"
    assert "url:" not in render_tree(nodes, link_urls=False).text
    boxes = {1: (0, 0, 100, 100), 3: (0, 0, 10, 10), 5: (0, 500, 10, 10), 8: (0, 20, 10, 10), 10: (0, 30, 10, 10)}
    visible = render_tree(nodes, boxes, (0, 0, 100, 100)).text
    assert "Search" not in visible and "Books" in visible and "Go" in visible


def test_truncate():
    assert truncate("a\nbb\nccc", 0) == ("a\nbb\nccc", 0)
    assert truncate("a\nbb\nccc", 5) == ("a\nbb", 1)


def test_string_match():
    spec = {"reference_answers": {"exact_match": "Pending"}}
    assert string_match(spec, "", " pending ", None) == 1.0 and string_match(spec, "", "pending!", None) == 0.0
    spec = {"reference_answers": {"must_include": ["movies", "cooking"]}}
    assert string_match(spec, "", "f/Cooking and f/movies", None) == 1.0
    assert string_match(spec, "", "f/cooking", None) == 0.0
    na = {"reference_answers": {"must_include": ["N/A"]}}
    assert string_match(na, "", "N/A", None) == 1.0 and string_match(na, "", "N/A, it is 3", None) == 0.0
    fuzzy = {"reference_answers": {"fuzzy_match": ["about 40 km"]}}
    with pytest.raises(Unscorable, match="judge"):
        string_match(fuzzy, "how long?", "40 kilometres", None)
    assert string_match({"reference_answers": {"fuzzy_match": "N/A"}}, "", "n/a", None) == 1.0


def test_url_match():
    urls = {"shopping": "http://127.0.0.1:7770"}
    spec = {"reference_url": "__SHOPPING__/category/electronics?sort=price |OR| __SHOPPING__/search?q=lamp"}
    assert url_match(spec, "http://127.0.0.1:7770/category/electronics?sort=price&page=1", urls) == 1.0
    assert url_match(spec, "http://127.0.0.1:7770/search?q=lamp", urls) == 1.0
    assert url_match(spec, "http://127.0.0.1:7770/category/electronics", urls) == 0.0
    assert url_match(spec, "http://127.0.0.1:7770/search?q=kettle", urls) == 0.0


class FakeJudge(BaseHTTPRequestHandler):
    """An OpenAI-compatible chat-completions endpoint: 'correct' when the graded answer says 40."""

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        question = body["messages"][-1]["content"]
        verdict = "correct" if "grade: 40" in question else "incorrect"
        data = json.dumps({"choices": [{"message": {"role": "assistant", "content": verdict}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


async def test_fuzzy_match_through_a_judge_and_program_html():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), FakeJudge)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        judge = Judge(url=f"http://127.0.0.1:{httpd.server_address[1]}/v1", model="fake", timeout_s=30)
        task = {"intent": "How long is the route?", "eval": {"eval_types": ["string_match"],
                                                              "reference_answers": {"fuzzy_match": ["about 40 km"]}}}
        assert needs_judge(task)
        assert await evaluate(task, "40 kilometres", "", {}, None, judge) == 1.0
        assert await evaluate(task, "12", "", {}, None, judge) == 0.0
    finally:
        httpd.shutdown()
        thread.join(timeout=10)

    seen = []

    async def fetch(url, locator):
        seen.append((url, locator))
        return "Post yours. Favourite westerns 20 points"

    task = {"eval": {"eval_types": ["program_html"], "program_html": [
        {"url": "func:reddit_get_post_url('__last_url__')", "locator": "document.body.innerText",
         "required_contents": {"must_include": ["Favourite westerns", "nope |OR| 20 points"]}}]}}
    assert await evaluate(task, "", "http://f/f/movies/12/comments", {}, fetch, None) == 1.0
    assert seen == [("http://f/f/movies/12", "document.body.innerText")]
    task["eval"]["program_html"][0]["required_contents"] = {"exact_match": "something else"}
    assert await evaluate(task, "", "http://f/f/movies/12", {}, fetch, None) == 0.0
    task["eval"]["program_html"][0]["url"] = "func:shopping_get_latest_order_url()"
    with pytest.raises(Unscorable):
        await evaluate(task, "", "http://f/", {}, fetch, None)


def test_tasks_and_placeholders(tmp_path):
    tasks = load_tasks(LOCAL_TASKS)
    assert [t["task_id"] for t in tasks] == list(range(len(tasks)))
    assert fill_placeholders("__SHOPPING__/cart |AND| __REDDIT__", {"shopping": "http://a:1/", "reddit": "http://b:2"}) \
        == "http://a:1/cart |AND| http://b:2"
    login = next(t for t in tasks if t["require_login"])
    assert storage_state_path(login, tmp_path).name == login["storage_state"].rsplit("/", 1)[1]
    assert storage_state_path(login, None, {login["sites"][0]: "/x/state.json"}).as_posix() == "/x/state.json"
    # a directory of WebArena config files, one task per file
    for task in tasks[:3]:
        (tmp_path / f"{task['task_id']}.json").write_text(json.dumps(task))
    assert [t["task_id"] for t in load_tasks(tmp_path)] == [0, 1, 2]
    (tmp_path / "bad.json").write_text(json.dumps({"task_id": 9}))
    with pytest.raises(ValueError, match="lacks"):
        load_tasks(tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        load_tasks(tmp_path / "nowhere")


def test_bundled_task_files_match_their_generator():
    tasks, plans = generate.build()
    assert json.loads(LOCAL_TASKS.read_text()) == tasks and json.loads(LOCAL_EXPERT.read_text()) == plans
    assert set(plans) == {str(t["task_id"]) for t in tasks}
    assert all(plan and "stop" in plan[-1] for plan in plans.values())
