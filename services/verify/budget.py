"""The batch's budget: what a step's forward costs, and which draft nodes it verifies.

``CostModel`` is the single-request cost curve, ``BatchCost`` the batched forward's table
(rows x tokens, measured at load), ``choose_nodes`` the rule that picks the nodes of every
request of a step against them. The rest is what the scheduler learns while it runs, because
the table is measured once, over uniform chains, on a box whose load moves: the step's time
outside the forward (``StepOverhead``), what trees really cost beyond the table
(``TreeCostCorrection``), and whether asking the sources pays at all at a batch size
(``AskingValue``), which the budget cannot see from the nodes it is offered. The tree builder
scores the nodes; this module only weighs them.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from draftmesh.tree import TokenTree


def non_decreasing(values: Sequence[float]) -> list[float]:
    """The non-decreasing sequence nearest ``values`` in least squares (pool adjacent violators):
    runs that dip are replaced by their mean."""
    blocks: list[list[float]] = []  # [sum, count] of each pooled run
    for v in values:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] * blocks[-1][1] > blocks[-1][0] * blocks[-2][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(int(count))]


class CostModel:
    """Verify time of a forward over k tokens relative to one token, interpolated.

    The measured points are fitted to a curve that never falls (``non_decreasing``): a forward over
    more tokens does more work, and where a few rounds on a shared box say otherwise the budget reads
    a tree's tokens as making the forward cheaper, and buys them whatever their acceptance. Measured
    on a 2-core AMD box, the warm-up of one C=2 bench pass read 1 / 2 / 4 / 8 tokens at 1.0 / 0.856 /
    0.874 / 0.986 (its one-token point timed high), where that box's passes took 22.4 ms for a
    one-token forward and 25.0 ms for 8 tokens; fitted, 1-4 tokens cost 0.91 and 8 cost 0.986."""

    def __init__(self, curve: Mapping[int, float]) -> None:
        if not curve or 1 not in curve:
            raise ValueError("a cost curve needs at least the k = 1 point")
        self.ks = sorted(curve)
        self.costs = non_decreasing([float(curve[k]) for k in self.ks])

    def __call__(self, k: int) -> float:
        i = bisect.bisect_left(self.ks, k)
        if i < len(self.ks) and self.ks[i] == k:
            return self.costs[i]
        if i == 0:
            return self.costs[0]
        if i == len(self.ks):  # extrapolate with the last slope
            k0, k1 = self.ks[-2:] if len(self.ks) > 1 else (self.ks[-1], self.ks[-1] + 1)
            c0, c1 = self.costs[-2:] if len(self.costs) > 1 else (self.costs[-1], self.costs[-1])
            return c1 + (k - k1) * (c1 - c0) / (k1 - k0)
        k0, k1, c0, c1 = self.ks[i - 1], self.ks[i], self.costs[i - 1], self.costs[i]
        return c0 + (k - k0) * (c1 - c0) / (k1 - k0)


class BatchCost:
    """Time of one batched forward relative to a batch-1 one-token step, by rows and total tokens.

    Rows 1 is the single-request cost curve; other row counts come from the batched warm-up
    (``TorchTarget.measure_batch_cost``), interpolated over tokens within a row count and
    linearly between the measured row counts (beyond the largest, scaled by rows)."""

    def __init__(self, single: CostModel, batched: Mapping[int, Mapping[int, float]] | None = None) -> None:
        self.models: dict[int, CostModel] = {1: single}
        for rows, curve in (batched or {}).items():
            if rows > 1 and curve:
                # a batch of r rows holds at least r tokens: extend down to k = 1 for the interpolation
                self.models[rows] = CostModel({1: min(curve.values()), **curve})
        self.rows = sorted(self.models)

    def __call__(self, rows: int, tokens: int) -> float:
        rows = max(1, rows)
        tokens = max(tokens, rows)
        i = bisect.bisect_left(self.rows, rows)
        if i < len(self.rows) and self.rows[i] == rows:
            return self.models[rows](tokens)
        if i == len(self.rows):
            top = self.rows[-1]
            return self.models[top](max(1, round(tokens * top / rows))) * rows / top
        r0, r1 = self.rows[i - 1], self.rows[i]
        c0, c1 = self.models[r0](tokens), self.models[r1](tokens)
        return c0 + (rows - r0) * (c1 - c0) / (r1 - r0)


@dataclass
class ScoredTree:
    """One request's candidate nodes for a step and each one's estimated acceptance."""

    tree: TokenTree
    scores: list[float]
    """Each node's calibrated estimate: what the budget weighs."""
    confidences: list[dict[str, float]]
    cap: int
    """The request's own node cap (``max_nodes``): the batch budget never gives it more."""
    raw_scores: list[float] | None = None
    """The estimates before calibration (what the calibration itself is measured against)."""

    def select(self, keep: Sequence[int]) -> TokenTree:
        if not keep:
            return TokenTree()
        # Selecting nodes by score looks at sampled tokens' values: keep only deterministic draws.
        out = self.tree.subtree(keep).strip_q()
        out.source_scores = [self.confidences[i] for i in sorted(keep)]
        out.expected_accepted = sum((self.raw_scores or self.scores)[i] for i in keep)
        return out


