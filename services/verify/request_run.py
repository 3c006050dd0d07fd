"""One request's decode state inside the batch: its row of the KV slab, its prompt still to
prefill, its sampling RNG, text stream and step records.

The scheduler drives it in phases each step: ``row_input`` (a prefill chunk, or the pending
root and this step's tree), then ``complete`` with the row's logits: accept under the
request's own policy, commit the accepted path's KV, emit tokens, stop on EOS / stop string
/ length. Drafting is the decoder's (``SpeculativeDecoder.draft_candidates``); which nodes
are verified is the batch budget's.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
from opentelemetry import trace

from draftmesh.batch_kv import RowInput, SlotKVCache
from draftmesh.io_struct import FinishReason, GenerationRequest, GenerationResult, StepEvent, StepRecord
from draftmesh.sampling import KeyedDraws
from draftmesh.tree import TokenTree
from draftmesh.verify.acceptance import Verdict
from draftmesh.verify.policy import AcceptancePolicy
from draftmesh.verify.text_stream import TextStream

log = logging.getLogger(__name__)


@dataclass
class StepPlan:
    """What a request brings to one step."""

    chunk: list[int]
    """Prompt tokens to prefill first (possibly empty)."""
    decode: bool
    """Whether the pending root follows (the step emits tokens for this request)."""
    tree: TokenTree = field(default_factory=TokenTree)
    proposed: dict[str, int] = field(default_factory=dict)
    failed: tuple[str, ...] = ()
    ctx: Any = None
    draft_s: float = 0.0
    flags: Future | None = None
    span: trace.Span = trace.INVALID_SPAN
    draft_span: trace.Span = trace.INVALID_SPAN
    asked: Any = None
    """The source calls started for this step (``SourceCaller.submit``), until collected."""
    may_rest: bool = False
    """Whether a dry answer this step counts towards resting the request's sources."""


