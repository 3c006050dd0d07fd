"""`draftmesh-oracle`: the sources' candidate nodes cut to those the target accepts."""

from __future__ import annotations

import pytest
from batch_driver import drive, reference_greedy

from draftmesh.bench.oracle import OracleTreeBuilder, on_path
from draftmesh.draft.base import DraftContext, Proposal
from draftmesh.io_struct import GenerationRequest
from draftmesh.tree import TokenTree
from draftmesh.verify.decoder import SpeculativeDecoder
from draftmesh.verify.tree_builder import CostAwareTreeBuilder


def test_on_path_keeps_the_nodes_that_spell_a_prefix_of_the_continuation():
    # node: token (parent) -- 0: 5 (root), 1: 6 (0), 2: 7 (1), 3: 9 (0), 4: 6 (root), 5: 6 (4), 6: 9 (1)
    tree = TokenTree()
    for parent, token in [(-1, 5), (0, 6), (1, 7), (0, 9), (-1, 6), (4, 6), (1, 9)]:
        tree.add(parent, token, "s")
    assert tree.parents == [-1, 0, 1, 0, -1, 4, 1]
    assert on_path(tree, (5, 6, 9)) == [0, 1, 6]
    assert on_path(tree, (5, 6)) == [0, 1]  # nothing deeper than the continuation
    assert on_path(tree, (5, 9, 1)) == [0, 3]
    assert on_path(tree, (8,)) == [] and on_path(tree, ()) == []


class HalfRight:
    """Each step: the next 4 true tokens, a chain right for 2 then wrong, and a wrong first token."""

    name = "halfright"

    def __init__(self, truth: dict[str, tuple[int, ...]], vocab: int) -> None:
        self.truth, self.vocab = truth, vocab

    def propose(self, ctx: DraftContext) -> list[Proposal]:
        true = self.truth[ctx.request_id][len(ctx.generated_ids):][:4]
        if len(true) < 3:
            return []
        wrong = lambda t: (t + 1) % self.vocab  # noqa: E731
        return [Proposal(self.name, token_ids=tuple(true)),
                Proposal(self.name, token_ids=(*true[:2], wrong(true[2]), true[0])),
                Proposal(self.name, token_ids=(wrong(true[0]), true[1]))]


@pytest.fixture
def llama():
    from tiny_models import tiny_target

    return tiny_target("llama")


def _run(llama, oracle: bool):
    reqs = [GenerationRequest(prompt_ids=(5, 6, 7, 9 + i), max_new_tokens=24, request_id=f"r{i}") for i in range(3)]
    want = {r.request_id: reference_greedy(llama, r.prompt_ids, 24) for r in reqs}
    builder = CostAwareTreeBuilder({1: 1.0, 2: 1.05, 8: 1.1, 64: 2.0})
    if oracle:
        builder = OracleTreeBuilder(builder, want)
    decoder = SpeculativeDecoder(llama, [HalfRight(want, llama.vocab_size)], builder, asking_probe_every=0)
    results, _ = drive(decoder, [(0, r, None) for r in reqs])
    assert {r.request_id: tuple(results[i].token_ids) for i, r in enumerate(reqs)} == want  # lossless either way
    steps = [s for res in results.values() for s in res.steps]
    return sum(sum(s.nodes_by_source.values()) for s in steps), sum(sum(s.accepted_by_source.values()) for s in steps)


def test_the_oracle_verifies_only_nodes_the_target_accepts(llama):
    """Three requests in one batch, a source half of whose nodes are wrong: the engine's own budget
    verifies wrong nodes too; the oracle's every verified node is accepted, and it accepts at least
    as many as the engine did (it has every true node the source drafted)."""
    nodes, accepted = _run(llama, oracle=False)
    assert nodes > accepted > 0
    oracle_nodes, oracle_accepted = _run(llama, oracle=True)
    assert oracle_nodes == oracle_accepted >= accepted


def test_a_request_without_a_plain_output_gets_the_engines_candidates(llama):
    builder = CostAwareTreeBuilder({1: 1.0, 64: 1.0})
    oracle = OracleTreeBuilder(builder, {"other": (1, 2, 3)})
    ctx = DraftContext(token_ids=(5, 6, 7), prompt_len=3, request_id="r0")
    cand = oracle.candidates([Proposal("x", token_ids=(8, 9))], ctx)
    assert cand is not None and cand.tree.tokens == [8, 9] and cand.scores[0] < 1.0
    ctx = DraftContext(token_ids=(5, 6, 7), prompt_len=3, request_id="other")
    cut = oracle.candidates([Proposal("x", token_ids=(1, 9)), Proposal("x", token_ids=(4,))], ctx)
    assert cut.tree.tokens == [1] and cut.scores == [1.0]
    assert oracle.candidates([Proposal("x", token_ids=(4,))], ctx) is None  # nothing true: no tree