def _nearest(by_rows: Mapping[int, object], rows: int):
    """The entry of the batch size nearest ``rows`` (the smaller on a tie); None when empty."""
    if not by_rows:
        return None
    return by_rows[min(by_rows, key=lambda r: (abs(r - rows), r))]


def _add_decayed(sums: dict[int, list[float]], rows: int, decay: float, *values: float) -> None:
    """Add ``values`` to the decayed sums kept for ``rows`` (each old sum times ``decay`` first)."""
    entry = sums.setdefault(rows, [0.0] * len(values))
    for i, v in enumerate(values):
        entry[i] = entry[i] * decay + v


class StepOverhead:
    """What a batch step costs outside its forward (asking the sources, the budget, accepting,
    emitting), in units of a batch-1 one-token forward, averaged over recent steps of the same
    batch size (rows).

    A step pays it whatever its trees hold, so the budget adds it to every forward it weighs: a
    tree's extra tokens are measured against the whole step, not the forward alone. It grows with
    the rows, but far from in proportion: measured on a 2-core box (C=8 over the 30 public items),
    3-5 ms a step at 1 row and 5-10 ms at 8. So it is kept per batch size, not per row: a per-row
    average scaled by the rows read 0.6-1.2 forwards at 8 rows after a few 1-row steps, where 8-row
    steps spent 0.15-0.35, and the budget, seeing every step that dear, bought trees that did not
    pay. A step that admitted a request is left out (``steady=False``): it also grew the KV slab
    and started traces, once per request, which is not what the next step's tree changes. A batch
    size not measured yet reads its neighbours' (interpolated between two; the nearest beyond)."""

    def __init__(self, unit_s: float | None, halflife: float = 32.0) -> None:
        self.unit_s = unit_s if unit_s and unit_s > 0 else None
        self.alpha = 1 - 0.5 ** (1 / halflife)
        self.by_rows: dict[int, float] = {}

    def record(self, step_s: float, forward_s: float, rows: int, *, steady: bool = True) -> None:
        if self.unit_s is None or rows < 1 or not steady:
            return
        sample = max(0.0, step_s - forward_s) / self.unit_s
        prev = self.by_rows.get(rows)
        self.by_rows[rows] = sample if prev is None else prev + self.alpha * (sample - prev)

    def __call__(self, rows: int) -> float:
        if not self.by_rows:
            return 0.0
        if rows in self.by_rows:
            return self.by_rows[rows]
        below = max((r for r in self.by_rows if r < rows), default=None)
        above = min((r for r in self.by_rows if r > rows), default=None)
        if below is None or above is None:
            return _nearest(self.by_rows, rows)
        lo, hi = self.by_rows[below], self.by_rows[above]
        return lo + (rows - below) * (hi - lo) / (above - below)


