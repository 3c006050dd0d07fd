"""The token tree: every draft of one step, merged into a trie under the pending token.

Node i has a parent (``-1`` is the root, i.e. the last committed token, which is not yet
in the KV cache), a token id and a depth (children of the root have depth 1). Parents
always precede children, so a single forward pass in node order is well defined.

Sampling losslessness needs to know *how* each token was drafted. A node records one
``QDraw`` per draft that sampled its token from a known distribution q; the verifier
tries those draws in their global ``order`` (a value-independent order, e.g. the order
in which proposals were given) with the residual rule, then every child once more as a
deterministic candidate. Keeping draws per source, instead of collapsing agreeing drafts
into one deterministic node, is what keeps mixed q/deterministic trees exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

from draftmesh.io_struct import MAX_TREE_NODES


@dataclass(frozen=True)
class QDraw:
    """A draft that *sampled* this node's token from ``dist`` (given the node's ancestors)."""

    source: str
    order: int
    dist: torch.Tensor


@dataclass(frozen=True)
class DraftSequence:
    """One drafted chain of target tokens, as handed to ``TokenTree.from_sequences``."""

    tokens: Sequence[int]
    source: str
    dists: torch.Tensor | None = None
    """Row i is the distribution token i was sampled from; None for deterministic drafts."""
    probs: Sequence[float] | None = None
    """The draft's probability of each token (a score only)."""


