"""The ``llm`` draft source on tiny random models (float64), and once on the real models.

A draft that is a copy of the target is perfect: its greedy chain is the target's greedy
continuation, and its sampled chain is always accepted whole. A draft with other weights
tests the mechanics (tree masks, probabilities, cache reuse) against direct forwards.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from tiny_models import tiny_target

from draftmesh.backend import TorchTarget
from draftmesh.draft.align import TextAligner
from draftmesh.draft.base import DraftContext, Proposal
from draftmesh.draft.llm import LLMSource
from draftmesh.io_struct import GenerationRequest, SamplingParams
from draftmesh.sampling import target_probs
from draftmesh.verify.decoder import SpeculativeDecoder
from draftmesh.verify.tree_builder import BuilderConfig, CostAwareTreeBuilder, TrieBuilder

VOCAB = 64
ARCHS = ("llama", "gemma3")  # gemma3: sliding window 8, so contexts > 8 test the window masks


@pytest.fixture(scope="module", params=ARCHS)
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def target(arch):
    return tiny_target(arch, vocab_size=VOCAB, seed=0)


@pytest.fixture(scope="module")
def perfect(arch):
    """Same seed, same weights: the draft's distribution is the target's."""
    return tiny_target(arch, vocab_size=VOCAB, seed=0)


@pytest.fixture(scope="module")
def other(arch):
    return tiny_target(arch, vocab_size=VOCAB, seed=1)


def ctx_for(ids, request_id="r", prompt_len=None, **options) -> DraftContext:
    ids = tuple(ids)
    return DraftContext(
        token_ids=ids, prompt_len=len(ids) if prompt_len is None else prompt_len, request_id=request_id, options=options
    )


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, VOCAB) for _ in range(n)]


def greedy(target: TorchTarget, ids: list[int], n: int) -> list[int]:
    return list(SpeculativeDecoder(target).generate(GenerationRequest(tuple(ids), max_new_tokens=n)).token_ids)


@torch.inference_mode()
def direct_probs(draft: TorchTarget, ids: list[int]) -> torch.Tensor:
    """The draft's next-token distribution after ``ids``: one plain forward, no cache."""
    logits = draft.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
    return torch.softmax(logits.double(), dim=-1)


def check_tree(source: LLMSource, proposals: list[Proposal], max_nodes: int) -> None:
    tree = source.last_tree
    assert tree is not None and 0 < len(tree) <= max_nodes
    tree.validate(VOCAB)  # parents precede children: ancestor-closed, no duplicate siblings
    leaves = [i for i in range(len(tree)) if not tree.children(i)]
    paths = {tuple(tree.tokens[j] for j in tree.path_to(leaf)) for leaf in leaves}
    assert {p.token_ids for p in proposals} == paths  # one proposal per root-to-leaf path
    for p in proposals:
        assert p.token_dists is None
        assert p.confidence == pytest.approx(math.prod(p.token_probs), rel=1e-12)
    confs = [p.confidence for p in proposals]
    assert confs == sorted(confs, reverse=True)


# ---------------------------------------------------------------------- tree mode
def test_perfect_draft_chain_is_the_greedy_continuation(target, perfect):
    for seed, n in ((1, 5), (2, 20)):
        ids = prompt(seed, n)
        want = greedy(target, ids, 6)
        src = LLMSource(perfect, target_tokenizer=target.tokenizer, top_k=1, max_nodes=16, max_depth=6)
        props = src.propose(ctx_for(ids))
        assert len(props) == 1
        assert list(props[0].token_ids) == want[:6]
        check_tree(src, props, 16)


def test_perfect_draft_tree_holds_the_greedy_path(target, perfect):
    for seed, n in ((3, 4), (4, 25)):
        ids = prompt(seed, n)
        want = greedy(target, ids, 6)
        src = LLMSource(perfect, target_tokenizer=target.tokenizer, top_k=4, max_nodes=16, max_depth=6)
        props = src.propose(ctx_for(ids))
        check_tree(src, props, 16)
        tree = src.last_tree
        # following the most probable child from the root walks the target's greedy path
        node, walked = -1, []
        while tree.children(node):
            node = max(tree.children(node), key=lambda c: tree.draft_probs[c])
            walked.append(tree.tokens[node])
        assert walked and walked == want[: len(walked)]


