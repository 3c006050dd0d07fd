"""Tree builders: a step's proposals (token ids or text) in, the token tree to verify out.

``CostAwareTreeBuilder`` (the engine's) is described here; ``TrieBuilder`` merges every
proposal up to a cap and keeps sampled (q) draws, for sources that sample. Both turn text
proposals into target tokens with the same ``TextAligner``, so a text source (``rules``,
another tokenizer's drafter) drafts under either builder.

The cost-aware multi-source builder:

All proposals of a step are merged into one trie; a node proposed by several sources
records all of them. Each node is scored by the estimated probability that the target
accepts it, i.e. that its whole path is accepted: the product over the path of
conditional acceptance estimates learned online per source and per depth (Beta priors
from config), sharpened by the source's own confidence and by agreement between
sources. The builder then keeps the best nodes (ancestor-closed, since a child never
scores above its parent) up to the size that maximizes expected tokens per unit of
verify time on the measured cost curve; when no tree pays for itself it returns an
empty tree and the step is a plain one. Every score is scaled by how many tree nodes
were really accepted lately against how many the scores predicted
(``AcceptanceCalibration``, at most 1), so optimistic estimates shrink the trees the
budget buys instead of lengthening every step of the batch. After several fruitless
steps in a row a request stops speculating for a cool-down, then probes again.
"""

from __future__ import annotations

import bisect
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from draftmesh.config import BuilderConfig
from draftmesh.draft.align import TextAligner
from draftmesh.draft.base import DraftContext, Proposal, bounded
from draftmesh.tree import DraftSequence, TokenTree
from draftmesh.verify.acceptance import Verdict

log = logging.getLogger(__name__)

MAX_DEPTH_BUCKET = 8
CONFIDENCE_BINS = 5


class CostModel:
    """Verify time of a forward over k tokens relative to one token, interpolated."""

    def __init__(self, curve: Mapping[int, float]) -> None:
        if not curve or 1 not in curve:
            raise ValueError("a cost curve needs at least the k = 1 point")
        self.ks = sorted(curve)
        self.costs = [float(curve[k]) for k in self.ks]

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
    tree part of the table by it (``cost``)."""

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
        entry = sums.setdefault(rows, [0.0, 0.0])
        entry[0] = entry[0] * self.decay + measured
        entry[1] = entry[1] * self.decay + table

    def scale(self, rows: int) -> float:
        """Measured over table for forwards without trees (1 until one was measured)."""
        entry = _nearest(self.plain, rows)
        return entry[0] / entry[1] if entry and entry[1] > 0 else 1.0

    def record(self, cost, rows: int, base_tokens: int, tokens: int, forward_s: float) -> None:
        if self.unit_s is None or rows < 1:
            return
        measured = forward_s / self.unit_s
        plain = cost(rows, base_tokens)
        if tokens <= base_tokens:
            self._add(self.plain, rows, measured, plain)
            return
        extra = cost(rows, tokens) - plain
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

    def cost(self, cost, rows: int, base_tokens: int):
        """``cost`` for this step's budget, its tree part scaled by ``factor(rows)``."""
        f = self.factor(rows)
        if f == 1.0:
            return cost
        plain = cost(rows, base_tokens)

        def corrected(r: int, tokens: int) -> float:
            full = cost(r, tokens)
            return full if r != rows or tokens <= base_tokens else plain + f * (full - plain)

        return corrected


def choose_nodes(
    candidates: Sequence[ScoredTree | None], cost: Callable[[int, int], float], *, rows: int, base_tokens: int, min_gain: float,
    max_tokens: int | None = None, overhead: float = 0.0,
) -> list[list[int]]:
    """The nodes to verify, per candidate, for the whole batch's forward.

    Nodes of every request compete by score (a child never scores above its parent, so any
    prefix of the order is ancestor-closed); the prefix kept maximizes expected committed
    tokens of the batch per unit of step time: ``(rows + sum of kept scores) / (cost(rows,
    base_tokens + kept) + overhead)``, where ``base_tokens`` is what the step holds anyway
    (every request's root, prefill chunks, fixed trees) and ``overhead`` the step's time outside
    the forward (``StepOverhead``). Nothing is kept unless that beats a plain step by
    ``min_gain``. At batch 1 this is the single-request builder's rule; as the batch grows each
    node must pay for a larger forward, so trees shrink, then vanish.
    """
    pool = []
    for c, cand in enumerate(candidates):
        if cand is None:
            continue
        order = sorted(range(len(cand.scores)), key=lambda i: (-cand.scores[i], i))[: cand.cap]
        pool.extend((cand.scores[i], c, i) for i in order)
    pool.sort(key=lambda x: (-x[0], x[1], x[2]))
    if max_tokens is not None:
        pool = pool[: max(0, max_tokens - base_tokens)]
    plain = rows / (cost(rows, base_tokens) + overhead)
    best_k, best_rate, expected = 0, plain, float(rows)
    for k, (score, _, _) in enumerate(pool, start=1):
        expected += score
        rate = expected / (cost(rows, base_tokens + k) + overhead)
        if rate > best_rate:
            best_k, best_rate = k, rate
    keep: list[list[int]] = [[] for _ in candidates]
    if best_rate < min_gain * plain:
        return keep
    for _, c, i in pool[:best_k]:
        keep[c].append(i)
    return keep


