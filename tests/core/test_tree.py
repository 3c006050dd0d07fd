"""Token tree construction, invariants and validation."""

from __future__ import annotations

import pytest
import torch

from draftmesh.tree import DraftSequence, QDraw, TokenTree


def test_sequences_merge_common_prefixes_and_record_every_source():
    tree = TokenTree.from_sequences(
        [
            DraftSequence([5, 6, 7], "a"),
            DraftSequence([5, 6, 8], "b"),
            DraftSequence([5, 6, 7, 9], "b"),
            DraftSequence([4], "c"),
        ]
    )
    assert tree.tokens == [5, 6, 7, 8, 9, 4]
    assert tree.parents == [-1, 0, 1, 1, 2, -1]
    assert tree.depths == [1, 2, 3, 3, 4, 1]
    assert tree.sources[0] == ("a", "b") and tree.sources[3] == ("b",) and tree.sources[5] == ("c",)
    assert tree.children(-1) == [0, 5] and tree.children(1) == [2, 3]
    assert tree.path_to(4) == [0, 1, 2, 4]
    tree.validate(vocab_size=10)


def test_node_budget_cuts_chains_but_keeps_shared_prefixes():
    tree = TokenTree.from_sequences([DraftSequence([1, 2, 3], "a"), DraftSequence([1, 2, 4, 5], "b")], max_nodes=4)
    assert tree.tokens == [1, 2, 3, 4]


def test_q_draws_are_kept_per_source_with_their_order():
    q = torch.full((6,), 1 / 6, dtype=torch.float64)
    tree = TokenTree.from_sequences(
        [DraftSequence([1, 2], "a", dists=torch.stack([q, q])), DraftSequence([1], "b", dists=q[None])]
    )
    assert [d.source for d in tree.qdraws[0]] == ["a", "b"]
    assert [d.order for d in tree.qdraws[0]] == [0, 1]
    assert tree.strip_q().qdraws == [(), ()]


def test_ancestor_matrix_is_ancestors_and_self():
    tree = TokenTree.from_sequences([DraftSequence([1, 2], "a"), DraftSequence([3], "a")])
    anc = tree.ancestor_matrix()
    assert anc.tolist() == [[True, False, False], [True, True, False], [False, False, True]]


def test_subtree_requires_closure_under_ancestors():
    tree = TokenTree.from_sequences([DraftSequence([1, 2, 3], "a")])
    assert tree.subtree([0, 1]).tokens == [1, 2]
    with pytest.raises(ValueError, match="without its parent"):
        tree.subtree([0, 2])
    assert tree.truncate_depth(2).tokens == [1, 2]


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda t: t.parents.__setitem__(1, 1), "parents must precede children"),
        (lambda t: t.parents.__setitem__(1, 5), "parents must precede children"),
        (lambda t: t.depths.__setitem__(1, 7), "expected 2"),
        (lambda t: t.tokens.__setitem__(2, 99), "outside the vocabulary"),
        (lambda t: t.tokens.__setitem__(2, -3), "outside the vocabulary"),
        (lambda t: t.sources.pop(), "sources has 2 entries"),
        (lambda t: (t.tokens.append(1), t.parents.append(-1), t.depths.append(1), t.sources.append(("x",)),
                    t.qdraws.append(()), t.draft_probs.append(None)), "duplicate siblings"),
        (lambda t: t.qdraws.__setitem__(0, (QDraw("a", 0, torch.ones(3)),)), r"expected \(10,\)"),
    ],
)
def test_malformed_trees_are_rejected_with_the_reason(mutate, message):
    tree = TokenTree.from_sequences([DraftSequence([1, 2], "a"), DraftSequence([3], "a")])
    mutate(tree)
    with pytest.raises(ValueError, match=message):
        tree.validate(vocab_size=10)


def test_tree_size_is_bounded():
    tree = TokenTree.from_sequences([DraftSequence(list(range(50)), "a")])
    with pytest.raises(ValueError, match="exceeds the limit"):
        tree.validate(max_nodes=20)


def test_trie_builder_keeps_q_draws_unless_it_cuts_or_reorders():
    from draftmesh.draft.base import DraftContext, Proposal
    from draftmesh.verify.tree_builder import TrieBuilder

    q = torch.full((2, 6), 1 / 6, dtype=torch.float64)
    ctx = DraftContext(token_ids=(1,), prompt_len=1)
    merged = [Proposal("a", token_ids=(1, 2), token_dists=q), Proposal("b", token_ids=(1, 3), token_dists=q)]
    tree = TrieBuilder(max_nodes=8).build(merged, ctx)
    assert tree.tokens == [1, 2, 3] and [len(d) for d in tree.qdraws] == [2, 1, 1]  # shared prefix, nothing cut
    assert TrieBuilder(max_nodes=2).build(merged, ctx).qdraws == [(), ()]  # cut: deterministic only
    reordered = [Proposal("a", token_ids=(1, 2), token_dists=q, confidence=0.1),
                 Proposal("b", token_ids=(1, 2), token_dists=q, confidence=0.9)]
    assert TrieBuilder(max_nodes=8).build(reordered, ctx).qdraws == [(), ()]
    capped = TrieBuilder(max_nodes=3).build([Proposal("a", token_ids=(1, 2, 3, 4)), Proposal("b", token_ids=(5,))], ctx)
    assert capped.tokens == TokenTree.from_sequences([DraftSequence((1, 2, 3, 4), "a"), DraftSequence((5,), "b")],
                                                     max_nodes=3).tokens


class _CountingDict(dict):
    """A children index that counts the nodes put into it."""

    def __init__(self) -> None:
        super().__init__()
        self.inserts = 0

    def setdefault(self, key, default=None):
        self.inserts += 1
        return super().setdefault(key, default)


def test_building_a_trie_indexes_each_node_once():
    """The children index grows with the tree instead of being rebuilt on every added node, so a
    source's 20k-token draft costs 20k insertions, not 200M (it used to take minutes)."""
    index = _CountingDict()

    class Counted(TokenTree):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self._children_cache = index

    chain = DraftSequence([i % 50 for i in range(20_000)], "a")
    tree = Counted.from_sequences([chain, DraftSequence([0, 1, 99], "b")])
    assert len(tree) == 20_001 and tree.children(-1) == [0] and tree.children(1) == [2, 20_000]
    assert index.inserts == len(tree)


def test_the_children_index_follows_appends_and_replaced_lists():
    tree = TokenTree.from_sequences([DraftSequence([1, 2], "a")])
    assert tree.children(0) == [1]
    sub = tree.subtree([0])
    assert sub.children(0) == [] and sub.children(-1) == [0]
    tree.add(0, 7, "b")
    assert tree.children(0) == [1, 2]
    tree.tokens, tree.parents, tree.depths = [4], [-1], [1]  # lists replaced by shorter ones
    assert tree.children(-1) == [0] and tree.children(0) == []
