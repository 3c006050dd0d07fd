"""SuffixIndex: longest-suffix matches, all continuations with counts, segments, speed."""

from __future__ import annotations

import random
import time

import pytest

from draftmesh.draft.suffix import Branch, SuffixIndex

ALL = 10**9  # no cap on occurrences


def brute_force(segments: list[list[int]], context: list[int], min_ngram: int, max_ngram: int):
    """Linear-scan reference: (match length, ends latest first) over the concatenated segments."""
    hay: list[int] = []
    for i, seg in enumerate(segments):
        hay += ([-1] if i and hay else []) + seg
    for n in range(min(max_ngram, len(context)), min_ngram - 1, -1):
        gram = context[-n:]
        ends = [e for e in range(n, len(hay)) if hay[e - n : e] == gram and hay[e] != -1]
        if ends:
            return n, sorted(ends, reverse=True)
    return 0, []


def test_longest_match_wins_over_shorter_ones():
    #        0  1  2  3  4  5  6  7  8  9
    hay = [1, 2, 3, 4, 9, 7, 3, 4, 5, 6]
    found = SuffixIndex(hay).lookup([0, 2, 3, 4], max_len=3)
    assert found.length == 3
    assert found.branches == [Branch((9, 7, 3), 1)]


def test_every_distinct_continuation_with_its_count():
    hay = [5, 6, 7, 1, 1, 0, 5, 6, 7, 2, 2, 0, 5, 6, 7, 1, 1, 0]
    found = SuffixIndex(hay).lookup([9, 5, 6, 7], max_len=2)
    assert found.length == 3
    assert found.branches == [Branch((1, 1), 2), Branch((2, 2), 1)]


def test_ties_are_broken_by_recency_and_branches_capped():
    hay = [5, 1, 5, 2, 5, 3]
    found = SuffixIndex(hay).lookup([5], max_len=1, max_branches=2)
    assert found.branches == [Branch((3,), 1), Branch((2,), 1)]


def test_the_context_itself_is_not_a_match():
    # prompt lookup: the haystack ends with the context; its own occurrence has no continuation
    hay = [1, 2, 3, 8, 2, 3]
    found = SuffixIndex(hay).lookup(hay, max_len=4)
    assert found.length == 2  # [8, 2, 3] and longer suffixes occur only at the very end
    assert found.branches == [Branch((8, 2, 3), 1)]


def test_no_match_and_min_ngram():
    index = SuffixIndex([1, 2, 3, 4], min_ngram=2)
    assert not index.lookup([9, 3], max_len=4)  # only one token would match
    assert SuffixIndex([1, 2, 3, 4], min_ngram=1).lookup([9, 3], max_len=4).branches == [Branch((4,), 1)]
    assert not index.lookup([], max_len=4)
    assert not index.lookup([2, 3], max_len=0)


def test_truncated_continuation_counts_towards_its_extension():
    # repeating output "A B C A B C A B": the latest occurrence of "A B" is cut by the end
    a, b, c = 10, 11, 12
    hay = [a, b, c, a, b, c, a, b, c, a, b]
    found = SuffixIndex(hay).lookup([a, b], max_len=6)
    assert found.branches == [Branch((c, a, b, c, a, b), 3)]


def test_segments_bound_matches_and_continuations():
    index = SuffixIndex()
    index.extend([1, 2, 3])
    index.extend([4, 5, 6], new_segment=True)
    assert index.lookup([3, 4], max_len=2).length == 1  # no n-gram spans a boundary
    assert index.lookup([1, 2], max_len=5).branches == [Branch((3,), 1)]  # stops at the boundary


def test_max_occurrences_keeps_the_most_recent():
    hay = [7, 1, 7, 2, 7, 3, 7, 4]
    length, ends = SuffixIndex(hay).occurrences([7], max_occurrences=2)
    assert (length, ends) == (1, [7, 5])


@pytest.mark.parametrize("min_ngram,max_ngram", [(1, 8), (2, 4), (3, 3)])
def test_matches_a_linear_scan_on_random_sequences(min_ngram, max_ngram):
    rng = random.Random(min_ngram * 31 + max_ngram)
    for _ in range(60):
        segments = [
            [rng.randrange(4) for _ in range(rng.randrange(0, 40))] for _ in range(rng.randrange(1, 4))
        ]
        bulk = SuffixIndex(min_ngram=min_ngram, max_ngram=max_ngram)
        stepwise = SuffixIndex(min_ngram=min_ngram, max_ngram=max_ngram)
        for seg in segments:
            bulk.extend(seg, new_segment=True)
            stepwise.extend([], new_segment=True)
            for token in seg:
                stepwise.extend([token])
        for _ in range(10):
            context = [rng.randrange(4) for _ in range(rng.randrange(0, 10))]
            expected = brute_force(segments, context, min_ngram, max_ngram)
            assert bulk.occurrences(context, max_occurrences=ALL) == expected
            assert stepwise.occurrences(context, max_occurrences=ALL) == expected


def test_lookup_time_does_not_grow_with_the_haystack(encode):
    """Regression guard against a linear scan: a 50k-token haystack answers in well under 1 ms."""
    text = " ".join(
        f"item {i % 997} maps to value {i * 7919 % 10007}; then step {i % 13}." for i in range(4000)
    )
    ids = encode(text)[:50_000]
    assert len(ids) == 50_000
    index = SuffixIndex(ids)
    rng = random.Random(0)
    contexts = [ids[p - 16 : p] for p in (rng.randrange(16, len(ids)) for _ in range(300))]
    start = time.perf_counter()
    for context in contexts:
        assert index.lookup(context, max_len=16)
    per_call = (time.perf_counter() - start) / len(contexts)
    assert per_call < 1e-3, f"{per_call * 1e6:.0f} us per lookup"
