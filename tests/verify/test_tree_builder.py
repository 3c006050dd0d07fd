"""The cost-aware multi-source tree builder: merging, scoring, budgets, learning, fall-back."""

from __future__ import annotations

import random

import pytest

from draftmesh.draft.base import DraftContext, Proposal
from draftmesh.tree import DraftSequence, TokenTree
from draftmesh.verify.acceptance import Verdict
from draftmesh.verify.tree_builder import AcceptanceStats, BuilderConfig, CostAwareTreeBuilder

CURVE = {1: 1.0, 2: 1.1, 4: 1.4, 8: 1.8, 16: 2.1, 32: 2.6, 64: 3.7}


def ctx(request_id: str = "r", **options) -> DraftContext:
    return DraftContext(token_ids=(1, 2, 3), prompt_len=3, request_id=request_id, options=options)


def closed_under_ancestors(tree: TokenTree) -> bool:
    return all(p < i for i, p in enumerate(tree.parents))


def test_flat_cost_takes_everything_and_steep_cost_takes_nothing():
    props = [Proposal("s", token_ids=(5, 6, 7, 8), confidence=1.0)]
    flat = CostAwareTreeBuilder({1: 1.0, 64: 1.0})
    assert len(flat.build(props, ctx())) == 4
    steep = CostAwareTreeBuilder({1: 1.0, 2: 10.0, 64: 500.0})
    assert len(steep.build(props, ctx())) == 0  # nothing pays for itself: a plain step


def test_node_cap_per_request_and_per_config():
    props = [Proposal("s", token_ids=tuple(range(10, 30)), confidence=1.0)]
    flat = {1: 1.0, 64: 1.0}
    assert len(CostAwareTreeBuilder(flat).build(props, ctx(max_nodes=5))) == 5
    assert len(CostAwareTreeBuilder(flat, BuilderConfig(max_nodes=3)).build(props, ctx())) == 3


def test_merged_trees_are_ancestor_closed_and_record_all_sources():
    rng = random.Random(1)
    builder = CostAwareTreeBuilder({1: 1.0, 64: 1.2})
    for _ in range(30):
        props = [
            Proposal(rng.choice("abc"), token_ids=tuple(rng.randrange(5) for _ in range(rng.randint(1, 6))),
                     confidence=rng.random())
            for _ in range(rng.randint(1, 6))
        ]
        tree = builder.build(props, ctx())
        tree.validate(vocab_size=5)
        assert closed_under_ancestors(tree)
        for i in range(len(tree)):  # every source whose proposal passes through a node is recorded
            path = tuple(tree.tokens[j] for j in tree.path_to(i))
            expect = {p.source for p in props if p.token_ids[: len(path)] == path}
            assert set(tree.sources[i]) == expect


def test_agreement_between_sources_raises_the_score():
    builder = CostAwareTreeBuilder(CURVE)
    one = [DraftSequence((5, 6), "a", None, (0.5, 0.5))]
    two = one + [DraftSequence((5, 6), "b", None, (0.5, 0.5))]
    t1, t2 = TokenTree.from_sequences(one), TokenTree.from_sequences(two)
    s1 = builder._scores(t1, builder._confidences(t1, one))
    s2 = builder._scores(t2, builder._confidences(t2, two))
    assert s2[0] > s1[0] and s2[1] > s1[1]
    assert s1[1] < s1[0]  # a child never scores above its parent


def test_learning_per_source_and_depth_moves_the_estimates():
    builder = CostAwareTreeBuilder(CURVE)
    before_good, before_bad = builder.stats.rate("good", 1), builder.stats.rate("bad", 1)
    for _ in range(30):
        tree = TokenTree.from_sequences([DraftSequence((5, 6), "good"), DraftSequence((7,), "bad")])
        builder.observe(tree, Verdict(accepted=[0, 1], next_token=9), ctx())
    assert builder.stats.rate("good", 1) > before_good and builder.stats.rate("good", 2) > 0.8
    assert builder.stats.rate("bad", 1) < before_bad
    snap = builder.stats.snapshot()
    assert snap["good"]["accepted"] == 60 and snap["bad"]["accepted"] == 0
    assert snap["good"]["by_depth"] == {1: 1.0, 2: 1.0}


def test_depth_two_is_only_counted_when_its_parent_was_accepted():
    stats = AcceptanceStats((1.0, 1.0), {})
    builder = CostAwareTreeBuilder(CURVE)
    builder.stats = stats
    tree = TokenTree.from_sequences([DraftSequence((5, 6, 7), "a")])
    builder.observe(tree, Verdict(accepted=[], next_token=9), ctx())
    assert stats.snapshot()["a"]["proposed"] == 1  # depth 2 and 3 were never tried


def test_fall_back_to_plain_decoding_after_fruitless_steps_then_probe_again():
    cfg = BuilderConfig(fallback_after=3, cooldown_steps=2)
    builder = CostAwareTreeBuilder({1: 1.0, 64: 1.0}, cfg)
    props = [Proposal("s", token_ids=(5, 6), confidence=1.0)]
    for _ in range(3):
        tree = builder.build(props, ctx("req"))
        assert len(tree) > 0
        builder.observe(tree, Verdict(accepted=[], next_token=9), ctx("req"))
    assert len(builder.build(props, ctx("req"))) == 0  # cooling down
    assert len(builder.build(props, ctx("req"))) == 0
    assert len(builder.build(props, ctx("other"))) > 0  # other requests are unaffected
    assert len(builder.build(props, ctx("req"))) > 0  # probing again