class TreeCostCorrection:
    """How much dearer (or cheaper) a step's tree tokens are than the warm-up table says, learned
    from the forwards the scheduler times.

    The table (``BatchCost``) is measured once, at load, over uniform chains (r rows of k tokens
    each, a few rounds), and the budget reads it for one thing: what a step's trees add to a
    forward that holds its roots and prefill chunks anyway. Where the real trees cost more (one
    row's bushy tree beside one-token rows, other contexts, a noisy point of the table), every tree
    the budget buys is too big. Measured on a 2-core box at C=8 over the 30 public items (a scratch
    per-step log), forwards with trees took 57.9 ms where the table said 51.3, and forwards of the
    same rows without trees 43.0 against 45.4: their tree tokens cost ~1.7x what the table said,
    and steps the budget expected to make 1.3x a plain step's tokens per unit of time made ~1.0x.

    Per batch size, decayed sums: a forward without trees adds (measured, table) to the plain
    scale (the box's load moves every forward); a forward with trees adds (measured − scale ×
    table's plain part, scale × table's tree part). The factor is their ratio, started at 1 by
    ``prior`` units on both sides and kept within ``bounds``; the budget multiplies each step's
    tree part of the table by it (``choose_nodes``' ``tree_factor``).

    Only forwards without prompt chunks are recorded (the scheduler's choice): a chunk's tens of
    tokens sit where the table's curve is least like the real forward, and an error of a few
    percent on them is the size of a tree's whole part. Measured at C=8 over the 30 public items
    (one pass, a scratch log of what the correction was given): over the 8-row forwards without
    chunks a least-squares fit put the trees' tokens at 1.37x the table against its plain part,
    a replay of the correction over them learned 1.3, and over every forward it had learned 0.84;
    in another such pass 134 of the 766 nodes kept had a 0.2-0.3 acceptance estimate, 19% of them
    were accepted, and at ~1.7 ms a tree token against ~0.18 tokens a ms that is a loss."""

    def __init__(self, unit_s: float | None, halflife: float = 64.0, prior: float = 2.0,
                 bounds: tuple[float, float] = (0.5, 4.0)) -> None:
        self.unit_s = unit_s if unit_s and unit_s > 0 else None
        self.decay = 0.5 ** (1 / halflife)
        self.prior = prior
        self.bounds = bounds
        self.plain: dict[int, list[float]] = {}
        """rows -> [measured, table] of forwards without trees."""
        self.trees: dict[int, list[float]] = {}
        """rows -> [measured beyond the plain part, the table's tree part] of forwards with trees."""

    def _add(self, sums: dict[int, list[float]], rows: int, measured: float, table: float) -> None:
        _add_decayed(sums, rows, self.decay, measured, table)

    def scale(self, rows: int) -> float:
        """Measured over table for forwards without trees (1 until one was measured)."""
        entry = _nearest(self.plain, rows)
        return entry[0] / entry[1] if entry and entry[1] > 0 else 1.0

    def record(self, cost, rows: int, base_tokens: float, tokens: float, forward_s: float, *,
               base_keys: float = 0.0, tree_keys: float = 0.0) -> None:
        """``base_tokens`` and ``tokens``: the forward's tokens without and with its trees. ``base_keys``
        and ``tree_keys``: what its other tokens and its tree tokens cost beyond the table for
        their rows' caches (``key_price``), in the same units."""
        if self.unit_s is None or rows < 1:
            return
        measured = forward_s / self.unit_s
        plain = cost(rows, base_tokens) + base_keys
        if tokens <= base_tokens:
            self._add(self.plain, rows, measured, plain)
            return
        extra = cost(rows, tokens) - cost(rows, base_tokens) + tree_keys
        if extra <= 0:
            return
        scale = self.scale(rows)
        self._add(self.trees, rows, measured - scale * plain, scale * extra)

    def factor(self, rows: int) -> float:
        entry = _nearest(self.trees, rows)
        if entry is None:
            return 1.0
        lo, hi = self.bounds
        return min(hi, max(lo, (entry[0] + self.prior) / (entry[1] + self.prior)))


