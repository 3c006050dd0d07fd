"""Seeded sampling is reproducible whatever the tree, and still exactly the target's law.

A seeded request draws position i's token from noise keyed by (seed, i) (``KeyedDraws``), so
speculation off, two different source sets and a busy batch must all give the same text. The
law is checked by a chi-square over seeds against the exact two-token law of a tiny float64
model, as in test_sampling_lossless.py; a keyed stream that reuses one position's noise for the
next must fail the same test (the test has the power to catch a broken key).
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from scipy.stats import chisquare
from two_token_law import PROMPT, VOCAB, exact_law, logits_table, model  # noqa: F401 (fixtures)

from draftmesh.draft.base import DraftContext, Proposal
from draftmesh.draft.prompt_lookup import PromptLookupSource
from draftmesh.io_struct import GenerationRequest, GenerationResult, SamplingParams, SpeculationParams
from draftmesh.sampling import KeyedDraws, target_probs
from draftmesh.tree import QDraw, TokenTree
from draftmesh.verify.acceptance import verify_keyed
from draftmesh.verify.decoder import SpeculativeDecoder
from draftmesh.verify.tree_builder import TrieBuilder

def chi2_pvalue(counts: torch.Tensor, law: torch.Tensor) -> float:
    n = counts.sum()
    expected, observed = (law * n).flatten(), counts.flatten()
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum().unsqueeze(0)])
    exp = torch.cat([expected[big], expected[~big].sum().unsqueeze(0)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    return float(chisquare(obs.numpy(), (exp * obs.sum() / exp.sum()).numpy()).pvalue)


def random_tree(rng: random.Random, root_probs: torch.Tensor) -> TokenTree:
    """Depth <= 2: deterministic drafts, and drafts sampled from q (often the likely token)."""
    tree = TokenTree()
    for order in range(rng.randint(1, 3)):
        node = -1
        for _ in range(rng.randint(1, 2)):
            if rng.random() < 0.5:
                x = rng.choices(range(VOCAB), weights=root_probs.tolist())[0]
                node = tree.add(node, x, f"q{order}", QDraw(f"q{order}", order, root_probs))
            else:
                node = tree.add(node, rng.randrange(VOCAB), f"det{order}")
    return tree


def keyed_pairs(root, after, params, n: int, *, trees: bool = True) -> torch.Tensor:
    """The first two tokens for seeds 0..n-1, verified over random trees; checks on the way that
    each equals the seed's plain (tree-less) draw."""
    rng = random.Random(1)
    counts = torch.zeros((VOCAB, VOCAB), dtype=torch.float64)
    p_root = target_probs(root, params)
    for seed in range(n):
        draws = KeyedDraws(seed)
        tree = random_tree(rng, p_root) if trees else TokenTree()
        rows = [root] + [after[tree.tokens[i]] if tree.depths[i] == 1 else root for i in range(len(tree))]
        verdict = verify_keyed(tree, torch.stack(rows), params, draws.at(0))
        toks = [tree.tokens[a] for a in verdict.accepted] + [verdict.next_token]
        if len(toks) == 1:
            toks.append(draws.at(1).draw(target_probs(after[toks[0]], params)))
        plain0 = draws.at(0).draw(p_root)
        assert toks[:2] == [plain0, draws.at(1).draw(target_probs(after[plain0], params))]
        counts[toks[0], toks[1]] += 1
    return counts


PARAMS = [SamplingParams(1.0), SamplingParams(0.7, top_k=6), SamplingParams(1.3, top_p=0.8)]


@pytest.mark.parametrize("params", PARAMS, ids=["t1", "topk", "topp"])
def test_keyed_draws_follow_the_target_law_over_seeds(logits_table, params):
    root, after = logits_table
    law = exact_law(root, after, params)
    counts = keyed_pairs(root, after, params, n=12000)
    assert chi2_pvalue(counts, law) > 1e-3
    assert 0.5 * (counts / counts.sum() - law).abs().sum() < 0.05


def test_a_stream_that_reuses_noise_across_positions_is_caught(logits_table, monkeypatch):
    """Keying by seed alone (the same noise at every position) correlates the two tokens."""
    def same_noise(self, position, n):
        u = torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(self.seed))
        return -torch.log(-torch.log(u))

    monkeypatch.setattr(KeyedDraws, "noise", same_noise)
    root, after = logits_table
    params = PARAMS[0]
    counts = keyed_pairs(root, after, params, n=12000, trees=False)
    assert chi2_pvalue(counts, exact_law(root, after, params)) < 1e-6


