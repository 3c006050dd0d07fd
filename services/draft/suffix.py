"""Suffix matching on token ids: what followed earlier occurrences of the current suffix?

Prompt lookup, session recall, re-synchronising on a stored answer and retrieval drafting
all ask one question of a token sequence (the haystack): where did the last few committed
tokens occur before, and what came next each time? ``SuffixIndex`` answers it every decode
step, so a query must not scan the haystack.

The index is the hash chain of LZ77 compressors, one per n-gram length n in
[min_ngram, max_ngram]: a dict maps the n-gram's 64-bit polynomial hash to the end of its
latest occurrence, and a flat array links every occurrence to the previous one with the
same hash. Appending a token costs O(max_ngram), so prompt+generated is indexed
incrementally as tokens are committed; a query costs O(max_ngram + occurrences visited),
independent of the haystack's length, and visits the most recent occurrences first
(measured on SmolLM2 tokens of Python source, 2 shared cores: ~15-60 us per lookup on 2k-
and 50k-token haystacks, ~4 us per appended token).
A suffix automaton would answer the same queries, but keeping its occurrence counts
current under appends is not O(1), and it needs a dict per state. Hash collisions are
harmless: every candidate occurrence is checked against the actual tokens.

Several documents can share one index (``extend(..., new_segment=True)``): n-grams never
span a segment boundary and continuations stop at it.
"""

from __future__ import annotations

import sys
from array import array
from dataclasses import dataclass
from typing import NamedTuple, Sequence

_MASK = (1 << 64) - 1
_BASE = 0x9E3779B97F4A7C15  # odd 64-bit multiplier (golden ratio): spreads token ids over the word
_SEP = -1  # segment boundary; never equal to a token id


class Branch(NamedTuple):
    """One distinct continuation and how many occurrences of the matched suffix it followed."""

    tokens: tuple[int, ...]
    count: int


@dataclass(frozen=True)
class Lookup:
    """The result of matching a context against an index.

    ``length`` is how many trailing context tokens matched (0: no match); ``branches`` are
    the distinct continuations, most frequent first (ties: most recent first).
    """

    length: int
    branches: list[Branch]

    def __bool__(self) -> bool:
        return bool(self.branches)


class SuffixIndex:
    """An append-only token sequence indexed for longest-suffix-match queries."""

    def __init__(self, tokens: Sequence[int] = (), *, min_ngram: int = 1, max_ngram: int = 8) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self._width = max_ngram - min_ngram + 1
        self._powers = [pow(_BASE, j, 1 << 64) for j in range(max_ngram)]
        self._tokens: list[int] = []
        self._heads: list[dict[int, int]] = [{} for _ in range(self._width)]
        # _prev[end * width + (n - min_ngram)]: previous end of an n-gram with the same hash, or -1
        self._prev = array("q", [-1] * self._width)
        self._segment_start = 0
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    def nbytes(self) -> int:
        """Memory the index holds, estimated from its containers (within ~10% of what
        tracemalloc measures; ``tests/security/test_bounds_documents.py``): the token list and
        its int objects, one hash dict per n-gram length with its key and value ints, and the
        chain array. About 0.5 KB a token with n-grams 2..8 (65k tokens of Python source: 33 MiB)."""
        n = len(self._tokens)
        heads = sum(sys.getsizeof(h) + 36 * len(h) for h in self._heads)  # a 36-byte int per hash key
        chain = self._prev.buffer_info()[1] * self._prev.itemsize
        # a 28-byte int per token, and one per position for the end the dicts share
        return sys.getsizeof(self._tokens) + 56 * n + heads + chain

    @property
    def tokens(self) -> Sequence[int]:
        """The haystack, segment boundaries included as -1 (read-only by convention)."""
        return self._tokens

    def extend(self, tokens: Sequence[int], *, new_segment: bool = False) -> None:
        """Append tokens; with ``new_segment`` they start a document of their own."""
        if new_segment and self._tokens:
            self._append(_SEP)
            self._segment_start = len(self._tokens)
        for token in tokens:
            self._append(int(token))

    def _append(self, token: int) -> None:
        seq = self._tokens
        seq.append(token)
        end = len(seq)
        row = [-1] * self._width
        if token != _SEP:
            h = 0
            lo, powers = self.min_ngram, self._powers
            for n in range(1, min(self.max_ngram, end - self._segment_start) + 1):
                h = (h + (seq[end - n] + 1) * powers[n - 1]) & _MASK
                if n >= lo:
                    heads = self._heads[n - lo]
                    row[n - lo] = heads.get(h, -1)
                    heads[h] = end
        self._prev.extend(row)

    def _suffix_hashes(self, tail: Sequence[int]) -> list[int]:
        """Hash of the last n tokens of ``tail`` for n = 1..len(tail), same scheme as ``_append``."""
        hashes, h = [], 0
        for n in range(1, len(tail) + 1):
            h = (h + (tail[-n] + 1) * self._powers[n - 1]) & _MASK
            hashes.append(h)
        return hashes

    def occurrences(self, context: Sequence[int], *, max_occurrences: int = 128) -> tuple[int, list[int]]:
        """Longest context suffix (up to ``max_ngram``) that occurs followed by at least one token.

        Returns (match length, end positions of its occurrences, latest first, at most
        ``max_occurrences``); (0, []) when not even ``min_ngram`` tokens match. An end
        position is the haystack index of the first continuation token.
        """
        tail = [int(t) for t in context[-self.max_ngram :]]
        if len(tail) < self.min_ngram:
            return 0, []
        hashes = self._suffix_hashes(tail)
        seq, size, prev, width, lo = self._tokens, len(self._tokens), self._prev, self._width, self.min_ngram
        for n in range(len(tail), lo - 1, -1):
            gram = tail[-n:]
            ends: list[int] = []
            end = self._heads[n - lo].get(hashes[n - 1], -1)
            while end >= 0 and len(ends) < max_occurrences:
                if end < size and seq[end] != _SEP and seq[end - n : end] == gram:
                    ends.append(end)
                end = prev[end * width + n - lo]
            if ends:
                return n, ends
        return 0, []

    def lookup(
        self, context: Sequence[int], max_len: int, *, max_branches: int = 8, max_occurrences: int = 128
    ) -> Lookup:
        """All distinct continuations (up to ``max_len`` tokens) of the longest matching suffix.

        A continuation cut short by the end of the haystack or of its segment is only
        missing knowledge, so it is counted towards the most frequent longer branch that
        extends it instead of standing as a branch of its own.
        """
        if max_len <= 0:
            return Lookup(0, [])
        length, ends = self.occurrences(context, max_occurrences=max_occurrences)
        seq = self._tokens
        counts: dict[tuple[int, ...], int] = {}
        for end in ends:
            cont = seq[end : end + max_len]
            key = tuple(cont[: cont.index(_SEP)] if _SEP in cont else cont)
            counts[key] = counts.get(key, 0) + 1
        if any(len(c) < max_len for c in counts):
            _fold_truncated(counts, max_len)
        top = sorted(counts.items(), key=lambda item: -item[1])[:max_branches]  # stable: recency breaks ties
        return Lookup(length, [Branch(tokens, count) for tokens, count in top])


def _fold_truncated(counts: dict[tuple[int, ...], int], max_len: int) -> None:
    """Merge, in place, each truncated continuation into its most frequent extension."""
    for short in sorted(counts, key=len):
        if len(short) >= max_len:
            break
        extensions = [c for c in counts if len(c) > len(short) and c[: len(short)] == short]
        if extensions:
            best = max(extensions, key=lambda c: counts[c])
            counts[best] += counts.pop(short)
