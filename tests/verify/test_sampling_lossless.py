"""Speculative sampling must reproduce the target's distribution exactly.

The target is a tiny random model (vocabulary 16). The exact law of the first two
generated tokens is computed by enumeration; speculative sampling over random trees
(deterministic drafts, sampled q drafts from several sources, mixes; with top-k/top-p)
must match it under a chi-square test with a fixed seed. A deliberately broken residual
rule must fail the same test, which shows the test has the power to catch one.
"""

from __future__ import annotations

import random

import pytest
import torch
from scipy.stats import chisquare
from two_token_law import PROMPT, VOCAB, exact_law, logits_table, model  # noqa: F401 (fixtures)

from draftmesh.io_struct import GenerationRequest, SamplingParams
from draftmesh.sampling import sample, target_probs
from draftmesh.tree import QDraw, TokenTree
from draftmesh.verify import acceptance
from draftmesh.verify.acceptance import verify_sampling
from draftmesh.verify.decoder import SpeculativeDecoder

def random_dist(rng: random.Random) -> torch.Tensor:
    w = torch.tensor([rng.expovariate(1.0) ** 2 for _ in range(VOCAB)], dtype=torch.float64)
    return w / w.sum()


def draw(q: torch.Tensor, rng: random.Random) -> int:
    return rng.choices(range(VOCAB), weights=q.tolist())[0]


def random_tree(rng: random.Random, kind: str) -> TokenTree:
    """Depth <= 2 trees. q-chains are sampled from their own q, one chain per source."""
    tree = TokenTree()
    kinds = [kind] if kind != "mix" else [rng.choice(["onehot", "q"]) for _ in range(3)]
    for order, k in enumerate(kinds * (1 if kind == "mix" else rng.randint(1, 3))):
        node = -1
        for _ in range(rng.randint(1, 2)):
            if k == "onehot":
                node = tree.add(node, rng.randrange(VOCAB), f"det{order}")
            else:
                q = random_dist(rng)
                x = draw(q, rng)
                node = tree.add(node, x, f"src{order}", QDraw(f"src{order}", order, q))
    return tree


def sample_pairs(root, after, params, kind: str, n: int, seed: int) -> torch.Tensor:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros((VOCAB, VOCAB), dtype=torch.float64)
    for _ in range(n):
        tree = random_tree(rng, kind)
        # tree logits equal sequential logits (test_backend proves it); build the rows directly
        rows = [root] + [after[tree.tokens[i]] if tree.depths[i] == 1 else root for i in range(len(tree))]
        verdict = verify_sampling(tree, torch.stack(rows), params, gen)
        toks = [tree.tokens[a] for a in verdict.accepted] + [verdict.next_token]
        if len(toks) == 1:
            toks.append(sample(target_probs(after[toks[0]], params), gen))
        counts[toks[0], toks[1]] += 1
    return counts


def chi2_pvalue(counts: torch.Tensor, law: torch.Tensor) -> float:
    n = counts.sum()
    expected = (law * n).flatten()
    observed = counts.flatten()
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum().unsqueeze(0)])
    exp = torch.cat([expected[big], expected[~big].sum().unsqueeze(0)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    exp = exp * obs.sum() / exp.sum()
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue)


PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=6),
    SamplingParams(temperature=1.3, top_p=0.8),
]


@pytest.mark.parametrize("kind", ["onehot", "q", "mix"])
@pytest.mark.parametrize("params", PARAMS, ids=["t1", "topk", "topp"])
def test_speculative_sampling_matches_the_target_law(logits_table, kind, params):
    root, after = logits_table
    law = exact_law(root, after, params)
    counts = sample_pairs(root, after, params, kind, n=12000, seed=11)
    assert chi2_pvalue(counts, law) > 1e-3
    tv = 0.5 * (counts / counts.sum() - law).abs().sum()
    assert tv < 0.05


