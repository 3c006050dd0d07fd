"""Acceptance policies: how a verdict is reached from the one verify forward pass.

``exact`` (the default) is lossless: greedy match or rejection sampling. Lossy policies
are explicit per-request opt-ins; every result says whether it was lossless and how many
tokens were accepted leniently. Nodes in ``flagged`` (spans the fact-check service has
flagged) may only be accepted by the exact rule, whatever the policy.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol

import torch

from draftmesh.io_struct import SamplingParams
from draftmesh.tree import TokenTree
from draftmesh.sampling import KeyedDraws
from draftmesh.verify.acceptance import Verdict, verify_greedy, verify_keyed, verify_sampling
from draftmesh.verify.lossy import BlockPolicy, NKLPolicy, SemanticPolicy, TypicalPolicy


class AcceptancePolicy(Protocol):
    name: str
    lossless: bool

    def verify(
        self,
        tree: TokenTree,
        logits: torch.Tensor,
        sampling: SamplingParams,
        generator: torch.Generator | KeyedDraws | None,
        flagged: frozenset[int] = frozenset(),
    ) -> Verdict: ...


class ExactPolicy:
    """Lossless: greedy output identical to plain greedy; sampling exactly the target's law.

    A seeded request draws through ``KeyedDraws`` (its output is independent of the tree); an
    unseeded one keeps multi-draft rejection sampling, which accepts q-drafts more often."""

    name = "exact"
    lossless = True
    keyed_draws = True
    """Seeded requests get a ``KeyedDraws`` as their generator (lossy policies get a torch.Generator)."""

    def verify(self, tree, logits, sampling, generator, flagged=frozenset()) -> Verdict:
        if sampling.greedy:
            return verify_greedy(tree, logits)
        assert generator is not None
        if isinstance(generator, KeyedDraws):
            return verify_keyed(tree, logits, sampling, generator)
        return verify_sampling(tree, logits, sampling, generator)


PolicyFactory = Callable[..., AcceptancePolicy]
POLICIES: dict[str, PolicyFactory] = {
    "exact": ExactPolicy,
    "typical": TypicalPolicy,
    "nkl": NKLPolicy,
    "block": BlockPolicy,
    "semantic": SemanticPolicy,
}
"""Policies by name: ``exact`` (lossless) and the lossy opt-ins of ``draftmesh.verify.lossy``."""


def register(name: str, factory: PolicyFactory) -> None:
    POLICIES[name] = factory


def make_policy(
    name: str = "exact", params: Mapping[str, Any] | None = None, *, tokenizer: Any = None
) -> AcceptancePolicy:
    """Build a policy by name; unknown names and bad parameters are ValueErrors.

    ``tokenizer`` (the target's) is handed to factories that declare ``needs_tokenizer``;
    request params cannot override it.
    """
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown acceptance policy {name!r}; available: {', '.join(sorted(POLICIES))}") from None
    kwargs = dict(params or {})
    if getattr(factory, "needs_tokenizer", False) and tokenizer is not None:
        kwargs["tokenizer"] = tokenizer
    try:
        return factory(**kwargs)
    except TypeError as exc:
        raise ValueError(f"bad parameters for acceptance policy {name!r}: {exc}") from None


def available_policies() -> list[str]:
    return sorted(POLICIES)
