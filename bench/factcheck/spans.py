"""The texts the fact-check bench annotates: draft-like windows, whole sentences and long outputs
of the packaged NER corpus, distinct and reproducible from a seed."""

from __future__ import annotations

import random
import statistics
import uuid
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

from draftmesh.factcheck.protocol import SpanEntry

CORPUS = Path(str(resources.files("draftmesh.factcheck") / "data" / "ner_corpus.txt"))
"""The fact-check service's own sentences (``services/factcheck/data``), read as data only."""


WINDOW_WORDS = (4, 12)
"""Draft-like spans: this many consecutive words of one corpus sentence."""

CATEGORIES = ("window", "sentence", "output")


@dataclass(frozen=True)
class Span:
    """A text to annotate: ``window``/``sentence`` go as drafts, ``output`` as an output."""

    category: str
    text: str

    def entry(self, request_id: str = "") -> SpanEntry:
        if self.category == "output":
            return SpanEntry.for_text("output", self.text, request_id=request_id or f"bench-{uuid.uuid4().hex[:12]}")
        return SpanEntry.for_text("draft", self.text)


def read_sentences(path: Path = CORPUS) -> list[str]:
    lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


class SpanMaker:
    """Distinct spans from the corpus sentences, reproducible from a seed."""

    def __init__(self, sentences: Sequence[str], seed: int) -> None:
        if not sentences:
            raise ValueError("no sentences to build spans from")
        self.sentences = list(sentences)
        self.rng = random.Random(seed)
        self.seen: set[str] = set()
        self._sentence_order = list(range(len(self.sentences)))
        self.rng.shuffle(self._sentence_order)
        self._next_sentence = 0

    def _fresh(self, make) -> str:
        for _ in range(1000):
            text = make()
            if text not in self.seen:
                self.seen.add(text)
                return text
        raise ValueError("the corpus has too few distinct spans for the requested sizes")

    def window(self) -> Span:
        def make() -> str:
            words = self.rng.choice(self.sentences).split()
            lo, hi = WINDOW_WORDS
            n = self.rng.randint(min(lo, len(words)), min(hi, len(words)))
            start = self.rng.randint(0, len(words) - n)
            return " " + " ".join(words[start : start + n])  # a draft continues the text: leading space

        return Span("window", self._fresh(make))

    def sentence(self) -> Span:
        def make() -> str:
            i = self._sentence_order[self._next_sentence % len(self._sentence_order)]
            self._next_sentence += 1
            return " " + self.sentences[i]

        return Span("sentence", self._fresh(make))

    def output(self, chars: int) -> Span:
        def make() -> str:
            i = self.rng.randrange(len(self.sentences))
            parts: list[str] = []
            while sum(len(p) + 1 for p in parts) < chars:
                parts.append(self.sentences[i % len(self.sentences)])
                i += 1
            return " ".join(parts)

        return Span("output", self._fresh(make))

    def drafts(self, n: int) -> list[Span]:
        """Two draft windows for every whole sentence."""
        return [self.sentence() if i % 3 == 2 else self.window() for i in range(n)]


def describe_spans(spans: Sequence[Span]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for category in CATEGORIES:
        texts = [s.text for s in spans if s.category == category]
        if texts:
            out[category] = {
                "count": len(texts),
                "chars_mean": round(statistics.fmean(len(t) for t in texts), 1),
                "chars_min": min(len(t) for t in texts),
                "chars_max": max(len(t) for t in texts),
                "words_mean": round(statistics.fmean(len(t.split()) for t in texts), 1),
            }
    return out
