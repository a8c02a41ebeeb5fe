"""Where do a SearchQA model's answers to 2-hop questions come from: the page it read, or a guess?

    horizonrl eval --model M --env searchqa --env-settings JSON --split test --episodes N --record DIR
    python scripts/searchqa_answer_sources.py DIR [--config configs/searchqa_multihop.yaml] [--env-settings JSON]

"In which country was <person> born?" has ten possible answers in the synthetic corpus (the env's ``countries``),
and the most common country is the answer to 14% of the held-out questions: a model that learned to name a
country, any country, succeeds 0.10 of the time without reading a page. This reads recorded episodes
(``--record`` of ``horizonrl eval``, or a run's ``episodes/``) and sorts each country question's episode by what
the model did:

- ``person page``: a search returned the asked person's page (the first hop);
- ``city page``: a search returned the page of the city that person was born in (the second hop);
- ``answered a country``: the answer is one of the corpus's countries (not a city's or a person's name);
- ``answer from the page``: the answer is the country named on the last city page it read, right or wrong;
- ``a country not read``: a country named on no page it read in this episode (a guess from what it remembers);
- ``success``, and success among the episodes that reached the right city page.

A model that reads answers with the country of the city page it reached; one that guesses names countries it read
nowhere in the episode.
``--env-settings`` (JSON, merged over the config's first environment's settings) must give the task ids the
episodes were played with: ``hops`` changes them. docs/learning.md quotes the output ("SearchQA").
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path

from horizonrl.core.config import load_config
from horizonrl.core.episode_records import EpisodeRecordReader
from horizonrl.envs.searchqa import SearchQAEnv, normalize_answer

# A person's page: "<name> was a <job> born in <city> in <year>"; a city's: "<city> is a city in <country>, ...".
PAGE = re.compile(r"\(Title: ([^)]*)\) [^(]*?(is a city in|was a \w+ born in) (\w+)")


def is_country_question(row: dict) -> bool:
    return row["question"].startswith("In which country")


def classify(episode: dict, row: dict, countries: set[str]) -> set[str]:
    """The labels of one country question's episode (see the module's docstring)."""
    person, city = row["supporting_titles"]
    countries_read: list[str] = []
    labels: set[str] = set()
    answer = None
    for turn in episode["turns"]:
        action = turn.get("action", "")
        if action.startswith("answer:"):
            answer = action.removeprefix("answer:").strip()
        for title, kind, named in PAGE.findall(turn.get("observation", "")):
            if title == person:
                labels.add("person page")
            elif kind == "is a city in":
                countries_read.append(named)
                if title == city:
                    labels.add("city page")
    if answer is not None:
        labels.add("answered")
        answer = normalize_answer(answer)
        if answer in countries:
            labels.add("answered a country")
            if countries_read and answer == normalize_answer(countries_read[-1]):
                labels.add("answer from the page")
            elif answer not in {normalize_answer(c) for c in countries_read}:
                labels.add("a country not read")
    if episode.get("success"):
        labels.add("success")
    return labels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("record_dir", type=Path)
    parser.add_argument("--config", default="configs/searchqa_multihop.yaml")
    parser.add_argument("--env-settings", default="{}", help="JSON merged over the config's environment settings")
    args = parser.parse_args()
    settings = {**load_config(args.config).envs[0].settings, **json.loads(args.env_settings)}
    env = SearchQAEnv(**settings)
    countries = {normalize_answer(row["golden_answers"][0]) for row in env.rows if is_country_question(row)}
    counts: Counter[str] = Counter()
    total = 0
    for episode in EpisodeRecordReader(args.record_dir).new_records():
        if episode.get("kind") != "episode" or episode.get("env") != "searchqa":
            continue  # a record of which groups were trained, or another env's episode
        row = env.rows[episode["task_id"]]
        if not is_country_question(row):
            continue
        total += 1
        labels = classify(episode, row, countries)
        counts.update(labels)
        if {"success", "city page"} <= labels:
            counts["success and city page"] += 1
    if not total:
        raise SystemExit(f"no country question's episode in {args.record_dir}: wrong directory or --env-settings?")
    print(f"{total} episodes of country questions in {args.record_dir}")
    for label in ("person page", "city page", "answered", "answered a country", "answer from the page",
                  "a country not read", "success"):
        print(f"  {label:22s} {counts[label] / total:.3f}")
    reached = counts["city page"]
    with_city = counts["success and city page"] / reached if reached else float("nan")
    print(f"  success | city page    {with_city:.3f} ({reached} episodes)")


if __name__ == "__main__":
    main()
