"""The draft-source contract: what every source receives and what it returns.

Sources never see the target model. They get the committed token ids (and text for
sources that think in text) and return proposals; the tree builder merges them and
the verifier decides. A source can therefore be wrong as often as it likes without
changing the output, only the speed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

import torch


@dataclass(frozen=True)
class DraftContext:
    """Everything a source may use to guess the next tokens of one request."""

    token_ids: Sequence[int]
    """Committed target tokens: prompt then generated, the last one not yet verified-from."""
    prompt_len: int
    text_tail: str = ""
    """Decoded text of the last committed tokens, for text-based sources."""
    documents: Sequence[str] = ()
    session_id: str | None = None
    request_id: str = ""
    size_hint: int = 16
    """Roughly how many tree nodes the builder can afford this step."""
    options: Mapping[str, Any] = field(default_factory=dict)
    prepared: Mapping[str, Any] = field(default_factory=dict)
    """Source name -> what its ``prepare`` returned for this request (``PreparingSource``)."""
    tenant: str = "default"
    """Whose answers a source stores this request's output under (``draftmesh.tenancy``)."""
    answer_tenants: tuple[str, ...] = ("default",)
    """Whose stored answers the request may draft from: its own tenant first, then those sharing
    with it, these only for a lossless request (a lossy one never drafts another tenant's data)."""
    store_answer: bool = True
    """False for a lossy request: its output is not the target's, so it never becomes an answer
    others draft from (it still joins its own session's turns)."""

    @property
    def generated_ids(self) -> Sequence[int]:
        return self.token_ids[self.prompt_len :]


@dataclass(frozen=True)
class Proposal:
    """One drafted continuation of the committed tokens.

    Exactly one of ``token_ids`` (a source sharing the target tokenizer) or ``text``
    (any tokenizer; aligned to target tokens by the builder) is set.

    ``token_dists`` may only be given when token i was *sampled* from row i
    (conditioned on tokens < i); rejection sampling then uses the residual rule.
    Anything else (argmax, top-k, n-gram, retrieval) is a deterministic draft.
    """

    source: str
    token_ids: tuple[int, ...] | None = None
    text: str | None = None
    token_probs: tuple[float, ...] | None = None
    """The draft's own probability for each drafted token (a score, not a sampling law)."""
    token_dists: torch.Tensor | None = None
    confidence: float = 1.0
    """How much the source believes the proposal, in [0, 1]; the builder calibrates it."""
    text_complete: bool = False
    """For text proposals: the text ends where a unit ends (a whole name, a closer), so
    its last token is as safe to draft as the others."""

    def __post_init__(self) -> None:
        if (self.token_ids is None) == (self.text is None):
            raise ValueError(f"proposal from {self.source!r}: give exactly one of token_ids or text")
        if self.token_ids is not None:
            n = len(self.token_ids)
            if self.token_probs is not None and len(self.token_probs) != n:
                raise ValueError(f"proposal from {self.source!r}: token_probs length {len(self.token_probs)} != {n}")
            if self.token_dists is not None and self.token_dists.shape[0] != n:
                raise ValueError(
                    f"proposal from {self.source!r}: token_dists rows {self.token_dists.shape[0]} != {n}"
                )
        elif self.token_dists is not None:
            raise ValueError(f"proposal from {self.source!r}: token_dists need token_ids")
        if not self.confidence >= 0.0:
            raise ValueError(f"proposal from {self.source!r}: confidence must be >= 0")


def sliced(proposal: Proposal, start: int = 0, stop: int | None = None) -> Proposal:
    """Drafted tokens [start:stop] of a token proposal, with their probabilities and
    distributions (row i of ``token_dists`` stays the law of token i)."""
    part = slice(start, stop)
    return dataclasses.replace(
        proposal,
        token_ids=proposal.token_ids[part],
        token_probs=proposal.token_probs[part] if proposal.token_probs is not None else None,
        token_dists=proposal.token_dists[part] if proposal.token_dists is not None else None,
    )


def path_proposals(source: str, nodes: Sequence[tuple[int, int, float]]) -> list[Proposal]:
    """A drafted tree as proposals, one per root-to-leaf path, the most probable first (ties: the
    older leaf). ``nodes``: (parent index or -1, token, probability given the parent) per node,
    parents before children; a path's ``token_probs`` are its nodes' probabilities and its
    ``confidence`` their product, in path order."""
    has_child = [False] * len(nodes)
    for parent, _, _ in nodes:
        if parent >= 0:
            has_child[parent] = True
    out = []
    for leaf in (i for i in range(len(nodes)) if not has_child[i]):
        path = []
        node = leaf
        while node >= 0:
            path.append(node)
            node = nodes[node][0]
        path.reverse()
        probs = tuple(nodes[i][2] for i in path)
        confidence = 1.0
        for prob in probs:
            confidence *= prob
        out.append(Proposal(source, token_ids=tuple(nodes[i][1] for i in path), token_probs=probs,
                            confidence=confidence))
    out.sort(key=lambda p: -p.confidence)  # stable: equal confidences keep the older leaf first
    return out


TEXT_CHARS_PER_NODE = 32
"""Characters of a text proposal kept per tree node it could fill: no target token is longer in
practice, and text beyond what the tree can hold would only cost alignment time."""