@dataclass
class TokenTree:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    sources: list[tuple[str, ...]] = field(default_factory=list)
    qdraws: list[tuple[QDraw, ...]] = field(default_factory=list)
    draft_probs: list[float | None] = field(default_factory=list)
    source_scores: list[dict[str, float]] | None = field(default=None, repr=False, compare=False)
    """Optional per-node confidence of each proposing source, set by a builder for its own learning."""
    expected_accepted: float | None = field(default=None, repr=False, compare=False)
    """The builder's uncalibrated estimate of how many of these nodes the target accepts (its own learning)."""
    _children_cache: dict[int, list[int]] = field(default_factory=dict, init=False, repr=False, compare=False)
    """Children of each node, for the nodes ``[0, _indexed)``: extended, never rebuilt, as nodes
    are appended (building a trie stays linear in its size, whatever a source sends)."""
    _indexed: int = field(default=0, init=False, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def max_depth(self) -> int:
        return max(self.depths, default=0)

    # ------------------------------------------------------------------ building
    def add(
        self,
        parent: int,
        token: int,
        source: str,
        qdraw: QDraw | None = None,
        draft_prob: float | None = None,
    ) -> int:
        """Add ``token`` under ``parent`` (merging with an equal sibling); return its index."""
        for child in self.children(parent):
            if self.tokens[child] == token:
                if source not in self.sources[child]:
                    self.sources[child] = self.sources[child] + (source,)
                if qdraw is not None:
                    self.qdraws[child] = self.qdraws[child] + (qdraw,)
                if draft_prob is not None:
                    old = self.draft_probs[child]
                    self.draft_probs[child] = draft_prob if old is None else max(old, draft_prob)
                return child
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
        self.sources.append((source,))
        self.qdraws.append(() if qdraw is None else (qdraw,))
        self.draft_probs.append(draft_prob)
        return len(self.tokens) - 1

    @classmethod
    def from_sequences(cls, sequences: Iterable[DraftSequence], max_nodes: int | None = None) -> "TokenTree":
        """Merge chains into a trie. Sequence i's sampled tokens get draw order i.

        With ``max_nodes`` the trie stops growing when full; a chain that would need new
        nodes past the budget is cut there (its shared prefix still counts).
        """
        tree = cls()
        for order, seq in enumerate(sequences):
            if seq.dists is not None and seq.dists.shape[0] != len(seq.tokens):
                raise ValueError(f"draft from {seq.source!r}: {seq.dists.shape[0]} dists for {len(seq.tokens)} tokens")
            node = -1
            for i, tok in enumerate(seq.tokens):
                existing = next((c for c in tree.children(node) if tree.tokens[c] == tok), None)
                if existing is None and max_nodes is not None and len(tree) >= max_nodes:
                    break
                qdraw = QDraw(seq.source, order, seq.dists[i]) if seq.dists is not None else None
                prob = None if seq.probs is None else float(seq.probs[i])
                node = tree.add(node, int(tok), seq.source, qdraw, prob)
        return tree

    # ------------------------------------------------------------------ queries

    def children(self, node: int) -> list[int]:
        parents, cache = self.parents, self._children_cache
        if self._indexed > len(parents):  # the lists were replaced by shorter ones: start over
            cache.clear()
            self._indexed = 0
        for i in range(self._indexed, len(parents)):
            cache.setdefault(parents[i], []).append(i)
        self._indexed = len(parents)
        return cache.get(node, [])

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to ``node``."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def ancestor_matrix(self) -> torch.Tensor:
        """(N, N) bool: entry [i, j] is True when j is i or one of i's ancestors."""
        n = len(self)
        anc = torch.zeros((n, n), dtype=torch.bool)
        for i, p in enumerate(self.parents):
            if p >= 0:
                anc[i] = anc[p]
            anc[i, i] = True
        return anc

    def subtree(self, keep: Sequence[int]) -> "TokenTree":
        """The tree restricted to ``keep`` (must be closed under ancestors), order preserved.

        Draws lose their q when a builder selects nodes by score, because selection that
        looks at a sampled token's value would bias the residual rule: see ``strip_q``.
        """
        keep_sorted = sorted(set(keep))
        keep_set = set(keep_sorted)
        remap: dict[int, int] = {-1: -1}
        out = TokenTree()
        for i in keep_sorted:
            p = self.parents[i]
            if p not in keep_set and p != -1:
                raise ValueError(f"subtree: node {i} kept without its parent {p}")
            remap[i] = len(out)
            out.tokens.append(self.tokens[i])
            out.parents.append(remap[p])
            out.depths.append(self.depths[i])
            out.sources.append(self.sources[i])
            out.qdraws.append(self.qdraws[i])
            out.draft_probs.append(self.draft_probs[i])
        return out

    def strip_q(self) -> "TokenTree":
        """Same tree, every node a deterministic draft (always lossless)."""
        out = self.subtree(range(len(self)))
        out.qdraws = [() for _ in out.tokens]
        return out

    def truncate_depth(self, max_depth: int) -> "TokenTree":
        if self.max_depth <= max_depth:
            return self
        keep = [i for i, d in enumerate(self.depths) if d <= max_depth]
        out = self.subtree(keep)
        if self.source_scores is not None:
            out.source_scores = [self.source_scores[i] for i in keep]
        return out

    # ------------------------------------------------------------------ checks
    def validate(self, vocab_size: int | None = None, max_nodes: int = MAX_TREE_NODES) -> None:
        """Raise ``ValueError`` naming the first problem found."""
        n = len(self.tokens)
        for name in ("parents", "depths", "sources", "qdraws", "draft_probs"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"malformed tree: {name} has {len(getattr(self, name))} entries for {n} nodes")
        if n > max_nodes:
            raise ValueError(f"malformed tree: {n} nodes exceeds the limit of {max_nodes}")
        seen: dict[tuple[int, int], int] = {}
        for i, (tok, p, d) in enumerate(zip(self.tokens, self.parents, self.depths)):
            if not isinstance(p, int) or p < -1 or p >= i:
                raise ValueError(f"malformed tree: node {i} has parent {p}; parents must precede children")
            expected = 1 if p < 0 else self.depths[p] + 1
            if d != expected:
                raise ValueError(f"malformed tree: node {i} has depth {d}, expected {expected}")
            if tok < 0 or (vocab_size is not None and tok >= vocab_size):
                raise ValueError(f"malformed tree: node {i} has token {tok} outside the vocabulary")
            if (p, tok) in seen:
                raise ValueError(f"malformed tree: nodes {seen[(p, tok)]} and {i} are duplicate siblings")
            seen[(p, tok)] = i
            for draw in self.qdraws[i]:
                if draw.dist.dim() != 1 or (vocab_size is not None and draw.dist.numel() != vocab_size):
                    raise ValueError(
                        f"malformed tree: node {i} draw from {draw.source!r} has a distribution of shape "
                        f"{tuple(draw.dist.shape)}, expected ({vocab_size},)"
                    )
