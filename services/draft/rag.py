"""The ``rag`` source: draft continuations from passages retrieved for the prompt (as REST does).

Answers often quote documentation, code or the documents sent with the request. Once per
request the prompt retrieves the top-k passages of a corpus (.txt/.md files, chunked into
overlapping token windows); every step, the current suffix is matched in those passages
plus the request's own ``ctx.documents`` (always searched), and each distinct
continuation becomes a proposal weighted by how often it follows the suffix.

Retrieval is BM25 (``bm25s``, Snowball stemming via ``PyStemmer``), chosen by measuring on
10 crafted paraphrased questions, each with one relevant passage hidden among 11.3k
distractor passages (128-token chunks of package docs and sources), on 2 CPU cores:

=====================  ===========  ===========  ==============
retriever              index        per query    relevant@3
=====================  ===========  ===========  ==============
bm25s + PyStemmer      0.6 s        0.15 ms      10/10
bm25s, no stemming     0.7 s        0.13 ms      9/10
all-MiniLM-L6-v2       520 s        12.9 ms      10/10
=====================  ===========  ===========  ==============

Dense retrieval found nothing more, costs ~85x more per query and needs minutes of
embedding at startup; and a passage only helps drafting when it shares literal tokens with
the answer, which is exactly what a lexical ranker scores.

Per-request state is bounded. The request's index (its retrieved passages and documents) is
built once by ``prepare``, when the request is submitted and outside every batched step (a
65k-token document set takes ~2.6 s of one core and ~33 MB), kept on the request's
draft context and freed by ``release`` when the request ends. All live indexes share one
byte budget (``budget_bytes``, config ``sources.rag_budget_bytes``): a request whose
documents would take the total over it is not refused, it drafts from its retrieved
passages only (``degraded`` counts them). A context that arrives without prepared state (a
rag hosted outside the verifier sees one context per step over the wire) falls back to a
cache of at most ``max_requests`` indexes under the same budget, oldest evicted first.

A retrieved passage is indexed together with ``max_tokens`` tokens after it, so a match at
its end still has a continuation; passages that overlap or touch are merged first so a
shared stretch is not counted twice.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Protocol, Sequence

import bm25s
import numpy as np
import Stemmer

from draftmesh.draft.base import DraftContext, Proposal
from draftmesh.draft.suffix import SuffixIndex

CORPUS_SUFFIXES = (".txt", ".md")

INDEX_BYTES_PER_TOKEN = 800
"""What ``SuffixIndex.nbytes`` comes to per indexed token with n-grams 2..8 (an upper estimate),
used to decide before building whether documents fit the budget; measured 526 on Python
source (``tests/security/test_bounds_documents.py``), so this errs towards degrading early."""


class Prepared:
    """One request's index and the bytes it is charged against the budget."""

    __slots__ = ("index", "nbytes", "degraded", "released")

    def __init__(self, index: SuffixIndex, nbytes: int, degraded: bool) -> None:
        self.index, self.nbytes, self.degraded, self.released = index, nbytes, degraded, False


class Tokenizer(Protocol):
    """The target model's tokenizer (a transformers tokenizer satisfies it)."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


def corpus_files(paths: Sequence[str | os.PathLike[str]]) -> list[Path]:
    """The .txt/.md files named by ``paths``: files as given, folders searched recursively."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in CORPUS_SUFFIXES)
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"rag corpus path {p} does not exist")
    return files