def test_token_probs_are_the_drafts_real_probabilities(target, other):
    for seed, n, top_k, max_nodes in ((5, 3, 4, 16), (6, 30, 3, 12), (7, 12, 2, 24)):
        ids = prompt(seed, n)
        src = LLMSource(other, target_tokenizer=target.tokenizer, top_k=top_k, max_nodes=max_nodes, max_depth=5)
        props = src.propose(ctx_for(ids))
        check_tree(src, props, max_nodes)
        for p in props:
            for i, tok in enumerate(p.token_ids):
                want = direct_probs(other, ids + list(p.token_ids[:i]))
                assert p.token_probs[i] == pytest.approx(float(want[tok]), abs=1e-9)
                if i == 0:  # depth-1 children are the draft's top-k
                    assert tok in torch.topk(want, top_k).indices.tolist()


def test_kept_nodes_are_the_most_probable_expanded_ones(target, other):
    """Every node of a complete breadth expansion is scored; the kept ones are its top-N."""
    ids = prompt(8, 10)
    src = LLMSource(other, target_tokenizer=target.tokenizer, top_k=3, max_nodes=5, max_depth=2)
    src.propose(ctx_for(ids))
    tree = src.last_tree
    root = direct_probs(other, ids)
    first = torch.topk(root, 3)
    cums = {}
    for p1, t1 in zip(first.values.tolist(), first.indices.tolist()):
        cums[(t1,)] = p1
        second = torch.topk(direct_probs(other, ids + [t1]), 3)
        for p2, t2 in zip(second.values.tolist(), second.indices.tolist()):
            cums[(t1, t2)] = p1 * p2
    best = sorted(cums.values(), reverse=True)[:5]
    got = []
    for i in range(len(tree)):
        got.append(math.prod(tree.draft_probs[j] for j in tree.path_to(i)))
    assert sorted(got, reverse=True) == pytest.approx(best, abs=1e-12)


def test_deadline_stops_expanding_and_returns_what_it_has(target, other):
    ids = prompt(9, 12)
    src = LLMSource(other, target_tokenizer=target.tokenizer, top_k=4, max_depth=6, max_seconds=0.0)
    props = src.propose(ctx_for(ids))
    assert len(props) == 4 and all(len(p.token_ids) == 1 for p in props)
    assert src.stats.tree_forwards == 0 and src.stats.deadline_hits == 1


def test_node_budget_follows_the_builder_and_the_request(target, other):
    ids = prompt(22, 10)
    src = LLMSource(other, target_tokenizer=target.tokenizer, top_k=4, max_nodes=16, max_depth=4)
    for hint, options, want in ((5, {}, 5), (16, {"max_nodes": 3}, 3), (40, {}, 16)):
        props = src.propose(DraftContext(token_ids=tuple(ids), prompt_len=10, size_hint=hint, options=options))
        check_tree(src, props, want)
        assert len(src.last_tree) == want
    calls = src.stats.calls
    assert src.propose(DraftContext(token_ids=tuple(ids), prompt_len=10, size_hint=0)) == []
    assert src.propose(ctx_for(ids, max_nodes=0)) == []
    assert src.stats.calls == calls  # no draft work at all


# ---------------------------------------------------------------------- the KV cache
def cache_len(src: LLMSource, request_id: str) -> int:
    entry = src._entries[request_id]
    lengths = {layer.keys.shape[-2] for layer in entry.state.cache.layers}
    assert lengths == {entry.state.length}
    return entry.state.length


def same_proposals(a: list[Proposal], b: list[Proposal]) -> None:
    assert [p.token_ids for p in a] == [p.token_ids for p in b]
    for p, q in zip(a, b):
        assert p.token_probs == pytest.approx(q.token_probs, abs=1e-9)


def test_cache_is_reused_across_steps(target, other):
    make = lambda: LLMSource(other, target_tokenizer=target.tokenizer, top_k=3, max_nodes=12, max_depth=4)
    src = make()
    ids = prompt(10, 15)
    src.propose(ctx_for(ids))
    assert src.stats.prefilled_tokens == 15 and cache_len(src, "r") == 15  # the tree's entries are gone
    steps = [ids + [5, 9, 11], ids + [5, 9, 11, 3], ids[:7] + [4, 4]]  # extend, extend, roll back
    expected_prefill = [3, 1, 2]
    for new_ids, new in zip(steps, expected_prefill):
        before = src.stats.prefilled_tokens
        got = src.propose(ctx_for(new_ids))
        assert src.stats.prefilled_tokens - before == new
        assert cache_len(src, "r") == len(new_ids)
        same_proposals(got, make().propose(ctx_for(new_ids)))
    before = src.stats.prefilled_tokens
    again = src.propose(ctx_for(steps[-1]))  # the same ids: only the last one is re-fed
    assert src.stats.prefilled_tokens - before == 1
    same_proposals(again, make().propose(ctx_for(steps[-1])))


