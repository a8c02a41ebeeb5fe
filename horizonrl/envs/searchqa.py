"""SearchQA (Deep Search) in Search-R1's protocol.

The agent reasons in ``<think>...</think>``, queries with ``<search>query</search>`` and gets
``<information>Doc 1(Title: ...) ...</information>`` (top ``topk``, default 3), and ends with
``<answer>...</answer>``. A right answer (exact match after normalisation: lower case, no
punctuation, no articles, single spaces) ends the episode with reward 1; a wrong one gets
"Sorry, your answer is incorrect. Please try again." and the episode goes on (AgentGym's rule), or,
with ``answer_ends_episode``, ends it with reward 0 (Search-R1's rule: one answer per question, so
guessing again after a wrong answer cannot pay).

Data: ``data_dir`` holding Search-R1-style ``train.jsonl`` / ``test.jsonl`` (rows with
``question`` and ``golden_answers``, optionally ``hops``) and, for BM25, ``corpus.jsonl``;
or ``retriever_url`` for a Search-R1 retrieval server. Without ``data_dir`` the synthetic
corpus of :mod:`horizonrl.envs.synthetic_corpus` is generated in memory from ``seed``, ``people``,
``name_parts`` and ``countries``.
Ids: train rows are ``0..n_train-1`` and test rows follow, so the splits are disjoint. ``hops``
(e.g. ``[2]``) keeps only the questions of those hop counts in both splits.
The category is ``hops-<n>`` (``hops-unknown`` if the row does not say).
"""

from __future__ import annotations

import functools
import json
import random
import re
import string
import threading
from pathlib import Path
from typing import Any

from horizonrl.core.environment import TAGGED_ACTION
from horizonrl.envs.base import StepResult
from horizonrl.envs.retrieval import BM25Retriever, RemoteRetriever, Retriever, format_information

INSTRUCTION = (
    "Answer the question below. Think inside <think> and </think> whenever you get new information. "
    "If you are missing knowledge, search with <search> query </search>; results come back between "
    "<information> and </information>, and you may search as often as you need. When you know the answer, "
    "give it inside <answer> and </answer> with no explanation, e.g. <answer> Paris </answer>.\n"
    "Question: {question}\n"
)
WRONG_ANSWER = "Sorry, your answer is incorrect. Please try again."
FINAL_WRONG_ANSWER = "Sorry, your answer is incorrect."
INVALID = ("Invalid reply: put a search query between <search> and </search>, or the final answer "
           "between <answer> and </answer>.")
_RETRIEVERS: dict[Any, Retriever] = {}
_RETRIEVERS_LOCK = threading.Lock()
MAX_QUERY_CHARS = 1000
CAPITALISED = re.compile(r"\b[A-Z][a-z]+\b")  # the names the random policy can search for or answer with
NAME = re.compile(r"\b[A-Z][a-z]+(?: [A-Z][a-z]+)*\b")  # a whole name: "Fultrain Zirvu", "Kaiv Works", "Lemma"