class AskingValue:
    """Whether asking the sources pays at a batch size, measured on the steps themselves.

    The budget weighs a step's nodes once the sources have answered; what it cannot weigh is the
    asking itself, paid before any tree exists and whether or not one is kept, nor what the trees
    add to the step outside its forward. Measured on a 2-core AMD box at C=8 over the 30 public
    items (2026-12-06/07): a scratch switch that never asked at 6 rows or more read 0.94-1.00x
    plain where the default read 0.91-0.95x, while a model of each ask's gain (its accepted tree
    tokens against its trees' share of the forward and its asking time, at the step's plain rate)
    read +0.03 tokens an ask at 8 rows: about even, as the budget meant, but blind to the rest of
    what asking costs a step (1.7 ms more outside the forward than plain's, of which 0.5 ms an
    asked request is the asking). So nothing is modelled here: per batch size (the step's active
    requests), decayed sums of the tokens and the wall time of steady steps without prompt chunks,
    apart for steps that asked the sources (as the rests allow) and steps that asked nobody.
    Asking pays unless its steps make less than ``1 - slack`` of the others' tokens per second: a
    batch size where it pays a little (at 4 rows its steps read 4% to 19% above the silent ones,
    run to run) must not be turned off by the noise of a few steps, and where it does not pay it
    loses clearly (8 rows: 8-17% below). A batch size without ``min_steps`` (decayed) steps of both
    kinds behind it reads the nearest one that has them. The scheduler keeps both measured: until
    a decision every other step asks; then where asking pays one step in ``2 n`` asks nobody, and
    where it does not one step in ``n`` asks (``builder.asking_probe_every``). A step in which a
    request asks for the first time is not measured: its sources' first call builds the request's
    state (history indexes the prompt and looks up its remembered answers), which, where asking
    does not pay, would all land on the few steps that ask and count against asking."""

    def __init__(self, halflife: float = 64.0, min_steps: float = 8.0, slack: float = 0.05) -> None:
        self.decay = 0.5 ** (1 / halflife)
        self.min_steps = min_steps
        self.slack = slack
        """Asking pays unless its steps make less than ``1 - slack`` of the silent steps' rate."""
        self.asking: dict[int, list[float]] = {}
        """rows -> decayed [tokens, seconds, steps] of the steps that asked."""
        self.silent: dict[int, list[float]] = {}
        """rows -> the same for the steps that asked nobody."""

    def record(self, rows: int, asked: bool, tokens: int, seconds: float) -> None:
        """A steady step without prompt chunks at ``rows``: whether it asked, its tokens and wall time."""
        _add_decayed(self.asking if asked else self.silent, rows, self.decay, tokens, seconds, 1.0)

    def rates(self, rows: int) -> tuple[float, float] | None:
        """Tokens per second of the asking and the silent steps at ``rows``; None until both are measured."""
        a, s = self.asking.get(rows), self.silent.get(rows)
        if a is None or s is None or min(a[2], s[2]) < self.min_steps or a[1] <= 0 or s[1] <= 0:
            return None
        return a[0] / a[1], s[0] / s[1]

    def pays(self, rows: int) -> bool | None:
        """Whether asking pays at ``rows``: measured there, else as at the nearest batch size measured
        (the smaller on a tie), else None (nothing measured yet)."""
        rates = self.rates(rows)
        if rates is None:
            rates = _nearest({r: rates for r in self.asking if (rates := self.rates(r)) is not None}, rows)
        return None if rates is None else rates[0] >= (1.0 - self.slack) * rates[1]


def key_price(slope: float | None, cache_len: int, context: int) -> float:
    """What one token of a row with ``cache_len`` cached tokens costs beyond the table, which was
    measured at ``context`` (``slope``: per cached key, one of ``TorchTarget.key_cost``'s). Shorter
    caches are priced as the table's: the attention they save is small beside the weights, and a
    negative price would let a noisy slope make a tree look free."""
    return slope * max(0, cache_len - context) if slope else 0.0