class AcceptanceStats:
    """Per source, depth and confidence bin: how often a node is accepted when its parent was.

    Sparse cells borrow strength: a depth-1 cell shrinks towards the source prior scaled by
    the source's confidence; a deeper cell shrinks towards the source's pooled deeper
    rate, itself shrunk towards ``deep_prior`` (continuing a copy that has started to
    match is usually right).
    """

    def __init__(
        self,
        prior: tuple[float, float],
        source_priors: Mapping[str, tuple[float, float]],
        deep_prior: tuple[float, float] = (9.0, 1.0),
        strength: float = 4.0,
    ) -> None:
        self.prior = prior
        self.source_priors = dict(source_priors)
        self.deep_prior = deep_prior
        self.strength = strength
        self.counts: dict[tuple[str, int, int], list[float]] = {}
        self.pooled_deep: dict[tuple[str, int], list[float]] = {}
        self.totals: dict[str, list[int]] = {}

    @staticmethod
    def _bin(confidence: float) -> int:
        return min(CONFIDENCE_BINS - 1, max(0, int(confidence * CONFIDENCE_BINS)))

    def rate(self, source: str, depth: int, confidence: float = 1.0) -> float:
        """Posterior mean acceptance, calibrated per confidence bin of the source."""
        b = self._bin(confidence)
        if depth <= 1:
            a0, b0 = self.source_priors.get(source, self.prior)
            a0 *= max(confidence, 0.05)
            prior_mean = a0 / (a0 + b0)
        else:
            a0, b0 = self.deep_prior
            acc, tries = self.pooled_deep.get((source, b), (0.0, 0.0))
            prior_mean = (a0 + acc) / (a0 + b0 + tries)
        acc, tries = self.counts.get((source, min(depth, MAX_DEPTH_BUCKET), b), (0.0, 0.0))
        return (acc + self.strength * prior_mean) / (tries + self.strength)

    def record(self, source: str, depth: int, accepted: bool, confidence: float = 1.0) -> None:
        b = self._bin(confidence)
        entry = self.counts.setdefault((source, min(depth, MAX_DEPTH_BUCKET), b), [0.0, 0.0])
        entry[0] += accepted
        entry[1] += 1
        if depth > 1:
            pooled = self.pooled_deep.setdefault((source, b), [0.0, 0.0])
            pooled[0] += accepted
            pooled[1] += 1
        total = self.totals.setdefault(source, [0, 0])
        total[0] += accepted
        total[1] += 1

    def snapshot(self) -> dict[str, dict]:
        out: dict[str, dict] = {}
        for source, (acc, tries) in self.totals.items():
            per_depth: dict[int, list[float]] = {}
            for (s, d, _), c in self.counts.items():
                if s == source:
                    agg = per_depth.setdefault(d, [0.0, 0.0])
                    agg[0] += c[0]
                    agg[1] += c[1]
            by_depth = {d: round(c[0] / c[1], 4) for d, c in sorted(per_depth.items()) if c[1]}
            out[source] = {"proposed": tries, "accepted": acc, "rate": acc / tries if tries else 0.0, "by_depth": by_depth}
        return out


class AcceptanceCalibration:
    """Accepted tree nodes realized over those predicted, over recent verified trees (decayed).

    The per-source, per-depth rates are each learned, but a node's score combines them as if
    sources were independent and deep nodes were as safe as the deep prior says; when that is
    optimistic every tree the budget buys is too large, and in a batch each surplus node makes
    every request's step longer. Scores are multiplied by this ratio (at most 1: it only backs
    off), so the budget drafts what has really been accepted lately and stops when it does not
    pay. Starts at 1, as if ``prior`` nodes had been predicted and accepted."""

    def __init__(self, halflife: float = 64.0, prior: float = 4.0) -> None:
        self.decay = 0.5 ** (1.0 / halflife)
        self.predicted = self.realized = float(prior)

    def record(self, predicted: float, realized: int) -> None:
        self.predicted = self.predicted * self.decay + predicted
        self.realized = self.realized * self.decay + realized

    @property
    def factor(self) -> float:
        return min(1.0, self.realized / self.predicted)