def normalize_answer(text: str) -> str:
    """Search-R1 / SQuAD normalisation for exact match."""
    text = text.lower()
    text = "".join(c for c in text if c not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(prediction: str, golden_answers: list[str]) -> bool:
    return normalize_answer(prediction) in {normalize_answer(g) for g in golden_answers}


@functools.lru_cache(maxsize=8)
def _synthetic(seed: int, people: int, name_parts: int | None, countries: int) -> dict[str, Any]:
    from horizonrl.envs.synthetic_corpus import generate

    return generate(seed=seed, num_people=people, name_parts=name_parts, num_countries=countries)


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


class SearchQAEnv:
    """One question at a time (see the module docstring for the protocol)."""

    name = "searchqa"
    reply_format = "tags"  # the reply carries <search>/<answer> tags, not a ReAct "Action:" line

    def __init__(self, data_dir: str | None = None, retriever_url: str | None = None, topk: int = 3,
                 seed: int = 0, answer_ends_episode: bool = False, hops: list[int] | None = None,
                 random_answers: str = "unasked", people: int = 120, name_parts: int | None = None,
                 countries: int = 10, random_searches: str = "words") -> None:
        if random_answers not in ("unasked", "found"):
            raise ValueError(f"searchqa: random_answers must be 'unasked' or 'found', not {random_answers!r}")
        if random_searches not in ("words", "names"):
            raise ValueError(f"searchqa: random_searches must be 'words' or 'names', not {random_searches!r}")
        if random_searches == "names" and not answer_ends_episode:
            raise ValueError("searchqa: random_searches='names' needs answer_ends_episode (one answer per episode)")
        if data_dir is not None and (people, name_parts, countries) != (120, None, 10):
            raise ValueError("searchqa: people, name_parts and countries shape the synthetic corpus; with data_dir, "
                             "generate it with `horizonrl make-corpus DIR --people N --name-parts K --countries C`")
        if data_dir is None:
            data = _synthetic(seed, people, name_parts, countries)
            self.train, self.test = data["train"], data["test"]
            corpus_key: Any = ("synthetic", seed, people, name_parts, countries)
            corpus = lambda: [row["contents"] for row in data["corpus"]]  # noqa: E731
        else:
            root = Path(data_dir)
            self.train, self.test = _read_jsonl(root / "train.jsonl"), _read_jsonl(root / "test.jsonl")
            corpus_key = str((root / "corpus.jsonl").resolve())
            corpus = lambda: [row["contents"] for row in _read_jsonl(root / "corpus.jsonl")]  # noqa: E731
        if hops is not None:  # only questions of these hop counts, in both splits (the corpus stays whole)
            wanted = {int(h) for h in hops}
            self.train = [row for row in self.train if row.get("hops") in wanted]
            self.test = [row for row in self.test if row.get("hops") in wanted]
            if not self.train or not self.test:
                raise ValueError(f"searchqa: no {'training' if not self.train else 'test'} question has hops in "
                                 f"{sorted(wanted)}")
        if retriever_url:
            self.retriever: Retriever = RemoteRetriever(retriever_url)
        else:
            with _RETRIEVERS_LOCK:  # one index per corpus per process
                if corpus_key not in _RETRIEVERS:
                    _RETRIEVERS[corpus_key] = BM25Retriever(corpus())
                self.retriever = _RETRIEVERS[corpus_key]
        self.topk = topk
        self.answer_ends_episode = bool(answer_ends_episode)
        self.random_answers = random_answers
        self.random_searches = random_searches
        self.row: dict[str, Any] | None = None
        self.last_documents: list[Any] = []  # the latest search's results (names the random policy can use)
        self.searched: set[str] = set()  # this episode's queries (the "names" random policy searches a name once)
        self._done = True
        self._success = False

    @property
    def rows(self) -> list[dict[str, Any]]:
        return [*self.train, *self.test]

    def task_ids(self, split: str) -> list[int]:
        if split == "train":
            return list(range(len(self.train)))
        if split == "test":
            return list(range(len(self.train), len(self.train) + len(self.test)))
        raise ValueError(f"unknown split {split!r}; use 'train' or 'test'")

    def task_category(self, task_id: int) -> str:
        return f"hops-{self._row(task_id).get('hops', 'unknown')}"

    def _row(self, task_id: int) -> dict[str, Any]:
        n = len(self.train) + len(self.test)
        if not isinstance(task_id, int) or isinstance(task_id, bool) or not 0 <= task_id < n:
            raise ValueError(f"searchqa task id must be an integer in 0..{n - 1}, got {task_id!r}")
        return self.train[task_id] if task_id < len(self.train) else self.test[task_id - len(self.train)]

    async def reset(self, task_id: int) -> str:
        self.row = self._row(task_id)
        self.last_documents = []
        self.searched = set()
        self._done = False
        self._success = False
        return INSTRUCTION.format(question=self.row["question"])

    async def step(self, action_text: str) -> StepResult:
        if self._done or self.row is None:
            return StepResult("The episode is over; no more actions are accepted.", 0.0, True, self._success,
                              float(self._success), {"invalid_action": True})
        match = TAGGED_ACTION.search(action_text or "")
        if match is None:
            return StepResult(INVALID, 0.0, False, info={"invalid_action": True})
        kind, content = match.group(1), match.group(2).strip()
        if kind == "search":
            if not content or len(content) > MAX_QUERY_CHARS:
                return StepResult(INVALID, 0.0, False, info={"invalid_action": True})
            documents = await self.retriever.search(content, self.topk)
            self.last_documents = documents
            self.searched.add(content)
            return StepResult(f"\n\n<information>{format_information(documents)}</information>\n\n", 0.0, False,
                              info={"invalid_action": False, "search": True})
        if exact_match(content, self.row["golden_answers"]):
            self._done = self._success = True
            return StepResult("Your answer is correct.", 1.0, True, True, 1.0, {"invalid_action": False})
        if self.answer_ends_episode:
            self._done = True
            return StepResult(FINAL_WRONG_ANSWER, 0.0, True, False, 0.0, {"invalid_action": False})
        return StepResult(WRONG_ANSWER, 0.0, False, info={"invalid_action": False})

    async def close(self) -> None:
        self._done = True

    def random_action(self, rng: random.Random) -> str:
        """Half the time a search for 1-3 random words of the question or names in the latest search's
        results; otherwise an answer: one capitalised word seen (in the question or those results), drawn
        uniformly. It names the answer only by chance, with no skill. With ``answer_ends_episode`` (one
        answer per episode) it searches first, for names only (the question's capitalised words and those
        found), and answers only with a name from the latest results that the question does not hold: an
        answer before any search would end the episode with a name the question already gave. With
        ``random_answers="found"`` it answers with any name of the latest results, the question's included:
        then telling the asked name from the answer is left for training to learn (on a 1-hop question the
        page names the person and the city: the "unasked" rule alone makes the random policy right whenever
        its search found the page)."""
        if self.random_searches == "names":
            return self._random_name_action(rng)
        question = self.row["question"] if self.row else "the answer"
        words = re.findall(r"[A-Za-z]+", question)
        found = set(re.findall(CAPITALISED, " ".join(f"{d.title} {d.text}" for d in self.last_documents)))
        asked = set(re.findall(CAPITALISED, question))
        names = sorted(asked | found) or words
        if self.answer_ends_episode:
            names = sorted(found - asked if self.random_answers == "unasked" else found) or names
        if rng.random() < 0.5 or (self.answer_ends_episode and not found):
            pool = sorted(set(words) | found)
            if self.answer_ends_episode:  # names only: the question's and those found (the next hop)
                pool = sorted(asked | found) or pool
            picked = " ".join(rng.sample(pool, min(len(pool), rng.randint(1, 3))))
            return f"<think>I should look this up.</think>\n<search> {picked} </search>"
        return f"<think>I will guess.</think>\n<answer> {rng.choice(names)} </answer>"

    def _random_name_action(self, rng: random.Random) -> str:
        """``random_searches="names"``: search whole names, each once, and answer a name read. Until something is
        read it searches the question's name; then half the time it answers a name of the latest results (any,
        drawn uniformly), otherwise it searches, drawn uniformly, the question's name or a name of the latest
        results it has not searched yet. No skill: it does not know which name leads to the answer, or which
        name is the answer; but it follows a page's names as a reader would, so it reaches a country question's
        second page (the city's) in 0.35 of its episodes on the corpus of configs/searchqa_multihop_names.yaml,
        against 0.06-0.09 for ``"words"``: often enough for RL to find the chain."""
        question = self.row["question"] if self.row else "the answer"
        asked = [m.group(0) for m in NAME.finditer(question) if m.start() > 0]  # not the question's first word
        found = sorted({m.group(0) for d in self.last_documents for part in (d.title, d.text)  # apart: one name each
                        for m in NAME.finditer(part)})
        if found and rng.random() < 0.5:
            return f"<think>I will guess.</think>\n<answer> {rng.choice(found)} </answer>"
        options = sorted(set(asked) | {name for name in found if name not in self.searched}) or ["answer"]
        return f"<think>I should look this up.</think>\n<search> {rng.choice(options)} </search>"

    def expert_plan(self) -> list[str]:
        """The oracle: search each supporting page in order, then answer (needs supporting_titles)."""
        titles = self.row.get("supporting_titles") or [self.row["question"]]
        steps = [f"<think>I need the page about {t}.</think>\n<search> {t} </search>" for t in titles]
        return [*steps, f"<think>I have it.</think>\n<answer> {self.row['golden_answers'][0]} </answer>"]