def test_requests_have_their_own_caches_in_a_bounded_lru(target, other):
    src = LLMSource(other, target_tokenizer=target.tokenizer, max_requests=2, max_depth=2)
    a, b, c = prompt(11, 9), prompt(12, 9), prompt(13, 9)
    src.propose(ctx_for(a, "a"))
    src.propose(ctx_for(b, "b"))
    before = src.stats.prefilled_tokens
    src.propose(ctx_for(a + [3], "a"))  # a's cache survived b
    assert src.stats.prefilled_tokens - before == 1
    src.propose(ctx_for(c, "c"))
    assert src.cached_requests == ["a", "c"]  # b was least recently used
    src.finish(ctx_for(c, "c"), [], "")
    assert src.cached_requests == ["a"]


# ---------------------------------------------------------------------- sampled mode
def test_sampled_chain_carries_the_distributions_it_was_drawn_from(target, other):
    ids = prompt(14, 11)
    src = LLMSource(other, target_tokenizer=target.tokenizer, sample=True, max_depth=5, seed=0)
    params = SamplingParams(temperature=0.7, top_k=20)
    for _ in range(3):
        (p,) = src.propose(ctx_for(ids, temperature=0.7, top_k=20))
        n = len(p.token_ids)
        assert n == 5 or p.token_ids[-1] in other.eos_token_ids
        assert p.token_dists.shape == (n, VOCAB)
        torch.testing.assert_close(p.token_dists.sum(dim=1), torch.ones(n, dtype=torch.float64))
        for i, tok in enumerate(p.token_ids):
            assert p.token_dists[i, tok] > 0
            assert p.token_probs[i] == pytest.approx(float(p.token_dists[i, tok]))
        want0 = target_probs(torch.log(direct_probs(other, ids)), params)
        torch.testing.assert_close(p.token_dists[0], want0, rtol=1e-9, atol=1e-12)
        last = target_probs(torch.log(direct_probs(other, ids + list(p.token_ids[:-1]))), params)
        torch.testing.assert_close(p.token_dists[-1], last, rtol=1e-9, atol=1e-12)
        assert cache_len(src, "r") == len(ids)
    # a greedy request (temperature 0) gets the deterministic tree instead
    props = src.propose(ctx_for(ids, temperature=0.0))
    assert all(p.token_dists is None for p in props) and len(props) > 1


def test_sampled_perfect_draft_is_always_accepted(target, perfect):
    """q == p, so the residual rule accepts every drafted token (a strong check of q). Unseeded:
    a seeded request takes the position-keyed draw instead, which accepts a sampled draft only
    where it equals that draw (``draftmesh.sampling``)."""
    src = LLMSource(perfect, target_tokenizer=target.tokenizer, sample=True, temperature=0.9, max_depth=4, seed=1)
    dec = SpeculativeDecoder(target, [src], TrieBuilder(max_nodes=32))
    req = GenerationRequest(tuple(prompt(15, 6)), max_new_tokens=30, sampling=SamplingParams(temperature=0.9))
    out = dec.generate(req)
    drafted = [s for s in out.steps if s.tree_size]
    assert drafted and all(s.accepted == s.tree_size for s in drafted)
    assert len(out.steps) < len(out.token_ids)


# ---------------------------------------------------------------------- end to end
@pytest.mark.parametrize("which", ["perfect", "other"])
def test_greedy_decoding_is_unchanged_and_faster_with_a_perfect_draft(target, perfect, other, which):
    draft = perfect if which == "perfect" else other
    plain = SpeculativeDecoder(target)
    src = LLMSource(draft, target_tokenizer=target.tokenizer, max_nodes=16, top_k=3, max_depth=6)
    spec = SpeculativeDecoder(target, [src], TrieBuilder(max_nodes=32))
    for seed, n, new in ((16, 3, 25), (17, 20, 40)):
        req = GenerationRequest(tuple(prompt(seed, n)), max_new_tokens=new)
        want, got = plain.generate(req), spec.generate(req)
        assert got.token_ids == want.token_ids
        if which == "perfect":
            assert len(got.steps) < len(want.steps)
            assert got.mean_accepted_per_step > 2.0
    assert src.cached_requests == []  # finish() dropped each request's cache


