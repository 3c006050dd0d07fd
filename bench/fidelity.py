"""How each method's output compares with plain's: identical token for token (lossless methods
must be), where it first differs and the model's top-2 gap there, and the edit distance (lossy)."""

from __future__ import annotations

from typing import Iterable, Sequence

from draftmesh.bench.items import ItemResult
from draftmesh.bench.methods import PLAIN


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (the shorter length if one is a prefix), None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def check_identical(results: Iterable[ItemResult]) -> list[ItemResult]:
    """Compare every lossless method's output with plain's, repeat by repeat.

    Sets ``identical_to_plain`` / ``first_difference`` / ``mismatch_repeat`` (None for plain
    itself and for lossy methods) and ``stable``; returns the mismatching results, other
    engines' (``other_engine``: compared for agreement only) left out.
    """
    results = list(results)
    plain = {r.item_id: r for r in results if r.method == PLAIN}
    mismatches = []
    for r in results:
        r.stable = all(run.token_ids == r.runs[0].token_ids for run in r.runs)
        if r.method == PLAIN or not r.lossless:
            r.identical_to_plain = None
            continue
        ref = plain.get(r.item_id)
        if ref is None or not ref.runs or not r.runs:
            r.identical_to_plain = None
            continue
        r.identical_to_plain, r.first_difference, r.mismatch_repeat = True, None, None
        for rep, run in enumerate(r.runs):
            want = ref.runs[min(rep, len(ref.runs) - 1)].token_ids
            diff = first_difference(want, run.token_ids)
            if diff is not None:
                r.identical_to_plain, r.first_difference, r.mismatch_repeat = False, diff, rep
                if not r.other_engine:
                    mismatches.append(r)
                break
    return mismatches


def mismatch_message(r: ItemResult, plain_ids: Sequence[int] | None = None, tokenizer=None) -> str:
    where = f"token {r.first_difference}"
    detail = ""
    if plain_ids is not None and r.mismatch_repeat is not None and r.first_difference is not None:
        got = r.runs[r.mismatch_repeat].token_ids
        i = r.first_difference

        def show(ids):
            if i >= len(ids):
                return "(end)"
            tok = ids[i]
            return f"{tok} {tokenizer.decode([tok])!r}" if tokenizer is not None else str(tok)

        detail = f": plain has {show(plain_ids)}, {r.method} has {show(got)}"
    gap = f"; plain top-2 logit gap there {r.mismatch_top2_gap:.3g}" if r.mismatch_top2_gap is not None else ""
    rep = f" (repeat {r.mismatch_repeat + 1})" if r.mismatch_repeat is not None else ""
    return (
        f"!!! OUTPUT MISMATCH: item {r.item_id!r} method {r.method!r} differs from plain at {where}"
        f"{rep}{detail}{gap} !!!"
    )


def edit_distance(a: Sequence[int], b: Sequence[int]) -> int:
    """Levenshtein distance between two token sequences."""
    prev = list(range(len(b) + 1))
    for i, x in enumerate(a, start=1):
        cur = [i]
        for j, y in enumerate(b, start=1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y)))
        prev = cur
    return prev[-1]


def measure_fidelity(results: Iterable[ItemResult]) -> None:
    """Set ``same_as_plain`` and the normalized ``edit_distance`` of every non-plain result."""
    results = list(results)
    plain = {r.item_id: r for r in results if r.method == PLAIN}
    for r in results:
        ref = plain.get(r.item_id)
        if r.method == PLAIN or ref is None or not ref.runs or not r.runs:
            continue
        want, got = ref.runs[0].token_ids, r.runs[0].token_ids
        r.same_as_plain = want == got
        r.edit_distance = edit_distance(want, got) / max(1, len(want), len(got))


def top2_gap(target, prompt_ids: Sequence[int], prefix: Sequence[int]) -> float:
    """Plain decoding's top-1 minus top-2 logit after ``prompt + prefix``."""
    return target.top2_gap([*prompt_ids, *prefix])
