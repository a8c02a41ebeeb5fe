"""Retrieval for SearchQA behind one interface: BM25 over a local corpus, or a Search-R1 server.

A corpus is Search-R1's JSONL: one ``{"id": ..., "contents": "\\"Title\\"\\ntext"}`` per line,
the title on the first line of ``contents``. A retrieval server speaks Search-R1's
``POST /retrieve {"queries": [...], "topk": k, "return_scores": bool}`` and answers
``{"result": [[{"document": {"id", "contents"}, "score": s}, ...], ...]}``.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Protocol

from horizonrl.envs.base import EnvironmentFailure, run_blocking


@dataclass(frozen=True)
class Document:
    title: str
    text: str
    score: float = 0.0

    @staticmethod
    def from_contents(contents: str, score: float = 0.0) -> "Document":
        title, _, text = contents.partition("\n")
        return Document(title.strip().strip('"'), text.strip(), score)


class Retriever(Protocol):
    async def search(self, query: str, topk: int) -> list[Document]:
        """The ``topk`` best documents for ``query``, best first."""


class BM25Retriever:
    """BM25 (bm25s) over an in-memory list of Search-R1 ``contents`` strings."""

    def __init__(self, contents: list[str]) -> None:
        import bm25s

        if not contents:
            raise ValueError("the corpus is empty")
        self._contents = contents
        self._index = bm25s.BM25()
        self._index.index(bm25s.tokenize(contents, stopwords="en", show_progress=False), show_progress=False)
        self._lock = threading.Lock()  # bm25s retrieval is not documented as thread-safe

    def search_blocking(self, query: str, topk: int) -> list[Document]:
        import bm25s

        k = min(topk, len(self._contents))
        tokens = bm25s.tokenize([query], stopwords="en", show_progress=False)
        if not tokens.vocab:
            return []
        with self._lock:
            ids, scores = self._index.retrieve(tokens, k=k, show_progress=False)
        return [Document.from_contents(self._contents[int(i)], float(s)) for i, s in zip(ids[0], scores[0])]

    async def search(self, query: str, topk: int) -> list[Document]:
        return await run_blocking(self.search_blocking, query, topk)


class RemoteRetriever:
    """Client of a Search-R1-compatible retrieval server (``POST {url}/retrieve``)."""

    def __init__(self, url: str, timeout_s: float = 30.0, retries: int = 2) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.retries = retries

    async def search(self, query: str, topk: int) -> list[Document]:
        import aiohttp

        payload = {"queries": [query], "topk": topk, "return_scores": True}
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            try:
                timeout = aiohttp.ClientTimeout(total=self.timeout_s)
                async with aiohttp.ClientSession(timeout=timeout) as session:
                    async with session.post(f"{self.url}/retrieve", json=payload) as response:
                        if response.status >= 400:
                            raise EnvironmentFailure(f"retrieval server answered HTTP {response.status}")
                        body = await response.json()
                hits = body["result"][0]
                return [Document.from_contents(hit["document"]["contents"], float(hit.get("score", 0.0)))
                        if isinstance(hit, dict) and "document" in hit
                        else Document.from_contents(hit["contents"]) for hit in hits]
            except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, TypeError, ValueError) as error:
                last = error
                await asyncio.sleep(0.2 * (attempt + 1))
        raise EnvironmentFailure(f"retrieval server {self.url} failed: {last!r}")


def format_information(documents: list[Document]) -> str:
    """Search-R1's rendering: ``Doc 1(Title: t) text`` lines."""
    return "\n".join(f"Doc {i}(Title: {d.title}) {d.text}" for i, d in enumerate(documents, start=1))