def default_aligner(tokenizer) -> TextAligner | None:
    """The aligner for the target's tokenizer; None (text proposals unusable) for a slow one."""
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        return None
    return TextAligner(tokenizer)


def proposal_sequences(
    proposals: Sequence[Proposal], ctx: DraftContext, aligner: TextAligner | None, *, max_nodes: int,
    keep_dists: bool = False,
) -> list[DraftSequence]:
    """One token chain per usable proposal, in the given order; text proposals aligned to the
    committed ids (a proposal that aligns to nothing, or text without an aligner, is dropped).

    Each proposal is first cut to what a tree of ``max_nodes`` can hold (``bounded``: no
    chosen node lies deeper than the cap, so nothing is lost), which bounds alignment and
    trie building whatever a source sent. Token proposals keep their own probabilities
    (clamped to [0, 1]); aligned text gets its confidence per token. ``keep_dists`` passes a
    sampled proposal's q rows on (only a builder that never selects by value may keep them)."""
    out = []
    for p in proposals:
        p = bounded(p, max_nodes)
        tokens, probs, dists = p.token_ids, p.token_probs, p.token_dists if keep_dists else None
        if tokens is None and p.text:
            if aligner is None:
                _warn_unaligned(p.source)
                continue
            tokens, probs = aligner.align(ctx.token_ids, p.text, complete=p.text_complete)[:max_nodes], None
        if tokens:
            out.append(DraftSequence(tuple(tokens), p.source, dists, probs if probs is not None else (p.confidence,) * len(tokens)))
    return out


_WARNED_UNALIGNED: set[str] = set()


def _warn_unaligned(source: str) -> None:
    if source not in _WARNED_UNALIGNED:
        _WARNED_UNALIGNED.add(source)
        log.warning("text proposals of %s are dropped: the target's tokenizer is not a fast one, so no "
                    "TextAligner can map them to target tokens", source)


@dataclass
class _RequestState:
    fruitless: int = 0
    cooldown: int = 0


