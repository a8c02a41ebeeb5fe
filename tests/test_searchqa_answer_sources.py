"""scripts/searchqa_answer_sources.py sorts 2-hop episodes by where the answer came from: episodes played here
through the real SearchQA environment and written in the episode record's format."""

import asyncio
import json

from horizonrl.core.environment import extract_action
from horizonrl.envs.searchqa import SearchQAEnv, normalize_answer
from tests.helpers import load_script

SETTINGS = {"people": 1000, "name_parts": 60, "topk": 1, "answer_ends_episode": True, "hops": [2]}


def play(env: SearchQAEnv, task_id: int, replies: list[str]) -> dict:
    """One episode as `horizonrl eval --record` writes it (the fields the script reads)."""
    async def run() -> dict:
        await env.reset(task_id)
        turns, success = [], False
        for reply in replies:
            result = await env.step(reply)
            turns.append({"reply": reply, "action": extract_action(reply, env.reply_format),
                          "observation": result.observation})
            if result.done:
                success = result.reward > 0
                break
        return {"kind": "episode", "env": "searchqa", "task_id": task_id, "success": success, "turns": turns}
    return asyncio.run(run())


def answer(name: str) -> str:
    return f"<think>I will guess.</think>\n<answer> {name} </answer>"


def test_answers_are_sorted_by_where_they_came_from(tmp_path, capsys, monkeypatch):
    script = load_script("searchqa_answer_sources")
    env = SearchQAEnv(**SETTINGS)
    task_id = next(i for i in env.task_ids("test") if script.is_country_question(env.rows[i]))
    row = env.rows[task_id]
    countries = {r["golden_answers"][0] for r in env.rows if script.is_country_question(r)}
    wrong_country = sorted(countries - {row["golden_answers"][0]})[0]
    asyncio.run(env.reset(task_id))
    expert = env.expert_plan()  # search the person, search the city, answer the country
    searched_person_only = [expert[0], answer(wrong_country)]
    episodes = [play(env, task_id, expert), play(env, task_id, searched_person_only),
                play(env, task_id, [expert[0], answer(row["supporting_titles"][1])])]  # the city, not a country

    known = {normalize_answer(c) for c in countries}
    assert script.classify(episodes[0], row, known) == {
        "person page", "city page", "answered", "answered a country", "answer from the page", "success"}
    assert script.classify(episodes[1], row, known) == {
        "person page", "answered", "answered a country", "a country not read"}
    assert script.classify(episodes[2], row, known) == {"person page", "answered"}

    with open(tmp_path / "episodes-00000.jsonl", "w") as f:
        for episode in episodes:
            f.write(json.dumps(episode) + "\n")
    monkeypatch.setattr("sys.argv", ["searchqa_answer_sources.py", str(tmp_path), "--env-settings",
                                     json.dumps(SETTINGS)])
    script.main()
    out = capsys.readouterr().out
    assert "3 episodes of country questions" in out
    assert "success | city page    1.000 (1 episodes)" in out