class RagSource:
    """Draft source ``rag``: suffix matches in retrieved passages and request documents."""

    name = "rag"

    def __init__(
        self,
        tokenizer: Tokenizer,
        paths: Sequence[str | os.PathLike[str]] = (),
        *,
        chunk_tokens: int = 128,
        overlap: int = 32,
        top_k: int = 4,
        query_tokens: int = 256,
        max_proposals: int = 4,
        max_tokens: int = 16,
        min_ngram: int = 2,
        max_ngram: int = 8,
        max_requests: int = 8,
        budget_bytes: int = 512 << 20,
    ) -> None:
        if not 0 <= overlap < chunk_tokens:
            raise ValueError(f"need 0 <= overlap < chunk_tokens, got {overlap}, {chunk_tokens}")
        self.tokenizer = tokenizer
        self.top_k, self.query_tokens = top_k, query_tokens
        self.max_proposals, self.max_tokens = max_proposals, max_tokens
        self.min_ngram, self.max_ngram, self.max_requests = min_ngram, max_ngram, max_requests
        if budget_bytes < 0:
            raise ValueError(f"rag budget_bytes must be >= 0, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.live_bytes = 0
        """Bytes of every live index: prepared requests' and the fallback cache's."""
        self.live_prepared = 0
        self.degraded = 0
        """Requests whose documents did not fit the budget (they drafted from passages only)."""
        self._docs: list[list[int]] = []
        self._passages: list[tuple[int, int, int]] = []  # (doc, start, stop) token spans
        for path in corpus_files(paths):
            ids = self._encode(path.read_text(encoding="utf-8", errors="replace"))
            if not ids:
                continue
            doc = len(self._docs)
            self._docs.append(ids)
            for start in range(0, max(1, len(ids) - overlap), chunk_tokens - overlap):
                self._passages.append((doc, start, min(start + chunk_tokens, len(ids))))
        self._stemmer = Stemmer.Stemmer("english")
        self._bm25: bm25s.BM25 | None = None
        if self._passages:
            texts = [tokenizer.decode(self._docs[d][a:b]) for d, a, b in self._passages]
            self._bm25 = bm25s.BM25()
            self._bm25.index(self._words(texts), show_progress=False)
        self._requests: OrderedDict[object, tuple[SuffixIndex, int]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """Number of corpus passages."""
        return len(self._passages)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _words(self, texts: list[str]) -> list[list[str]]:
        return bm25s.tokenize(
            texts, stopwords="english", stemmer=self._stemmer, return_ids=False, show_progress=False
        )

    def retrieve(self, query: str) -> list[int]:
        """Indices of the top-k passages for ``query``, best first (only those sharing a term)."""
        if self._bm25 is None:
            return []
        words = self._words([query])[0]
        if not words:
            return []
        scores = self._bm25.get_scores(words)
        top = np.argsort(-scores, kind="stable")[: self.top_k]
        return [int(i) for i in top if scores[i] > 0]

    def passage_ids(self, passage: int) -> list[int]:
        """Token ids of one corpus passage (``retrieve`` returns passage indices)."""
        doc, start, stop = self._passages[passage]
        return self._docs[doc][start:stop]

    # ------------------------------------------------------------------ per-request state
    def prepare(self, ctx: DraftContext) -> Prepared:
        """Build the request's index (once, before its first step) and charge it to the budget;
        documents that would not fit are left out (the request degrades, it never fails)."""
        docs = [self._encode(text) for text in ctx.documents]
        want = INDEX_BYTES_PER_TOKEN * sum(len(d) for d in docs)
        with self._lock:
            self._evict_cache(self.budget_bytes - want)
            degraded = bool(docs) and self.live_bytes + want > self.budget_bytes
            reserved = 0 if degraded else want  # held while building, so concurrent prepares see it
            self.live_bytes += reserved
            self.degraded += degraded
        index = self._build(ctx, [] if degraded else docs)
        nbytes = index.nbytes()
        with self._lock:
            self.live_bytes += nbytes - reserved
            self.live_prepared += 1
        return Prepared(index, nbytes, degraded)

    def release(self, state: Prepared) -> None:
        """The request ended: its index is freed and no longer counts."""
        with self._lock:
            if state.released:
                return
            state.released = True
            self.live_bytes -= state.nbytes
            self.live_prepared -= 1
        state.index = None  # type: ignore[assignment]

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"index_bytes": self.live_bytes, "prepared": self.live_prepared,
                    "cached": len(self._requests), "degraded": self.degraded, "budget_bytes": self.budget_bytes}

    def propose(self, ctx: DraftContext) -> list[Proposal]:
        prepared = ctx.prepared.get(self.name)
        index = prepared.index if isinstance(prepared, Prepared) and prepared.index is not None else self._index(ctx)
        max_len = min(self.max_tokens, max(1, ctx.size_hint))
        found = index.lookup(ctx.token_ids, max_len, max_branches=self.max_proposals)
        total = sum(b.count for b in found.branches)
        strength = found.length / self.max_ngram
        return [
            Proposal(source=self.name, token_ids=b.tokens, confidence=strength * b.count / total)
            for b in found.branches
        ]

    def _index(self, ctx: DraftContext) -> SuffixIndex:
        """A context without prepared state: the fallback cache (by request id), bounded by
        count and by the byte budget."""
        key = ctx.request_id or hash((tuple(ctx.token_ids[: ctx.prompt_len]), tuple(ctx.documents)))
        with self._lock:
            hit = self._requests.get(key)
            if hit is not None:
                self._requests.move_to_end(key)
                return hit[0]
        docs = [self._encode(text) for text in ctx.documents]
        want = INDEX_BYTES_PER_TOKEN * sum(len(d) for d in docs)
        with self._lock:
            self._evict_cache(self.budget_bytes - want)
            if docs and self.live_bytes + want > self.budget_bytes:
                self.degraded += 1
                docs = []
            reserved = want if docs else 0
            self.live_bytes += reserved
        index = self._build(ctx, docs)
        nbytes = index.nbytes()
        with self._lock:
            self._requests[key] = (index, nbytes)
            self.live_bytes += nbytes - reserved
            self._evict_cache(self.budget_bytes, self.max_requests)
        return index

    def _evict_cache(self, room: int, max_count: int | None = None) -> None:
        """Drop the oldest cached indexes until live bytes are within ``room`` (and the cache
        within ``max_count``); prepared indexes are never evicted (their requests are running).
        Call with the lock held."""
        while self._requests and (self.live_bytes > room or (max_count is not None and len(self._requests) > max_count)):
            _, (_, nbytes) = self._requests.popitem(last=False)
            self.live_bytes -= nbytes

    def _build(self, ctx: DraftContext, docs: Sequence[Sequence[int]]) -> SuffixIndex:
        """Index the retrieved passages (worst first: recent occurrences win ties) and documents."""
        prompt = ctx.token_ids[: ctx.prompt_len]
        query = self.tokenizer.decode(prompt[-self.query_tokens :], skip_special_tokens=True)
        spans: list[list[int]] = []  # [doc, start, stop, best rank], merged where they meet
        for rank, passage in sorted(enumerate(self.retrieve(query)), key=lambda rp: self._passages[rp[1]]):
            doc, start, stop = self._passages[passage]
            stop = min(stop + self.max_tokens, len(self._docs[doc]))
            if spans and spans[-1][0] == doc and start <= spans[-1][2]:
                spans[-1][2] = max(spans[-1][2], stop)
                spans[-1][3] = min(spans[-1][3], rank)
            else:
                spans.append([doc, start, stop, rank])
        index = SuffixIndex(min_ngram=self.min_ngram, max_ngram=self.max_ngram)
        for doc, start, stop, _ in sorted(spans, key=lambda s: -s[3]):
            index.extend(self._docs[doc][start:stop], new_segment=True)
        for ids in docs:
            index.extend(ids, new_segment=True)
        return index
