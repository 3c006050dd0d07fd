"""Exact acceptance: which path of the tree the target model agrees with.

``logits`` has one row per forward position: row 0 is the root (the pending token), row
i + 1 is tree node i. Both rules return the accepted node path and the next token (the
bonus after a full match, or the correction after a mismatch), so every step emits at
least one token, exactly as plain decoding would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftmesh.io_struct import SamplingParams
from draftmesh.sampling import KeyedDraws, greedy_tokens, sample, target_probs
from draftmesh.tree import TokenTree


@dataclass(frozen=True)
class Verdict:
    accepted: list[int]
    """Tree node indices of the accepted path, root's child first."""
    next_token: int
    lenient: int = 0
    """How many accepted tokens a lossy policy let through that exact rules would not."""


def verify_greedy(tree: TokenTree, logits: torch.Tensor) -> Verdict:
    """Follow the children equal to the target argmax; identical to plain greedy decoding."""
    argmax = greedy_tokens(logits)
    node, accepted = -1, []
    while True:
        want = argmax[node + 1]
        nxt = next((c for c in tree.children(node) if tree.tokens[c] == want), None)
        if nxt is None:
            return Verdict(accepted, want)
        accepted.append(nxt)
        node = nxt


def verify_keyed(tree: TokenTree, logits: torch.Tensor, params: SamplingParams, draws: KeyedDraws) -> Verdict:
    """Seeded sampling: follow the children equal to the keyed draw of their position.

    Like greedy with the argmax of ``log p + G_position`` instead of ``log p``: the emitted
    tokens are exactly the ones plain decoding with the same ``KeyedDraws`` would draw, so a
    seeded request's output never depends on the tree. Each token is an exact draw from p
    (Gumbel-max with noise independent per position). Sampled drafts' q is not used: a draft
    is accepted with probability p(x) here, less than rejection sampling's min(1, p/q) law
    would give for q-drafts (the price of reproducibility, unseeded requests keep it).
    """
    node, accepted = -1, []
    while True:
        want = draws.draw(target_probs(logits[node + 1], params), len(accepted))
        nxt = next((c for c in tree.children(node) if tree.tokens[c] == want), None)
        if nxt is None:
            return Verdict(accepted, want)
        accepted.append(nxt)
        node = nxt


def verify_sampling(
    tree: TokenTree, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> Verdict:
    """Multi-draft rejection sampling; the output is distributed exactly as the target's.

    At each node: first every q-draw among the children, in draw order, is accepted with
    probability min(1, p(x)/q(x)), else p <- normalize(max(p - q, 0)); then every child is
    tried as a deterministic draft, accepted with probability p(x), else p(x) <- 0 and p
    is renormalized. With nothing accepted, the next token is sampled from what is left.
    """
    node, accepted = -1, []
    while True:
        p = target_probs(logits[node + 1], params)
        children = tree.children(node)
        chosen = _choose_child(tree, children, p, generator) if children else None
        if isinstance(chosen, int):
            accepted.append(chosen)
            node = chosen
            continue
        residual = p if chosen is None else chosen
        return Verdict(accepted, sample(residual, generator))


def _choose_child(
    tree: TokenTree, children: list[int], p: torch.Tensor, generator: torch.Generator
) -> int | torch.Tensor:
    """Return the accepted child, or the residual distribution when all are rejected."""
    draws = sorted(((d.order, c, d.dist) for c in children for d in tree.qdraws[c]), key=lambda x: x[0])
    for _, child, q in draws:
        x = tree.tokens[child]
        q = q.to(torch.float64)
        qx = float(q[x])
        if qx <= 0.0:
            raise ValueError(f"draft distribution gives its own sampled token {x} probability 0")
        if _uniform(generator) * qx < float(p[x]):
            return child
        residual = torch.clamp(p - q / q.sum(), min=0.0)
        total = float(residual.sum())
        if total > 0.0:
            p = residual / total
    for child in children:
        x = tree.tokens[child]
        px = float(p[x])
        if px <= 0.0:
            continue
        if _uniform(generator) < px:
            return child
        p = p.clone()
        p[x] = 0.0
        p = p / p.sum()
    return p


def _uniform(generator: torch.Generator) -> float:
    return float(torch.rand((), dtype=torch.float64, generator=generator))