# ---------------------------------------------------------------------- another tokenizer
def word_tokenizer(vocab_size: int, perm: list[int] | None = None):
    """Word 'w{i}' gets id perm[i] (identity by default).

    Unlike ``tiny_models.word_tokenizer`` the special tokens only match whole words, so
    text round-trips ("w13" is one token there, not "w1" + "3"): the text path needs that.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    perm = perm or list(range(vocab_size))
    tok = Tokenizer(models.WordLevel({f"w{i}": perm[i] for i in range(vocab_size)}, unk_token="w1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=AddedToken("w0", single_word=True),
        unk_token=AddedToken("w1", single_word=True),
    )


@pytest.fixture(scope="module")
def text_target(target):
    """The target with a tokenizer whose text round-trips."""
    return TorchTarget(target.model, word_tokenizer(VOCAB), name="tiny-words")


@pytest.fixture(scope="module")
def text_draft(arch):
    """The target's weights with the vocabulary permuted: perfect, but only through text."""
    perm = list(range(VOCAB))
    random.Random(0).shuffle(perm)
    model = tiny_target(arch, vocab_size=VOCAB, seed=0).model
    index = torch.tensor(perm)
    with torch.no_grad():
        emb_in, emb_out = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        for weight in (emb_in,) if emb_in is emb_out else (emb_in, emb_out):
            moved = torch.empty_like(weight)
            moved[index] = weight
            weight.copy_(moved)
    model.config.eos_token_id = model.generation_config.eos_token_id = perm[0]
    return TorchTarget(model, word_tokenizer(VOCAB, perm), name="tiny-permuted")


def test_tokenizer_detection(target, text_target, other, text_draft):
    assert LLMSource(other, target_tokenizer=target.tokenizer).same_tokenizer
    assert LLMSource(other).same_tokenizer
    assert not LLMSource(text_draft, target_tokenizer=text_target.tokenizer).same_tokenizer
    assert not LLMSource(other, target_tokenizer=target.tokenizer, same_tokenizer=False).same_tokenizer


def test_text_mode_proposes_the_greedy_continuation_as_text(text_target, text_draft):
    ids = prompt(18, 12)
    want = greedy(text_target, ids, 5)
    src = LLMSource(text_draft, target_tokenizer=text_target.tokenizer, max_depth=5)
    (p,) = src.propose(ctx_for(ids))
    assert p.token_ids is None
    # the draft stops before a special token (w0 = EOS, w1 = unknown): text never means one
    n = next((i for i, t in enumerate(want) if t in (0, 1)), len(want))
    assert p.text == "".join(f" w{t}" for t in want[:n])
    probs = []
    for i in range(n):
        draft_ids = text_draft.tokenizer.encode(text_target.tokenizer.decode(ids + want[:i]), add_special_tokens=False)
        probs.append(float(direct_probs(text_draft, draft_ids).max()))
    assert p.confidence == pytest.approx(math.prod(probs), rel=1e-9)


def test_text_mode_reuses_draft_ids_and_cache(text_target, text_draft):
    ids = prompt(19, 20)
    src = LLMSource(text_draft, target_tokenizer=text_target.tokenizer, max_depth=3)
    src.propose(ctx_for(ids))
    assert src.stats.full_encodes == 1 and src.stats.prefilled_tokens == 20
    longer = ids + [7, 8, 9]
    got = src.propose(ctx_for(longer))
    assert src.stats.full_encodes == 1  # only the end was re-encoded
    assert src.stats.prefilled_tokens == 23
    entry = src._entries["r"]
    assert entry.ids == text_draft.tokenizer.encode(text_target.tokenizer.decode(longer), add_special_tokens=False)
    fresh = LLMSource(text_draft, target_tokenizer=text_target.tokenizer, max_depth=3)
    assert [p.text for p in got] == [p.text for p in fresh.propose(ctx_for(longer))]
    # without the target tokenizer, the committed text tail is used
    tail_src = LLMSource(text_draft, same_tokenizer=False, max_depth=3)
    tail = DraftContext(token_ids=tuple(longer), prompt_len=20, text_tail=text_target.tokenizer.decode(longer))
    assert [p.text for p in tail_src.propose(tail)] == [p.text for p in got]


