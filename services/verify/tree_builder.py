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

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Mapping, Sequence

from draftmesh.config import BuilderConfig
from draftmesh.draft.align import TextAligner
from draftmesh.draft.base import DraftContext, Proposal, bounded
from draftmesh.tree import DraftSequence, TokenTree
from draftmesh.verify.acceptance import Verdict
from draftmesh.verify.budget import BatchCost, CostModel, ScoredTree, choose_nodes

log = logging.getLogger(__name__)

MAX_DEPTH_BUCKET = 8
CONFIDENCE_BINS = 5


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
