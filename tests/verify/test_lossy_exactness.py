"""At zero leniency a lossy policy samples exactly the target's distribution (issue 18).

Every node flagged means the policy may accept by the exact rule only, so whatever the
policy, the first emitted token must follow p at the root and the second, after an accepted
child, p at that child. Chi-square over a fixed seed; the old per-node coin u < p(x) put
0.625 / 0.375 on two children at p = 0.5.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from draftmesh.io_struct import SamplingParams
from draftmesh.tree import TokenTree
from draftmesh.verify.lossy import BlockPolicy, NKLPolicy, SemanticPolicy, TypicalPolicy

SAMPLING = SamplingParams(temperature=1.0)
V = 6
ROOT = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.07, 0.03], dtype=torch.float64)
AFTER_A = torch.tensor([0.05, 0.10, 0.40, 0.35, 0.06, 0.04], dtype=torch.float64)
OTHER = torch.full((V,), 1.0 / V, dtype=torch.float64)


def _tree() -> TokenTree:
    """Root children 1, 0, 3 (not in probability order); node 0 (token 1) has children 2, 3."""
    tree = TokenTree()
    a = tree.add(-1, 1, "a")
    tree.add(-1, 0, "b")
    tree.add(-1, 3, "c")
    tree.add(a, 2, "d")
    tree.add(a, 3, "e")
    return tree


def _logits(tree: TokenTree) -> torch.Tensor:
    rows = [ROOT.log()] + [OTHER.log()] * len(tree)
    rows[1] = AFTER_A.log()  # row after node 0
    return torch.stack(rows)


def _pvalue(counts: torch.Tensor, law: torch.Tensor) -> float:
    expected = law * counts.sum()
    return float(chisquare(counts.numpy(), expected.numpy()).pvalue)


POLICIES = {
    "typical": lambda: TypicalPolicy(),
    "nkl": lambda: NKLPolicy(),
    "block": lambda: BlockPolicy(1),
    "semantic": lambda: SemanticPolicy(),  # never consulted: every node is flagged
}


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_zero_leniency_is_the_target_distribution(name):
    policy, tree = POLICIES[name](), _tree()
    logits, flagged = _logits(tree), frozenset(range(len(tree)))
    gen = torch.Generator().manual_seed(1234)
    first = torch.zeros(V, dtype=torch.float64)
    second = torch.zeros(V, dtype=torch.float64)
    for _ in range(12000):
        verdict = policy.verify(tree, logits, SAMPLING, gen, flagged)
        assert verdict.lenient == 0
        emitted = [tree.tokens[n] for n in verdict.accepted] + [verdict.next_token]
        first[emitted[0]] += 1
        if verdict.accepted[:1] == [0]:  # token 1 came through its node: the next follows AFTER_A
            second[emitted[1]] += 1
    assert _pvalue(first, ROOT) > 1e-3, first / first.sum()
    assert _pvalue(second, AFTER_A) > 1e-3, second / second.sum()


def test_two_children_at_one_half():
    """The issue's case: two children at p = 0.5 come out 0.5 / 0.5 (they were 0.625 / 0.375)."""
    tree = TokenTree()
    tree.add(-1, 0, "x")
    tree.add(-1, 1, "y")
    logits = torch.tensor([[0.5, 0.5], [0.5, 0.5], [0.5, 0.5]], dtype=torch.float64).log()
    gen = torch.Generator().manual_seed(7)
    counts = torch.zeros(2, dtype=torch.float64)
    for _ in range(8000):
        verdict = TypicalPolicy().verify(tree, logits, SAMPLING, gen, frozenset({0, 1}))
        counts[([tree.tokens[n] for n in verdict.accepted] + [verdict.next_token])[0]] += 1
    assert _pvalue(counts, torch.tensor([0.5, 0.5], dtype=torch.float64)) > 1e-3, counts / counts.sum()