class CostAwareTreeBuilder:
    """The engine's builder: best nodes by estimated acceptance, sized by the cost curve."""

    def __init__(
        self,
        cost_curve: Mapping[int, float],
        config: BuilderConfig | None = None,
        aligner: TextAligner | None = None,
    ) -> None:
        self.config = config or BuilderConfig()
        self.cost = CostModel(cost_curve)
        self.aligner = aligner
        self.stats = AcceptanceStats(self.config.prior, self.config.source_priors, self.config.deep_prior)
        self.calibration = AcceptanceCalibration(self.config.calibration_halflife)
        self._requests: OrderedDict[str, _RequestState] = OrderedDict()

    @property
    def max_nodes(self) -> int:
        return self.config.max_nodes

    # ------------------------------------------------------------------ building
    def build(self, proposals: Sequence[Proposal], ctx: DraftContext, max_depth: int | None = None) -> TokenTree:
        """One request's tree on its own (batch 1): its candidate nodes, sized by the cost curve."""
        candidate = self.candidates(proposals, ctx, max_depth)
        if candidate is None:
            return TokenTree()
        return candidate.select(choose_nodes([candidate], BatchCost(self.cost), rows=1, base_tokens=1,
                                             min_gain=self.config.min_gain)[0])

    def candidates(
        self, proposals: Sequence[Proposal], ctx: DraftContext, max_depth: int | None = None
    ) -> "ScoredTree | None":
        """Every node the proposals make (deeper than ``max_depth`` dropped), each with its estimated
        acceptance; None when the request drafts nothing this step (a cool-down, no proposal, cap 0).
        The batch's budget (``choose_nodes``) then decides which nodes are verified."""
        cap = min(self.config.max_nodes, int(ctx.options.get("max_nodes", self.config.max_nodes)))
        if self.cooling_down(ctx.request_id):
            return None
        sequences = proposal_sequences(proposals, ctx, self.aligner, max_nodes=cap)
        if not sequences or cap == 0:
            return None
        full = TokenTree.from_sequences(sequences)
        conf = self._confidences(full, sequences)
        if max_depth is not None and full.max_depth > max_depth:
            keep = [i for i, d in enumerate(full.depths) if d <= max_depth]
            if not keep:
                return None
            full, conf = full.subtree(keep), [conf[i] for i in keep]
        raw = self._scores(full, conf)
        factor = self.calibration.factor
        return ScoredTree(full, [x * factor for x in raw], conf, cap, raw)

    def cooling_down(self, request_id: str) -> bool:
        """True while the request's trees keep failing (``fallback_after`` trees in a row accepted
        nothing): this step decodes plainly, and one of the ``cooldown_steps`` is used up. The
        decoder asks it before the sources, so a cooling request does not pay for asking them."""
        state = self._state(request_id)
        if state.cooldown > 0:
            state.cooldown -= 1
            return True
        return False

    def _scores(self, tree: TokenTree, conf: Sequence[Mapping[str, float]]) -> list[float]:
        """P(node accepted) = P(parent accepted) * P(node | parent), siblings capped at 1.

        ``conf[i]`` is the confidence each proposing source gave node i (``_confidences``).
        """
        cond = [0.0] * len(tree)
        for i in range(len(tree)):
            miss = 1.0
            for source, c in conf[i].items():
                miss *= 1.0 - self.stats.rate(source, tree.depths[i], c)
            cond[i] = 1.0 - miss  # agreement between sources raises the estimate
        for parent in {-1, *tree.parents}:
            kids = tree.children(parent)
            total = sum(cond[k] for k in kids)
            if total > 1.0:
                for k in kids:
                    cond[k] /= total
        scores = [0.0] * len(tree)
        for i, p in enumerate(tree.parents):
            scores[i] = cond[i] * (1.0 if p < 0 else scores[p])
        return scores

    @staticmethod
    def _confidences(tree: TokenTree, sequences: Sequence[DraftSequence]) -> list[dict[str, float]]:
        """The best confidence each source gave each node."""
        conf: list[dict[str, float]] = [dict() for _ in range(len(tree))]
        for seq in sequences:
            node = -1
            for j, tok in enumerate(seq.tokens):
                node = next(ch for ch in tree.children(node) if tree.tokens[ch] == tok)
                c = float(seq.probs[j]) if seq.probs else 1.0
                conf[node][seq.source] = max(conf[node].get(seq.source, 0.0), c)
        return conf

    # ------------------------------------------------------------------ learning
    def observe(self, tree: TokenTree, verdict: Verdict, ctx: DraftContext | None = None) -> None:
        if len(tree) == 0:
            return
        accepted = set(verdict.accepted)
        if tree.expected_accepted is not None:
            self.calibration.record(tree.expected_accepted, len(accepted))
        reached = {-1} | accepted  # a node was tried when its parent was accepted
        conf = tree.source_scores
        for i, parent in enumerate(tree.parents):
            if parent in reached:
                for source in tree.sources[i]:
                    c = conf[i].get(source, 1.0) if conf else 1.0
                    self.stats.record(source, tree.depths[i], i in accepted, c)
        if ctx is not None:
            state = self._state(ctx.request_id)
            if accepted:
                state.fruitless = 0
            else:
                state.fruitless += 1
                if state.fruitless >= self.config.fallback_after:
                    state.fruitless = 0
                    state.cooldown = self.config.cooldown_steps

    def finish(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def _state(self, request_id: str) -> _RequestState:
        state = self._requests.get(request_id)
        if state is None:
            state = self._requests[request_id] = _RequestState()
            while len(self._requests) > 4096:
                self._requests.popitem(last=False)
        else:
            self._requests.move_to_end(request_id)
        return state


class TrieBuilder:
    """Merge every proposal, most confident first, up to a node cap; no learning.

    For sources that sample: a q draw keeps its distribution only when no proposal was
    reordered or cut, since choosing drafts by their values would bias the residual rule.
    Text proposals are aligned like the cost-aware builder's.
    """

    def __init__(self, max_nodes: int = 16, aligner: TextAligner | None = None) -> None:
        if max_nodes < 0:
            raise ValueError(f"max_nodes must be >= 0, got {max_nodes}")
        self.max_nodes = max_nodes
        self.aligner = aligner

    def build(self, proposals: Sequence[Proposal], ctx: DraftContext) -> TokenTree:
        usable = [p for p in proposals if p.token_ids or p.text]
        ranked = sorted(usable, key=lambda p: -p.confidence)
        cap = min(self.max_nodes, int(ctx.options.get("max_nodes", self.max_nodes)))
        # Each chain cut to `cap` tokens, whatever its values: its draws stay exact samples.
        seqs = proposal_sequences(ranked, ctx, self.aligner, max_nodes=cap, keep_dists=True)
        tree = TokenTree.from_sequences(seqs)
        cut = len(tree) > cap
        if cut:  # the first `cap` nodes are what a capped build keeps (parents precede children)
            tree = tree.subtree(range(cap))
        reordered = any(a is not b for a, b in zip(ranked, usable))
        if reordered or cut:
            tree = tree.strip_q()
        return tree

    def observe(self, tree: TokenTree, verdict: Verdict, ctx: DraftContext | None = None) -> None:
        return None

    def finish(self, request_id: str) -> None:
        return None


TreeBuilder = CostAwareTreeBuilder | TrieBuilder
"""The builders the decode loop accepts."""