@pytest.mark.parametrize("accepted_per_tree", [1, None])
def test_the_budget_backs_off_when_trees_are_accepted_less_than_estimated(monkeypatch, accepted_per_tree):
    """Scores are scaled by realized / predicted accepted nodes: estimates that stay optimistic
    (here the per-source rates are frozen at their priors) shrink the trees; right ones do not."""
    builder = CostAwareTreeBuilder({1: 1.0, 64: 1.0 + 63 * 0.2})  # each node costs a fifth of a step
    monkeypatch.setattr(builder.stats, "record", lambda *a, **k: None)
    props = [Proposal("a", token_ids=tuple(range(5, 17)), confidence=0.9),
             Proposal("b", token_ids=tuple(range(5, 13)), confidence=0.6)]
    first = builder.build(props, ctx("r0"))
    assert len(first) >= 8 and first.expected_accepted > 4
    for i in range(1, 80):
        tree = builder.build(props, ctx(f"r{i}"))  # a new request each step: no fall-back cool-down
        n = len(tree) if accepted_per_tree is None else min(accepted_per_tree, len(tree))
        builder.observe(tree, Verdict(accepted=list(range(n)), next_token=99), ctx(f"r{i}"))
    last = builder.build(props, ctx("last"))
    if accepted_per_tree is None:  # every node accepted: the estimates were pessimistic, never inflated
        assert builder.calibration.factor == 1.0 and len(last) == len(first)
    else:
        assert builder.calibration.factor < 0.4
        assert len(last) < len(first) / 2
        cand = builder.candidates(props, ctx("x"))  # the budget weighs calibrated scores; learning, raw ones
        assert cand.scores == pytest.approx([x * builder.calibration.factor for x in cand.raw_scores])
        assert cand.select([0, 1, 2]).expected_accepted == pytest.approx(sum(cand.raw_scores[:3]))


@pytest.mark.parametrize("bad", [dict(max_nodes=-1), dict(prior=(0.0, 1.0)), dict(fallback_after=0),
                                 dict(source_priors={"x": (1.0, -1.0)})])
def test_bad_builder_config_is_rejected(bad):
    with pytest.raises(ValueError):
        BuilderConfig(**bad)


def test_text_proposals_are_aligned_with_the_target_tokenizer():
    from draftmesh.draft.align import TextAligner
    from draftmesh.models import load_tokenizer

    tok = load_tokenizer("smollm2-135m")
    committed = tuple(tok.encode("The chair of the Federal Re", add_special_tokens=False))
    builder = CostAwareTreeBuilder({1: 1.0, 64: 1.0}, aligner=TextAligner(tok))
    c = DraftContext(token_ids=committed, prompt_len=len(committed), request_id="t")
    tree = builder.build([Proposal("rules", text="serve Board of Governors", confidence=0.9)], c)
    assert tok.decode(list(committed) + tree.tokens).startswith("The chair of the Federal Reserve Board")


def test_every_builder_drafts_text_proposals_in_a_plain_decoder():
    """``SpeculativeDecoder(target, sources)`` with no builder, or with a TrieBuilder given no
    aligner, still turns a text source's drafts into tree nodes (they used to be dropped)."""
    from tiny_models import tiny_target

    from draftmesh.io_struct import GenerationRequest
    from draftmesh.verify.decoder import SpeculativeDecoder
    from draftmesh.verify.tree_builder import TrieBuilder

    target = tiny_target("llama")
    req = GenerationRequest((5, 6, 7), max_new_tokens=20)
    want = SpeculativeDecoder(target).generate(req).token_ids

    class TextOracle:
        name = "text"

        def propose(self, c: DraftContext) -> list[Proposal]:
            rest = want[len(c.generated_ids):][:6]
            return [Proposal("text", text=" " + target.tokenizer.decode(rest), text_complete=True)] if rest else []

    for builder in (None, TrieBuilder(max_nodes=8)):
        got = SpeculativeDecoder(target, [TextOracle()], builder).generate(req)
        assert got.token_ids == want
        assert sum(s.accepted_by_source.get("text", 0) for s in got.steps) >= len(want) // 2


# ---------------------------------------------------------------------- whatever a source sends
def test_a_draft_is_cut_to_the_node_cap_before_the_trie_is_built():
    from draftmesh.verify.tree_builder import proposal_sequences

    long = Proposal("s", token_ids=tuple(range(5, 20_005)), token_probs=(0.5,) * 20_000)
    text = Proposal("t", text="w " * 100_000)
    seqs = proposal_sequences([long, text], ctx(), None, max_nodes=16)
    assert [len(s.tokens) for s in seqs] == [16]  # text without an aligner is dropped, as before
    tree = CostAwareTreeBuilder(CURVE, BuilderConfig(max_nodes=16)).build([long], ctx())
    assert 0 < len(tree) <= 16 and tree.tokens == list(range(5, 5 + len(tree)))


@pytest.mark.parametrize("probs", [(float("inf"),) * 3, (float("nan"), 2.0, -1.0), (1e308, 1e308, 1e308)])
def test_scores_out_of_range_are_clamped_not_fatal(probs):
    """A token_probs of +inf used to reach int(inf) in the confidence bins: OverflowError, and the
    request failed with INTERNAL."""
    builder = CostAwareTreeBuilder(CURVE)
    tree = builder.build([Proposal("s", token_ids=(4, 5, 6), token_probs=probs)], ctx())
    assert tree.tokens[: len(tree)] == [4, 5, 6][: len(tree)]
    assert all(0.0 <= c <= 1.0 for scores in tree.source_scores or [] for c in scores.values())
    builder.observe(tree, Verdict(accepted=list(range(len(tree))), next_token=1), ctx())