def text_builder(target: TorchTarget, max_nodes: int = 32) -> CostAwareTreeBuilder:
    """The production builder (it aligns text), with a flat cost curve so that it drafts."""
    config = BuilderConfig(max_nodes=max_nodes)
    return CostAwareTreeBuilder({1: 1.0, 64: 1.0}, config, aligner=TextAligner(target.tokenizer))


def test_text_mode_end_to_end_greedy_is_unchanged(text_target, text_draft):
    src = LLMSource(text_draft, target_tokenizer=text_target.tokenizer, max_depth=6)
    plain = SpeculativeDecoder(text_target)
    spec = SpeculativeDecoder(text_target, [src], text_builder(text_target))
    for seed, n in ((20, 5), (21, 18)):
        req = GenerationRequest(tuple(prompt(seed, n)), max_new_tokens=30)
        want, got = plain.generate(req), spec.generate(req)
        assert got.token_ids == want.token_ids
        assert len(got.steps) < len(want.steps)


# ---------------------------------------------------------------------- real models
@pytest.mark.slow
def test_smollm2_drafting_for_gemma3_is_lossless():
    """gemma3-270m target, smollm2-135m draft (different tokenizers: text proposals)."""
    from draftmesh.prompts import encode_prompt

    target = TorchTarget.load("gemma3-270m")
    draft = TorchTarget.load("smollm2-135m")
    src = LLMSource(draft, target_tokenizer=target.tokenizer, max_depth=6)
    assert not src.same_tokenizer
    ids = tuple(encode_prompt(target.tokenizer, "The capital of France is Paris. The capital of Germany is"))
    req = GenerationRequest(ids, max_new_tokens=24)
    want = SpeculativeDecoder(target).generate(req)
    calls_before, seconds_before = src.stats.calls, src.stats.seconds
    got = SpeculativeDecoder(target, [src], text_builder(target)).generate(req)
    assert got.token_ids == want.token_ids
    calls = src.stats.calls - calls_before
    print(
        f"\n[llm slow] plain steps {len(want.steps)}, speculative steps {len(got.steps)}, "
        f"mean accepted tokens/step {got.mean_accepted_per_step:.2f}, "
        f"draft {1000 * (src.stats.seconds - seconds_before) / max(1, calls):.1f} ms/step, "
        f"verify {1000 * sum(s.verify_s for s in got.steps) / len(got.steps):.1f} ms/step, "
        f"plain {1000 * want.seconds / len(want.steps):.1f} ms/step"
    )


# ---------------------------------------------------------------------- in a verifier
def test_in_a_verifier_the_source_drafts_on_the_compute_thread_within_the_step_deadline(target, perfect, monkeypatch):
    """It runs on the compute thread, taking turns with the target's forwards (draft.base), where
    the step's source deadline cannot stop it: that deadline becomes its own time limit."""
    import threading

    from draftmesh import compute
    from draftmesh.draft import registry
    from draftmesh.verify.engine import build_decoder

    monkeypatch.setattr(registry.TorchTarget, "load", staticmethod(lambda spec, **kw: perfect))  # no second model
    threads: set[int] = set()
    hook = perfect.model.get_input_embeddings().register_forward_pre_hook(lambda m, a: threads.add(threading.get_ident()))
    try:
        spec = build_decoder(target, ("llm",), source_deadline_s=0.25, builder_config=BuilderConfig(max_nodes=16))
        timed = build_decoder(target, ("llm",), source_deadline_s=0.25, source_options={"llm": {"max_seconds": 1.5}})
        req = GenerationRequest(tuple(prompt(18, 5)), max_new_tokens=20)
        got = spec.generate(req)
    finally:
        hook.remove()
    assert [s.max_seconds for s in spec.sources] == [0.25] and [s.max_seconds for s in timed.sources] == [1.5]
    assert got.token_ids == SpeculativeDecoder(target).generate(req).token_ids
    assert threads == {compute.run(threading.get_ident)}
    assert spec.sources[0].stats.calls > 0 and got.mean_accepted_per_step > 1.0
