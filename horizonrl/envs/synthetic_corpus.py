"""A deterministic offline corpus about invented entities, with single- and multi-hop questions.

Nothing here exists in the world, so no model has memorised the answers: a question can only be
answered by searching. People are born in invented cities, cities lie in invented countries,
people found invented companies. Questions:

- 1 hop: "In which city was <person> born?" (answer in the person's page)
- 2 hops: "In which country was <person> born?" (person page -> city page)
- 2 hops: "In which city was the founder of <company> born?" (company page -> person page)

Each QA row carries ``supporting_titles`` (the pages to search, in order), which the SearchQA
oracle uses. ``horizonrl make-corpus OUT_DIR`` (``apps/env_data.py``) writes ``corpus.jsonl``
(Search-R1's format), ``train.jsonl`` and ``test.jsonl``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kr", "tr", "th", "sh"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ei", "ou"]
_CODAS = ["", "n", "r", "s", "l", "th", "x", "m"]
_PROFESSIONS = ["painter", "engineer", "botanist", "composer", "cartographer", "chemist", "sculptor", "poet"]
_INDUSTRIES = ["glassware", "river barges", "clockwork toys", "seed oils", "wool dyes", "lanterns"]


def invented_word(rng: random.Random, syllables: int) -> str:
    """A pronounceable invented word, capitalised (``Kaithor``)."""
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables)).title()


def _unique(rng: random.Random, used: set[str], make) -> str:
    while True:
        name = make()
        if name not in used:
            used.add(name)
            return name


def generate(seed: int = 0, num_people: int = 120, num_cities: int = 40, num_countries: int = 10,
             num_companies: int = 40, test_fraction: float = 0.2, name_parts: int | None = None) -> dict[str, Any]:
    """Corpus rows and train/test QA rows, the same for the same arguments on every machine.

    ``name_parts``: people's first names and surnames are drawn from two pools of this many words
    (a person is a new pair of known words), rather than each person having two words of their own.
    A large corpus then has few distinct words, each seen often, so a small model can spell every
    name, held-out people's included, while no two people share a whole name.
    """
    if name_parts is not None and name_parts * name_parts < num_people:
        raise ValueError(f"name_parts={name_parts} makes {name_parts ** 2} names, fewer than {num_people} people")
    rng = random.Random(seed)
    used: set[str] = set()
    countries = [_unique(rng, used, lambda: invented_word(rng, 2) + "ia") for _ in range(num_countries)]
    cities = [{"name": _unique(rng, used, lambda: invented_word(rng, 2)), "country": rng.choice(countries),
               "river": invented_word(rng, 2)} for _ in range(num_cities)]
    if name_parts is None:
        def person_name() -> str:
            return f"{invented_word(rng, 2)} {invented_word(rng, 2)}"
    else:
        first_names = [_unique(rng, used, lambda: invented_word(rng, 2)) for _ in range(name_parts)]
        surnames = [_unique(rng, used, lambda: invented_word(rng, 2)) for _ in range(name_parts)]

        def person_name() -> str:
            return f"{rng.choice(first_names)} {rng.choice(surnames)}"
    people = [{"name": _unique(rng, used, person_name), "city": rng.choice(cities),
               "job": rng.choice(_PROFESSIONS), "year": rng.randint(1700, 1990)} for _ in range(num_people)]
    companies = [{"name": _unique(rng, used, lambda: invented_word(rng, 2) + " Works"), "founder": rng.choice(people),
                  "makes": rng.choice(_INDUSTRIES), "year": rng.randint(1750, 2010)} for _ in range(num_companies)]

    corpus: list[dict[str, str]] = []

    def page(title: str, text: str) -> None:
        corpus.append({"id": str(len(corpus)), "contents": f'"{title}"\n{text}'})

    for country in countries:
        page(country, f"{country} is a country whose flag shows a {rng.choice(['blue', 'red', 'green'])} star.")
    for city in cities:
        page(city["name"], f"{city['name']} is a city in {city['country']}, on the banks of the {city['river']} river.")
    for person in people:
        page(person["name"], f"{person['name']} was a {person['job']} born in {person['city']['name']} in "
                             f"{person['year']}.")
    for company in companies:
        page(company["name"], f"{company['name']} is a maker of {company['makes']}, founded in {company['year']} by "
                              f"{company['founder']['name']}.")

    questions: list[dict[str, Any]] = []
    for person in people:
        questions.append({"question": f"In which city was {person['name']} born?",
                          "golden_answers": [person["city"]["name"]], "hops": 1,
                          "supporting_titles": [person["name"]]})
        questions.append({"question": f"In which country was {person['name']} born?",
                          "golden_answers": [person["city"]["country"]], "hops": 2,
                          "supporting_titles": [person["name"], person["city"]["name"]]})
    for company in companies:
        questions.append({"question": f"In which city was the founder of {company['name']} born?",
                          "golden_answers": [company["founder"]["city"]["name"]], "hops": 2,
                          "supporting_titles": [company["name"], company["founder"]["name"]]})
    rng.shuffle(questions)
    for i, row in enumerate(questions):
        row["id"] = f"synthetic_{seed}_{i}"
    n_test = max(1, int(len(questions) * test_fraction))
    return {"corpus": corpus, "train": questions[n_test:], "test": questions[:n_test]}


def write(out_dir: str | Path, **kwargs: Any) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = generate(**kwargs)
    for name in ("corpus", "train", "test"):
        with open(out / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for row in data[name]:
                f.write(json.dumps(row) + "\n")
    return out
