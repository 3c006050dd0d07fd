"""Prompt lookup: continuations of the current suffix found earlier in prompt + output.

Unlike transformers' prompt lookup, which drafts the first match only, every distinct
continuation of the longest matching suffix is returned, so a tree can hold them all
and the target picks whichever it agrees with.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from draftmesh.draft.base import DraftContext, Proposal


class PromptLookupSource:
    name = "prompt_lookup"

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, max_len: int = 10, max_proposals: int = 8) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if max_len < 1 or max_proposals < 1:
            raise ValueError("max_len and max_proposals must be >= 1")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.max_len, self.max_proposals = max_len, max_proposals

    def propose(self, ctx: DraftContext) -> list[Proposal]:
        ids = np.asarray(ctx.token_ids, dtype=np.int64)
        n_tokens = len(ids)
        for n in range(min(self.max_ngram, n_tokens - 1), self.min_ngram - 1, -1):
            # windows ending before the last token, so each match has a continuation
            windows = sliding_window_view(ids[:-1], n)
            starts = np.flatnonzero((windows == ids[-n:]).all(axis=1))
            if len(starts) == 0:
                continue
            counts: Counter[tuple[int, ...]] = Counter()
            latest: dict[tuple[int, ...], int] = {}
            for s in starts.tolist():
                cont = tuple(ids[s + n : s + n + self.max_len].tolist())
                if cont:
                    counts[cont] += 1
                    latest[cont] = s
            ranked = sorted(counts, key=lambda c: (-counts[c], -latest[c]))[: self.max_proposals]
            total = sum(counts[c] for c in ranked)
            # Longer matched suffixes and more frequent continuations are likelier to be right.
            strength = n / self.max_ngram
            return [Proposal(self.name, token_ids=c, confidence=strength * counts[c] / total) for c in ranked]
        return []
