"""WebArena's evaluators, re-implemented: ``string_match`` (exact_match, must_include, fuzzy_match),
``url_match`` and ``program_html``. A task's score is the product of its evaluators' scores (0 or 1).

``fuzzy_match`` asks an OpenAI-compatible judge (``judge: {url, model, api_key_env}``); without
one, or for a check this module cannot run (a ``func:`` locator it does not know), the task is
*unscorable* — :class:`Unscorable` is raised, never a guessed score.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from horizonrl.envs.webarena.tasks import fill_placeholders


class Unscorable(Exception):
    """The task cannot be scored here (no judge configured, an unsupported check)."""


@dataclass(frozen=True)
class Judge:
    """An OpenAI-compatible chat-completions endpoint that grades fuzzy answers."""

    url: str
    model: str
    api_key_env: str | None = None
    timeout_s: float = 60.0

    def ask(self, question: str) -> str:
        body = json.dumps({"model": self.model, "temperature": 0, "messages": [
            {"role": "system", "content": "You grade answers. Reply with one word: correct, incorrect or partially "
                                          "correct."},
            {"role": "user", "content": question}]}).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key_env and os.environ.get(self.api_key_env):
            headers["Authorization"] = f"Bearer {os.environ[self.api_key_env]}"
        url = self.url.rstrip("/")
        url = url if url.endswith("/chat/completions") else url + "/chat/completions"
        with urllib.request.urlopen(urllib.request.Request(url, body, headers), timeout=self.timeout_s) as r:
            return json.loads(r.read())["choices"][0]["message"]["content"]


def clean_answer(text: str) -> str:
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        text = text[1:-1].strip()
    return text.lower()


def exact_match(reference: str, answer: str) -> float:
    return float(clean_answer(reference) == clean_answer(answer))


def must_include(reference: str, answer: str, single_token: bool = False) -> float:
    ref, ans = clean_answer(reference), clean_answer(answer)
    if single_token:  # a lone "N/A" must be the whole answer
        return float(ref == ans)
    return float(ref in ans)


def fuzzy_match(judge: Judge | None, intent: str, reference: str, answer: str) -> float:
    if judge is None:
        raise Unscorable("fuzzy_match needs a judge: set the webarena setting judge: {url, model}")
    question = (f"Question: {intent}\nReference answer: {reference}\nAnswer to grade: {answer}\n"
                "Is the answer to grade correct (it may say more or less than the reference, but must agree with "
                "it)? Reply with correct, incorrect or partially correct.")
    try:
        verdict = judge.ask(question).strip().lower()
    except Exception as error:
        raise Unscorable(f"the fuzzy_match judge did not answer: {error!r}") from error
    return float(verdict.startswith("correct"))


def string_match(eval_spec: dict[str, Any], intent: str, answer: str, judge: Judge | None) -> float:
    score = 1.0
    for kind, value in (eval_spec.get("reference_answers") or {}).items():
        if kind == "exact_match":
            score *= exact_match(str(value), answer)
        elif kind == "must_include":
            values = value if isinstance(value, list) else [value]
            score *= float(all(must_include(str(v), answer, single_token=len(values) == 1 and str(v) == "N/A")
                               for v in values))
        elif kind == "fuzzy_match":
            values = value if isinstance(value, list) else [value]
            if values == ["N/A"]:
                score *= exact_match("N/A", answer) or must_include("N/A", answer)
            else:
                for reference in values:
                    score *= fuzzy_match(judge, intent, str(reference), answer)
        else:
            raise Unscorable(f"unknown reference answer kind {kind!r}")
    return score


def _split_url(url: str) -> tuple[str, dict[str, list[str]]]:
    parts = urllib.parse.urlparse(urllib.parse.unquote(url.strip()))
    base = (parts.netloc + parts.path).rstrip("/")
    return base, urllib.parse.parse_qs(parts.query)


def url_match(eval_spec: dict[str, Any], current_url: str, urls: dict[str, str]) -> float:
    """Some reference URL (alternatives joined by `` |OR| ``) has its host+path in the current URL's
    and each of its query values among the current URL's."""
    reference = eval_spec.get("reference_url") or ""
    pred_base, pred_query = _split_url(current_url)
    for alternative in fill_placeholders(reference, urls).split(" |OR| "):
        ref_base, ref_query = _split_url(alternative)
        if ref_base and ref_base in pred_base and all(set(v) <= set(pred_query.get(k, []))
                                                      for k, v in ref_query.items()):
            return 1.0
    return 0.0


Fetch = Callable[[str, str], Awaitable[str]]
"""``fetch(url, locator_js) -> text``: open ``url`` (or the current page for ``""``) in the episode's
browser context and evaluate a JavaScript expression there ('' = the page's whole text)."""


def _resolve_program_url(url: str, last_url: str, urls: dict[str, str]) -> str:
    if url == "last":
        return last_url
    if url.startswith("func:"):
        call = url[len("func:"):].strip()
        match = re.fullmatch(r"reddit_get_post_url\(['\"]__last_url__['\"]\)", call)
        if match:  # the post page a forum URL belongs to: /f/<forum>/<id>
            post = re.match(r"(.*?/f/[^/]+/\d+)", last_url)
            return post.group(1) if post else last_url
        raise Unscorable(f"program_html url helper {call!r} is not supported")
    return fill_placeholders(url, urls)


async def program_html(eval_spec: dict[str, Any], last_url: str, urls: dict[str, str], fetch: Fetch) -> float:
    for target in eval_spec.get("program_html") or []:
        url = _resolve_program_url(target.get("url", "last"), last_url, urls)
        locator = target.get("locator", "") or ""
        if locator.startswith("func:"):
            raise Unscorable(f"program_html locator helper {locator!r} is not supported")
        text = await fetch(url, locator)
        contents = target.get("required_contents") or {}
        if "exact_match" in contents:
            if clean_answer(str(contents["exact_match"])) != clean_answer(text):
                return 0.0
        for phrase in contents.get("must_include", []):
            alternatives = str(phrase).split(" |OR| ")
            if not any(clean_answer(a) in clean_answer(text) for a in alternatives):
                return 0.0
    return 1.0


async def evaluate(task: dict[str, Any], answer: str, current_url: str, urls: dict[str, str], fetch: Fetch,
                   judge: Judge | None) -> float:
    """The task's score for an episode that stopped with ``answer`` on ``current_url``."""
    spec = task["eval"]
    score = 1.0
    for kind in spec.get("eval_types", []):
        if kind == "string_match":  # a judge call blocks: off the event loop
            score *= await asyncio.to_thread(string_match, spec, task.get("intent", ""), answer, judge)
        elif kind == "url_match":
            score *= url_match(spec, current_url, urls)
        elif kind == "program_html":
            score *= await program_html(spec, current_url, urls, fetch)
        else:
            raise Unscorable(f"unknown evaluator {kind!r}")
    return score