class RequestRun:
    def __init__(self, req: GenerationRequest, policy: AcceptancePolicy, tokenizer, eos_ids, span: trace.Span) -> None:
        self.req = req
        self.policy = policy
        self.span = span
        self.t_start = time.perf_counter()
        self.prompt = list(req.prompt_ids)
        self.row: int | None = None
        self.cached: list[int] = []
        """Ids whose KV the row holds (a stop-string cut drops emitted tokens whose KV stays)."""
        self.reused = 0
        self.pending = self.prompt[-1]
        self.generator = _generator(req, policy)
        self.text = TextStream(tokenizer, req.stop)
        self.eos_ids = eos_ids
        self.generated: list[int] = []
        self.steps: list[StepRecord] = []
        self.lenient_total = 0
        self.first_token_s = 0.0
        self.finish: FinishReason | None = None
        self.result: GenerationResult | None = None
        self.plan: StepPlan | None = None
        self.verdict: Verdict | None = None
        """The last decode step's verdict (the builder learns from it)."""
        self.prefill_span: trace.Span | None = None
        self.dry = 0
        """Steps in a row whose sources proposed nothing (``SpeculativeDecoder.candidates``)."""
        self.rest = 0
        """Steps left that decode without asking any source."""
        self.rests = 0
        """Rests since the last proposal: the next one lasts ``min(max_rest, 2 ** rests)`` steps."""
        self.asks = 0
        """Steps at which its sources were asked (``SpeculativeDecoder.ask_sources``)."""
        self.successor_k = 0
        """Top-k successors to read off each decode step's logits (0: none; ``SuccessorObserver``)."""
        self.successors: tuple[list[int], Any, Any] | None = None
        """The last decode step's (inputs, top-k ids, their probabilities) for the root and the
        accepted path, when ``successor_k``."""
        self.prepared: dict[str, Any] = {}
        """Source name -> its per-request state (``PreparingSource.prepare``), released at the end."""

    # ------------------------------------------------------------------ phases
    @property
    def remaining(self) -> int:
        """Tokens it may still generate."""
        return self.req.max_new_tokens - len(self.generated)

    @property
    def to_prefill(self) -> int:
        """Prompt tokens not yet in the cache (the last prompt token is the first root, never prefilled)."""
        return max(0, len(self.prompt) - 1 - len(self.cached))

    def attach(self, row: int, cached: list[int]) -> None:
        self.row, self.cached, self.reused = row, list(cached), len(cached)

    def row_input(self) -> RowInput:
        plan = self.plan
        assert plan is not None and self.row is not None
        tokens = list(plan.chunk)
        parents = list(range(-1, len(tokens) - 1))
        if plan.decode:
            root = len(tokens)
            tokens.append(self.pending)
            parents.append(root - 1)
            tokens.extend(plan.tree.tokens)
            parents.extend(root + 1 + p if p >= 0 else root for p in plan.tree.parents)
            return RowInput(self.row, tokens, parents, logits_from=root)
        return RowInput(self.row, tokens, parents, logits_from=len(tokens))

    def complete(self, kv: SlotKVCache, base: int, logits, verify_s: float) -> StepEvent | None:
        """Accept, commit and emit after the batch's forward; None for a pure prefill chunk."""
        plan = self.plan
        assert plan is not None and self.row is not None
        self.plan = None
        c = len(plan.chunk)
        if not plan.decode:
            kv.commit(self.row, base, range(c))
            self.cached += plan.chunk
            return None
        tree, req = plan.tree, self.req
        flagged = plan.flags.result() if plan.flags is not None else frozenset()
        draws = self.generator.at(len(self.generated)) if isinstance(self.generator, KeyedDraws) else self.generator
        verdict = self.policy.verify(tree, logits, req.sampling, draws, flagged)
        if self.successor_k:
            try:
                self.successors = _successors(self.pending, tree, verdict, logits, self.successor_k)
            except Exception:  # an opt-in source's feed: the request goes on, the source learns less
                log.exception("reading the step's successors failed for request %s", req.request_id)
                self.successors = None
        kv.commit(self.row, base, [*range(c), c, *(c + 1 + a for a in verdict.accepted)])
        self.cached += plan.chunk + [self.pending] + [tree.tokens[a] for a in verdict.accepted]
        self.verdict = verdict
        new = [tree.tokens[a] for a in verdict.accepted] + [verdict.next_token]
        taken, delta = self._emit(new)
        accepted_by_source: dict[str, int] = {}
        for a in verdict.accepted[: min(taken, len(verdict.accepted))]:
            for src in tree.sources[a]:
                accepted_by_source[src] = accepted_by_source.get(src, 0) + 1
        nodes_by_source: dict[str, int] = {}
        for srcs in tree.sources:
            for src in srcs:
                nodes_by_source[src] = nodes_by_source.get(src, 0) + 1
        record = StepRecord(
            tree_size=len(tree), accepted=len(verdict.accepted), emitted=taken, draft_s=plan.draft_s,
            verify_s=verify_s, proposed_by_source=plan.proposed, nodes_by_source=nodes_by_source,
            accepted_by_source=accepted_by_source, failed_sources=plan.failed, lenient=min(verdict.lenient, taken),
        )
        self.lenient_total += record.lenient
        self.steps.append(record)
        if not self.first_token_s:
            self.first_token_s = time.perf_counter() - self.t_start
        if self.generated:
            self.pending = self.generated[-1]
        return StepEvent(tuple(self.generated[len(self.generated) - taken :]), delta, record)

    def _emit(self, new: list[int]) -> tuple[int, str]:
        """Append the step's tokens one at a time, as plain decoding would, ending at the first
        EOS, stop string or the length limit; return (tokens taken, text delta). The delta of the
        last step includes everything the text stream held back."""
        stream, delta, taken = self.text, "", 0
        for tok in new:
            self.generated.append(tok)
            taken += 1
            if tok in self.eos_ids:
                self.finish = "eos"
                break
            if stream.stop:
                piece, hit = stream.push(self.generated)
                delta += piece
                if hit:
                    self.finish = "stop"
                    break
            if len(self.generated) >= self.req.max_new_tokens:
                self.finish = "length"
                break
        if not stream.stop:
            delta = stream.update(self.generated)
        if self.finish is not None:
            delta += stream.flush(self.generated)
        return taken, delta

    def final_result(self) -> GenerationResult:
        assert self.finish is not None
        self.result = GenerationResult(
            token_ids=tuple(self.generated),
            text=self.text.final(self.generated),
            finish_reason=self.finish,
            prompt_tokens=len(self.prompt),
            steps=tuple(self.steps),
            seconds=time.perf_counter() - self.t_start,
            first_token_s=self.first_token_s,
            policy=self.policy.name,
            lossless=self.policy.lossless,
            lenient_tokens=self.lenient_total,
            reused_tokens=self.reused,
        )
        return self.result


def _generator(req: GenerationRequest, policy: AcceptancePolicy):
    """The request's randomness: none for greedy; for a seeded request under a policy that
    supports it, draws keyed by output position (reproducible whatever the trees); else a
    torch generator (seeded or from the OS) consumed as the verdicts need."""
    sampling = req.sampling
    if sampling.greedy:
        return None
    if sampling.seed is not None and getattr(policy, "keyed_draws", False):
        return KeyedDraws(sampling.seed)
    return sampling.generator()


def _successors(root: int, tree: TokenTree, verdict: Verdict, logits, k: int) -> tuple[list[int], Any, Any]:
    """The target's top-``k`` next tokens, with their probabilities, after the root (row 0) and
    each accepted node (row 1 + i): the inputs whose context is the committed one. Rejected
    nodes' rows are left out: read in a context that did not happen, and each costs ~90 us of
    top-k and log-sum-exp over the vocabulary (SmolLM2's 49k, 2 CPU threads)."""
    order = [0, *(1 + a for a in verdict.accepted)]
    with torch.no_grad():
        rows = logits[order] if len(order) < logits.shape[0] else logits
        top = torch.topk(rows, min(k, rows.shape[-1]), dim=-1)
        probs = torch.exp(top.values - torch.logsumexp(rows, dim=-1, keepdim=True))
    return [root, *(tree.tokens[a] for a in verdict.accepted)], top.indices.cpu().numpy(), probs.cpu().numpy()
