"""The node-selection ceiling: the batch budget given, of its sources' candidate nodes, exactly
those the target will accept.

A measured speedup below a target has two causes the bench alone cannot tell apart: the budget
choosing the wrong nodes (too many that fail, too few that pass), which better estimates can fix,
and the sources drafting too little, which no budget can. ``OracleTreeBuilder`` answers it by
reading the answer: it builds the engine's candidate tree from the same sources, then keeps only
the nodes on the item's plain greedy continuation (from a plain pass of the same run), each
scored 1. Verification still runs as always, so its outputs stay lossless, and every node it
offers is accepted. The budget then buys what pays, and its rests and asking measure run
unchanged. Only the bench uses it (``--methods ...,draftmesh-oracle``): it reads the output it
is meant to produce.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from draftmesh.draft.base import DraftContext, Proposal
from draftmesh.tree import TokenTree
from draftmesh.verify.budget import ScoredTree
from draftmesh.verify.tree_builder import CostAwareTreeBuilder


class OracleTreeBuilder(CostAwareTreeBuilder):
    """``base``'s candidates (its config, cost curve, aligner), cut to the accepted path.

    ``outputs``: request id -> that request's plain greedy output token ids. A request without one
    gets the engine's own candidates."""

    def __init__(self, base: CostAwareTreeBuilder, outputs: Mapping[str, Sequence[int]]) -> None:
        super().__init__({1: 1.0}, base.config, aligner=base.aligner)
        self.cost = base.cost
        self.outputs = {rid: tuple(ids) for rid, ids in outputs.items()}

    def candidates(self, proposals: Sequence[Proposal], ctx: DraftContext, max_depth: int | None = None,
                   ) -> ScoredTree | None:
        cand = super().candidates(proposals, ctx, max_depth)
        output = self.outputs.get(ctx.request_id or "")
        if cand is None or output is None:
            return cand
        keep = on_path(cand.tree, output[len(ctx.token_ids) - ctx.prompt_len:])
        if not keep:
            return None
        ones = [1.0] * len(keep)
        return ScoredTree(cand.tree.subtree(keep), ones, [cand.confidences[i] for i in keep], cand.cap, list(ones))


def on_path(tree: TokenTree, continuation: Sequence[int]) -> list[int]:
    """The nodes whose path from the root spells a prefix of ``continuation``: at most one per depth
    (a tree lists parents before their children)."""
    matched = [False] * len(tree)
    for i, (tok, parent, depth) in enumerate(zip(tree.tokens, tree.parents, tree.depths)):
        matched[i] = ((parent < 0 or matched[parent]) and depth <= len(continuation)
                      and tok == continuation[depth - 1])
    return [i for i, m in enumerate(matched) if m]