def test_different_seeds_and_positions_draw_differently():
    p = torch.full((64,), 1 / 64, dtype=torch.float64)
    assert len({KeyedDraws(s).draw(p) for s in range(40)}) > 20
    assert len({KeyedDraws(7).at(i).draw(p) for i in range(40)}) > 20
    assert KeyedDraws(7).at(3).draw(p) == KeyedDraws(7).at(1).draw(p, depth=2)


class Truth:
    """Drafts each request's known continuation, sometimes corrupted (test double)."""

    name = "truth"

    def __init__(self, vocab: int, seed: int) -> None:
        self.truth: dict[tuple[int, ...], tuple[int, ...]] = {}
        self.vocab, self.rng = vocab, random.Random(seed)

    def propose(self, ctx: DraftContext) -> list[Proposal]:
        want = list(self.truth.get(tuple(ctx.token_ids[: ctx.prompt_len]), ()))[len(ctx.generated_ids):]
        chain = [want[i] if i < len(want) and self.rng.random() < 0.8 else self.rng.randrange(self.vocab)
                 for i in range(self.rng.randint(1, 8))]
        return [Proposal(self.name, token_ids=tuple(chain), confidence=1.0),
                Proposal(self.name, token_ids=(self.rng.randrange(self.vocab),), confidence=0.5)]


def run_batch(decoder, reqs) -> list[GenerationResult]:
    """All requests in one batch, stepped together until every one has finished."""
    tickets = [decoder.submit(r) for r in reqs]
    while not all(t.done for t in tickets):
        decoder.scheduler.step()
    return [t.events[-1] for t in tickets]


def test_a_seeded_request_gives_the_same_text_whatever_the_tree(tiny):
    rng = random.Random(4)
    off = SpeculationParams(enabled=False)
    for n in range(4):
        prompt = tuple(rng.randrange(1, tiny.vocab_size) for _ in range(rng.randint(4, 20)))
        sampling = SamplingParams(0.9, top_p=0.95, seed=1000 + n)
        req = GenerationRequest(prompt * 2, max_new_tokens=24, sampling=sampling)
        plain = SpeculativeDecoder(tiny).generate(GenerationRequest(prompt * 2, max_new_tokens=24, sampling=sampling,
                                                                    speculation=off))
        truth = Truth(tiny.vocab_size, n)
        truth.truth[prompt * 2] = plain.token_ids
        a = SpeculativeDecoder(tiny, [truth], TrieBuilder(max_nodes=16)).generate(req)
        b = SpeculativeDecoder(tiny, [PromptLookupSource(), Truth(tiny.vocab_size, n + 50)]).generate(req)
        assert a.token_ids == b.token_ids == plain.token_ids and a.text == b.text == plain.text
        assert sum(s.accepted for s in a.steps) > 0  # the drafts were really used
        others = [GenerationRequest(tuple(rng.randrange(1, tiny.vocab_size) for _ in range(9)), max_new_tokens=16,
                                    sampling=SamplingParams(rng.choice([0.0, 1.0]))) for _ in range(3)]
        busy = SpeculativeDecoder(tiny, [truth, PromptLookupSource()])
        results = run_batch(busy, others[:2] + [req] + others[2:])
        assert results[2].token_ids == plain.token_ids and results[2].text == plain.text


def test_seeded_requests_through_the_decoder_follow_the_target_law(model, logits_table):
    """The real loop (tree forward, commit, next step) with drafts that are often right."""

    class Guess:
        name = "guess"

        def __init__(self) -> None:
            self.rng = random.Random(0)

        def propose(self, ctx):
            return [Proposal("guess", token_ids=tuple(self.rng.randrange(4) for _ in range(2))) for _ in range(3)]

    root, after = logits_table
    params = SamplingParams(1.0, top_k=8)
    law = exact_law(root, after, params)
    no_eos = copy.copy(model)  # the exact law is of two tokens, so no token ends the output
    no_eos.eos_token_ids = frozenset()
    decoder = SpeculativeDecoder(no_eos, [Guess()])
    counts = torch.zeros((VOCAB, VOCAB), dtype=torch.float64)
    accepted = 0
    for seed in range(2500):
        out = decoder.generate(GenerationRequest(tuple(PROMPT), max_new_tokens=2,
                                                 sampling=SamplingParams(1.0, top_k=8, seed=seed)))
        counts[out.token_ids[0], out.token_ids[1]] += 1
        accepted += sum(s.accepted for s in out.steps)
    assert accepted > 100
    assert counts[law == 0].sum() == 0  # never a pair outside top-k
    assert chi2_pvalue(counts, law) > 1e-3