def test_a_broken_residual_rule_is_caught(logits_table, monkeypatch):
    """Forgetting to subtract q from p after a rejection must fail the same test."""
    original = acceptance._choose_child

    def broken(tree, children, p, generator):
        stripped = TokenTree.subtree(tree, range(len(tree)))
        for c in children:  # same q-acceptance test, but the residual is p itself
            for d in tree.qdraws[c]:
                x = tree.tokens[c]
                if acceptance._uniform(generator) * float(d.dist[x]) < float(p[x]):
                    return c
        stripped.qdraws = [() for _ in stripped.tokens]
        return original(stripped, children, p, generator)

    monkeypatch.setattr(acceptance, "_choose_child", broken)
    root, after = logits_table
    params = PARAMS[0]
    counts = sample_pairs(root, after, params, "q", n=12000, seed=11)
    assert chi2_pvalue(counts, exact_law(root, after, params)) < 1e-6


def test_collapsing_agreeing_q_drafts_into_one_deterministic_node_is_biased(logits_table, monkeypatch):
    """Why the tree keeps one draw per source: treating agreeing sampled drafts as a single
    deterministic node (and the others as q draws) changes the output law."""
    original = acceptance._choose_child

    def collapsed(tree, children, p, generator):
        stripped = TokenTree.subtree(tree, range(len(tree)))
        stripped.qdraws = [d if len(d) == 1 else () for d in tree.qdraws]
        return original(stripped, children, p, generator)

    monkeypatch.setattr(acceptance, "_choose_child", collapsed)
    root, after = logits_table
    params = PARAMS[0]

    rng = random.Random(3)
    gen = torch.Generator().manual_seed(3)
    q = random_dist(rng)  # two sources sampling from the same peaked q often agree
    counts = torch.zeros(VOCAB, dtype=torch.float64)
    for _ in range(20000):
        tree = TokenTree()
        for order in range(2):
            x = draw(q, rng)
            tree.add(-1, x, f"src{order}", QDraw(f"src{order}", order, q))
        rows = [root] + [after[t] for t in tree.tokens]
        verdict = verify_sampling(tree, torch.stack(rows), params, gen)
        first = tree.tokens[verdict.accepted[0]] if verdict.accepted else verdict.next_token
        counts[first] += 1
    law = target_probs(root, params)
    assert chisquare(counts.numpy(), (law * counts.sum()).numpy()).pvalue < 1e-6


def test_end_to_end_sampling_through_the_decoder(model, logits_table):
    """The real loop (tree forward, commit, next step) also keeps the first-token law."""
    from draftmesh.draft.base import Proposal

    class Guess:
        name = "guess"

        def __init__(self, seed):
            self.rng = random.Random(seed)

        def propose(self, ctx):
            return [Proposal("guess", token_ids=tuple(self.rng.randrange(VOCAB) for _ in range(2))) for _ in range(3)]

    root, after = logits_table
    params = SamplingParams(temperature=1.0, top_k=8)
    law = exact_law(root, after, params)
    decoder = SpeculativeDecoder(model, [Guess(0)])
    counts = torch.zeros(VOCAB, dtype=torch.float64)
    for seed in range(2000):
        req = GenerationRequest(tuple(PROMPT), max_new_tokens=2, sampling=SamplingParams(1.0, top_k=8, seed=seed))
        counts[decoder.generate(req).token_ids[0]] += 1
    expected = law.sum(1) * counts.sum()
    support = expected > 0
    assert counts[~support].sum() == 0  # never a token outside top-k
    assert chisquare(counts[support].numpy(), expected[support].numpy()).pvalue > 1e-3


def test_sampling_with_a_seed_is_reproducible(model):
    from draftmesh.draft.prompt_lookup import PromptLookupSource

    decoder = SpeculativeDecoder(model, [PromptLookupSource()])
    req = GenerationRequest(tuple(PROMPT * 3), max_new_tokens=20, sampling=SamplingParams(0.9, seed=42))
    assert decoder.generate(req).token_ids == decoder.generate(req).token_ids
