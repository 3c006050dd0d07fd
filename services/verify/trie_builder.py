"""The simplest tree builder: merge token proposals, most confident first, up to a node cap.

The decode loop's default and the builder of choice for tests and for sources that
sample (it keeps q draws when it neither reorders nor cuts). The cost-aware builder the
engine uses lives in draftmesh.router.
"""

from __future__ import annotations

from typing import Sequence

from draftmesh.draft.base import DraftContext, Proposal
from draftmesh.verify.acceptance import Verdict
from draftmesh.tree import DraftSequence, TokenTree


class TrieBuilder:
    """The simplest builder: merge token proposals, most confident first, up to a node cap.

    Sampled (q) draws keep their distributions only when no proposal was reordered or cut,
    since choosing drafts by their values would bias the residual rule.
    """

    def __init__(self, max_nodes: int = 16) -> None:
        if max_nodes < 0:
            raise ValueError(f"max_nodes must be >= 0, got {max_nodes}")
        self.max_nodes = max_nodes

    def build(self, proposals: Sequence[Proposal], ctx: DraftContext) -> TokenTree:
        usable = [p for p in proposals if p.token_ids]
        ranked = sorted(usable, key=lambda p: -p.confidence)
        seqs = [DraftSequence(p.token_ids, p.source, p.token_dists, p.token_probs) for p in ranked]
        cap = min(self.max_nodes, int(ctx.options.get("max_nodes", self.max_nodes)))
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
