"""Greedy verification's token choice is plain greedy decoding's: ``argmax``, first maximum on ties.

``verify_greedy`` reads the maxima with ``max(dim=-1).indices`` (faster on CPU than ``argmax``);
these tests hold it to argmax's rule, ties included, so that a tree can never change which of two
equal logits a greedy request emits.
"""

from __future__ import annotations

import torch

from draftmesh.tree import TokenTree
from draftmesh.verify.acceptance import verify_greedy

VOCAB = 49152  # SmolLM2's: wide enough for the vectorized reduction paths


def _chain_tree(tokens: list[int]) -> TokenTree:
    tree, node = TokenTree(), -1
    for tok in tokens:
        node = tree.add(node, tok, "test")
    return tree


def test_the_walk_follows_the_argmax_of_each_row_and_returns_the_correction():
    logits = torch.zeros(4, VOCAB)
    logits[0, 7] = logits[1, 8] = 5.0  # the root wants 7, node 0 (token 7) wants 8
    logits[2, 11] = 5.0  # node 1 (token 8) wants 11, but the tree holds 9
    tree = _chain_tree([7, 8, 9])
    verdict = verify_greedy(tree, logits)
    assert verdict.accepted == [0, 1]
    assert verdict.next_token == 11


def test_ties_go_to_the_first_maximal_token_as_plain_argmax_decoding():
    gen = torch.Generator().manual_seed(3)
    for trial in range(40):
        rows = 1 + trial % 17
        # few distinct values, so most rows have several maxima far apart in the vocabulary
        logits = torch.randint(0, 3, (rows, VOCAB), generator=gen).to(torch.float32 if trial % 2 else torch.float64)
        want = logits.argmax(dim=-1).tolist()
        # a chain that drafts exactly the argmax path: every node accepted, the bonus is row rows-1's
        tree = _chain_tree(want[: rows - 1])
        verdict = verify_greedy(tree, logits)
        assert verdict.accepted == list(range(rows - 1))
        assert verdict.next_token == want[rows - 1]
        # a chain that drafts the last maximum of row 0 instead of the first: rejected at once
        row0 = logits[0]
        last = int((row0 == row0.max()).nonzero()[-1])
        if last != want[0]:
            assert verify_greedy(_chain_tree([last]), logits[:2]).accepted == []
