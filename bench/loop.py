"""The interleaved loop: warm-up, then repeats x items x methods with the method order changing
from item to item (a Williams design), so background noise, and what one method leaves behind
for the next (caches, another engine's processes), hits every method alike."""

from __future__ import annotations

import sys
from typing import Callable, Sequence

from draftmesh.bench.fidelity import check_identical, mismatch_message
from draftmesh.bench.items import ItemResult, MethodRunner, PreparedItem
from draftmesh.bench.methods import PLAIN

WARMUP_TOKENS = 8


def williams_order(n: int, index: int) -> list[int]:
    """Row ``index`` of a Williams design over ``n`` methods: over a cycle of ``n`` rows (``2n`` for
    odd ``n``) every method runs in every position, and right after every other method, equally
    often. A plain rotation keeps the cyclic order, so one method always ran right after the same
    other one (the single-stream bench's plain after vLLM's n-gram run, every item)."""
    if n == 0:
        return []
    base, lo, hi = [0], 1, n - 1
    while len(base) < n:
        base.append(lo)
        lo += 1
        if len(base) < n:
            base.append(hi)
            hi -= 1
    rows = n if n % 2 == 0 else 2 * n
    r = index % rows
    row = [(b + r) % n for b in base]
    return row if r < n else row[::-1]


def item_order(runners: Sequence[MethodRunner], shift: int) -> list[MethodRunner]:
    """The runners in row ``shift`` of a Williams design (``williams_order``); then a runner with
    ``run_after = NAME`` is moved right behind runner NAME when it came first (runners sharing
    learned state, see ``MeshRunner``)."""
    order = [runners[i] for i in williams_order(len(runners), shift)]
    for r in list(order):
        after = getattr(r, "run_after", None)
        names = [x.name for x in order]
        if after in names and names.index(r.name) < names.index(after):
            order.remove(r)
            order.insert([x.name for x in order].index(after) + 1, r)
    return order


def execute(
    runners: Sequence[MethodRunner],
    items: Sequence[PreparedItem],
    repeats: int = 1,
    *,
    warmup: bool = True,
    progress: bool = True,
    warn: Callable[[str], None] | None = None,
    tokenizer=None,
) -> list[ItemResult]:
    """Warm up, then run repeats x items x methods interleaved; return one result per (item, method).

    Mismatches with plain are reported through ``warn`` as soon as an item is done.
    """
    from tqdm.auto import tqdm

    if not runners or runners[0].name != PLAIN:
        raise ValueError("the first runner must be plain (the reference)")
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    results = {
        (it.id, r.name): ItemResult(it.id, it.kind, r.name, lossless=r.lossless,
                                   other_engine=getattr(r, "other_engine", False)) for it in items for r in runners
    }
    bar = tqdm(
        total=repeats * len(items) * len(runners), file=sys.stderr, desc="bench", unit="gen",
        disable=not progress, dynamic_ncols=True,
    )
    say = warn or (lambda msg: tqdm.write(msg, file=sys.stderr))
    warned: set[tuple[str, str]] = set()
    try:
        if warmup and items:
            first = items[0]
            short = PreparedItem(first.item, first.prompt_ids, min(WARMUP_TOKENS, first.max_new_tokens))
            for r in runners:
                bar.set_postfix_str(f"warm-up {r.name}", refresh=True)
                r.reset()
                r.run(short)
        for rep in range(repeats):
            for r in runners:
                r.reset()
            for index, it in enumerate(items):
                for r in item_order(runners, index + rep):
                    bar.set_postfix_str(f"{it.id} {r.name}", refresh=False)
                    results[(it.id, r.name)].runs.append(r.run(it))
                    bar.update(1)
                row = [results[(it.id, r.name)] for r in runners]
                for bad in check_identical(row):
                    if (bad.item_id, bad.method) not in warned:
                        warned.add((bad.item_id, bad.method))
                        plain_ids = results[(it.id, PLAIN)].runs[bad.mismatch_repeat].token_ids
                        say(mismatch_message(bad, plain_ids, tokenizer))
    finally:
        bar.close()
    out = list(results.values())
    check_identical(out)
    return out