MAX_PROPOSALS_PER_SOURCE = 64
"""Proposals of one source a step looks at (a source's best ones first, as it orders them)."""


def unit(x: float) -> float:
    """``x`` clamped to [0, 1]; NaN is 0 (a source's scores are hints, never trusted as given)."""
    return min(1.0, max(0.0, x)) if x == x else 0.0


def bounded(proposal: Proposal, max_nodes: int) -> Proposal:
    """The proposal cut to what a tree of ``max_nodes`` nodes can use (its first ``max_nodes``
    tokens, or ``TEXT_CHARS_PER_NODE`` characters a node of text), its confidence and token
    probabilities in [0, 1]: whatever a source sends, a step's work stays bounded by the tree."""
    max_nodes = max(0, max_nodes)
    out = proposal
    if out.token_ids is not None and len(out.token_ids) > max_nodes:
        out = sliced(out, 0, max_nodes)
    if out.text is not None and len(out.text) > max_nodes * TEXT_CHARS_PER_NODE:
        out = dataclasses.replace(out, text=out.text[: max_nodes * TEXT_CHARS_PER_NODE], text_complete=False)
    probs = out.token_probs
    if probs is not None and not all(0.0 <= p <= 1.0 for p in probs):
        out = dataclasses.replace(out, token_probs=tuple(unit(float(p)) for p in probs))
    if not 0.0 <= out.confidence <= 1.0:
        out = dataclasses.replace(out, confidence=unit(out.confidence))
    return out


def advance(proposal: Proposal, committed: Sequence[int]) -> Proposal | None:
    """The same draft after ``committed`` tokens were accepted since it was made, or None.

    A late answer (a remote source that missed a step's deadline) stays useful when the
    tokens committed meanwhile are the start of its draft: what remains drafts the next
    step. Text drafts are dropped (their alignment was to the old context).
    """
    ids = proposal.token_ids
    n = len(committed)
    if ids is None or len(ids) <= n or tuple(ids[:n]) != tuple(committed):
        return None
    return sliced(proposal, n)


@runtime_checkable
class DraftSource(Protocol):
    """A source of drafts. ``propose`` must be cheap or be hosted remotely with a deadline.

    A source whose ``propose`` runs a torch model (the llm source) says so with a class attribute
    ``compute_bound = True``: it is then called on the process's compute thread (``propose_on_compute``),
    between the target's forwards, never on a worker thread beside them."""

    name: str

    def propose(self, ctx: DraftContext) -> list[Proposal]: ...


def compute_bound(source: Any) -> bool:
    return bool(getattr(source, "compute_bound", False))


def runs_inline(source: Any) -> bool:
    """Called on the step's own thread rather than the sources' pool: a compute-bound source (see
    ``propose_on_compute``), or one that says its ``propose`` is a bounded in-memory lookup
    (``inline = True``: a few hundred microseconds at most, less than the pool's hand-off)."""
    return compute_bound(source) or bool(getattr(source, "inline", False))


def propose_on_compute(source: Any, ctx: DraftContext) -> list[Proposal]:
    """``source.propose(ctx)``, on the compute thread when the source is compute-bound.

    Why: torch on a worker thread starts an OpenMP team beside the compute thread's; while both
    compute they share 2 cores badly (a one-token target forward 24 -> 53 ms beside an in-process
    llm source's model on the sources' pool, 2-core box), and once the worker's team exists every
    later forward is slower too (24 -> 36 ms). On the compute thread, drafting and verifying take
    turns at the full width, as a draft model and its target do in plain speculative decoding."""
    if not compute_bound(source):
        return source.propose(ctx)
    from draftmesh import compute  # lazy: the contract itself needs no threads

    return compute.run(source.propose, ctx)


@runtime_checkable
class LearningSource(DraftSource, Protocol):
    """A source that remembers finished requests (answer stores, session history)."""

    def finish(self, ctx: DraftContext, output_ids: Sequence[int], output_text: str) -> None: ...


@runtime_checkable
class PreparingSource(DraftSource, Protocol):
    """A source with per-request work too large for a step (rag's document index).

    ``prepare`` runs once when the request is submitted, on the caller's thread, outside
    every batched step; what it returns reaches each step as ``ctx.prepared[name]`` and is
    handed to ``release`` when the request ends (finished, failed or cancelled), so the
    source can account for and free it. ``prepare`` may return None (nothing to keep)."""

    def prepare(self, ctx: DraftContext) -> Any: ...

    def release(self, state: Any) -> None: ...


@runtime_checkable
class SuccessorObserver(DraftSource, Protocol):
    """A source fed by the verifier with the target's own predictions (``recycle``): after every
    decode step, the top-``top_k`` successors of the step's root and accepted nodes (the inputs whose
    context was committed) and their probabilities, for the request's tenant. The verifier computes
    them only when such a source is in-process, so it cannot run remotely."""

    top_k: int

    def observe_successors(self, tenant: str, inputs: Sequence[int], ids: Any, probs: Any) -> None: ...


@runtime_checkable
class RequestScopedSource(DraftSource, Protocol):
    """A source that keeps state per ``ctx.request_id`` between steps (history's indexes, llm's
    draft KV). ``forget`` is called when the request ends however it ends (finished, failed,
    cancelled), from inside the batched step: it must be quick and must never wait for a
    ``propose`` in progress."""

    def forget(self, request_id: str) -> None: ...