def choose_nodes(
    candidates: Sequence[ScoredTree | None], cost: Callable[[int, int], float], *, rows: int, base_tokens: int, min_gain: float,
    max_tokens: int | None = None, overhead: float = 0.0, tree_factor: float = 1.0, prefill_tokens: int = 0,
    decoding_rows: int | None = None, node_prices: Sequence[float] | None = None, base_keys: float = 0.0,
    chunk_price: float = 1.0,
) -> list[list[int]]:
    """The nodes to verify, per candidate, for the whole batch's forward.

    Nodes of every request compete by score (a child never scores above its parent, so any
    prefix of the order is ancestor-closed). ``base_tokens`` is what the forward holds anyway
    (every request's root, prefill chunks, fixed trees), ``overhead`` the step's time outside the
    forward (``StepOverhead``), and ``tree_factor`` scales what the trees add to the table
    (``TreeCostCorrection``).

    The kept prefix maximizes expected committed tokens of the batch per unit of step time,
    ``(decoding rows + sum of kept scores) / (cost(rows, base_tokens + kept) + overhead)``, and
    nothing is kept unless that beats a plain step by ``min_gain``. At batch 1 this is the
    single-request builder's rule; as the batch grows each node must pay for a larger forward,
    so trees shrink, then vanish.

    A step that also prefills (``prefill_tokens`` of its ``base_tokens`` are prompt chunks, of
    rows that decode nothing this step or before their first token) is weighed without them:
    its own rate is low because of a prompt it computes whatever its trees hold, and against that
    rate nearly any node looked worth its time (measured at C=8 over the 30 public items: such
    steps kept 17 nodes where the others kept 7). The price of its tree tokens is the rate the
    batch's decoding makes, the best rate of the same step without its chunks (the ratio rule
    above over the decoding rows alone), and the kept prefix maximizes ``sum of kept scores -
    price * what they add to the real forward``: a node is kept when it is worth its tokens' time
    at the rate the batch decodes at (a Dinkelbach step for the batch's tokens per unit of time,
    the prefill being the same work whatever the trees). Without prefill both rules are the same.

    Rows with long caches: ``node_prices[c]`` is what each node of candidate ``c`` costs beyond
    the table (``key_price`` of its row's cache), ``base_keys`` the same for the step's roots.
    Nodes then compete by score per unit of their cost (the table's mean price of a tree token at
    this batch, plus their row's), so a short row's node is bought before a long row's of the same
    score; within a request the order stays by score, so every prefix is still ancestor-closed.
    With no prices (caches at most the table's length) this is the order by score.

    ``chunk_price``: what a prefill chunk's token costs against one of the table's, all of whose
    tokens have logits (``1 - TorchTarget.head_share``): the real forward is read off the table at
    its chunks' tokens so discounted, which is where the trees' tokens land on the table's curve.
    """
    d_rows = rows if decoding_rows is None else decoding_rows
    d_base = base_tokens - prefill_tokens
    prices = list(node_prices) if node_prices is not None else [0.0] * len(candidates)
    pool = []
    for c, cand in enumerate(candidates):
        if cand is None:
            continue
        order = sorted(range(len(cand.scores)), key=lambda i: (-cand.scores[i], i))[: cand.cap]
        pool.extend((cand.scores[i], c, i) for i in order)
    room = len(pool) if max_tokens is None else max(0, min(len(pool), max_tokens - base_tokens))
    if any(prices) and room and d_rows >= 1:
        table_price = max((cost(d_rows, d_base + room) - cost(d_rows, max(d_base, d_rows))) / room, 1e-6)
        pool.sort(key=lambda x: (-x[0] / (table_price + prices[x[1]]), x[1], -x[0], x[2]))
    else:
        pool.sort(key=lambda x: (-x[0], x[1], x[2]))
    pool = pool[:room]
    keep: list[list[int]] = [[] for _ in candidates]
    added = [0.0]  # what the first k nodes' rows' caches add to the table's price of them
    for _, c, _ in pool:
        added.append(added[-1] + prices[c])

    def forward(r: int, base: float, k: int) -> float:
        plain = cost(r, base)
        return plain + base_keys if k == 0 else plain + base_keys + tree_factor * (cost(r, base + k) - plain + added[k])

    # the ratio rule, over the decoding rows and what the step holds besides its prefill chunks
    if d_rows < 1 or d_base < d_rows:
        return keep
    plain = d_rows / (forward(d_rows, d_base, 0) + overhead)
    best_k, best_rate, expected = 0, plain, float(d_rows)
    for k, (score, _, _) in enumerate(pool, start=1):
        expected += score
        rate = expected / (forward(d_rows, d_base, k) + overhead)
        if rate > best_rate:
            best_k, best_rate = k, rate
    if best_rate < min_gain * plain:
        return keep
    if prefill_tokens > 0:  # the real forward's nodes, priced at the rate the batch decodes at
        table_base = base_tokens - prefill_tokens * (1.0 - chunk_price)
        best_k, best_net, value = 0, 0.0, 0.0
        for k, (score, _, _) in enumerate(pool, start=1):
            value += score
            net = value - best_rate * (forward(rows, table_base, k) - forward(rows, table_base, 0))
            if net > best_net:
                best_k, best_net = k, net
    for _, c, i in pool[:best_k]:
        keep[c].append(i)
    return keep
