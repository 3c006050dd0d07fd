"""The decode loop a verifier runs for one request.

prefill, then repeat {ask the sources, build the tree, one forward over it, accept,
commit the KV of the accepted path, emit} until EOS, a stop string or the token budget.
With no sources (or speculation off) the same loop is plain autoregressive decoding,
the baseline every speed figure is compared with.

Without a builder the loop uses the engine's cost-aware one, sized by the target's cost
curve; any builder without an aligner gets the target tokenizer's, so text proposals
(``rules``) always reach the tree. ``draftmesh.verify.engine`` assembles a decoder from
config.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator, Mapping, Sequence

from opentelemetry import trace

from draftmesh import tracing
from draftmesh.backend import KVState, TorchTarget
from draftmesh.draft.base import (
    MAX_PROPOSALS_PER_SOURCE,
    DraftContext,
    DraftSource,
    LearningSource,
    Proposal,
    bounded,
    sliced,
)
from draftmesh.io_struct import FinishReason, GenerationRequest, GenerationResult, StepEvent, StepRecord
from draftmesh.tree import TokenTree
from draftmesh.verify.policy import AcceptancePolicy, make_policy
from draftmesh.verify.session_kv import SessionKVPool
from draftmesh.verify.source_caller import SourceCaller
from draftmesh.verify.text_stream import TextStream
from draftmesh.verify.tree_builder import CostAwareTreeBuilder, TreeBuilder, default_aligner

log = logging.getLogger(__name__)

TEXT_TAIL_TOKENS = 48


FlagProvider = Callable[[DraftContext, TokenTree], frozenset[int]]
"""Returns the tree nodes inside spans flagged by the fact-check service."""


class SpeculativeDecoder:
    def __init__(
        self,
        target: TorchTarget,
        sources: Sequence[DraftSource] = (),
        builder: TreeBuilder | None = None,
        flag_provider: FlagProvider | None = None,
        source_deadline_s: float | None = None,
        kv_pool: SessionKVPool | None = None,
        trace_steps: int = 256,
    ) -> None:
        self.target = target
        self.sources = list(sources)
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            raise ValueError(f"draft source names must be unique, got {names}")
        if builder is None:
            builder = CostAwareTreeBuilder(target.cost_curve or {1: 1.0})
        if builder.aligner is None:
            builder.aligner = default_aligner(target.tokenizer)
        self.builder = builder
        self.flag_provider = flag_provider
        self.caller = SourceCaller(source_deadline_s)
        self.kv_pool = kv_pool
        self.trace_steps = trace_steps
        """Steps of a request traced with their own spans (draft, sources, verify); later ones are not."""
        self._tracer = tracing.tracer("draftmesh.verify")
        self._flag_pool: ThreadPoolExecutor | None = None

    # ------------------------------------------------------------------ validation
    def validate(self, req: GenerationRequest) -> AcceptancePolicy:
        """Raise ValueError naming what only the model and this decoder know (context, vocabulary,
        sources, the policy's parameters); return the request's acceptance policy. What a field may
        hold at all is checked when the request's parameters are built (``draftmesh.io_struct``)."""
        ctx = self.target.max_context
        if len(req.prompt_ids) == 0:
            raise ValueError("prompt is empty")
        if len(req.prompt_ids) >= ctx:
            raise ValueError(f"prompt has {len(req.prompt_ids)} tokens; the model context is {ctx}")
        if not isinstance(req.max_new_tokens, int) or req.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {req.max_new_tokens!r}")
        if len(req.prompt_ids) + req.max_new_tokens > ctx:
            raise ValueError(
                f"prompt ({len(req.prompt_ids)} tokens) + max_new_tokens ({req.max_new_tokens}) "
                f"exceeds the model context of {ctx}"
            )
        bad = [t for t in req.prompt_ids if not 0 <= t < self.target.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids outside the vocabulary: {bad[:5]}")
        if any(not isinstance(s, str) or not s for s in req.stop):
            raise ValueError("stop strings must be non-empty strings")
        spec = req.speculation
        policy = make_policy(spec.policy, spec.policy_params, tokenizer=self.target.tokenizer)
        names = [src.name for src in self.sources]
        for name in list(spec.sources or ()) + list(spec.source_caps):
            if name not in names:
                raise ValueError(
                    f"unknown draft source {name!r}; this decoder has: {', '.join(names) or 'none'}"
                )
        return policy

    # ------------------------------------------------------------------ the loop
    def generate(self, req: GenerationRequest) -> GenerationResult:
        result = None
        for event in self.stream(req):
            result = event
        assert isinstance(result, GenerationResult)
        return result

    def stream(self, req: GenerationRequest) -> Iterator[StepEvent | GenerationResult]:
        """Yield a StepEvent per step (possibly with empty text), then the GenerationResult."""
        policy = self.validate(req)
        if not req.request_id:
            req = dataclasses.replace(req, request_id=uuid.uuid4().hex)
        # The request's span is never made current across a yield (the consumer runs in this
        # thread between steps); each step's span is current only inside its step.
        span = self._tracer.start_span("decode", attributes={
            "draftmesh.request_id": req.request_id, "draftmesh.prompt_tokens": len(req.prompt_ids),
            "draftmesh.max_new_tokens": req.max_new_tokens, "draftmesh.policy": policy.name,
            "draftmesh.lossless": policy.lossless, "draftmesh.speculate": req.speculation.enabled,
            "draftmesh.sampling": "greedy" if req.sampling.greedy else "sample",
        })
        outcome = "cancelled"
        try:
            for event in self._stream(req, policy, trace.set_span_in_context(span)):
                if isinstance(event, GenerationResult):
                    result = event
                yield event
            outcome = result.finish_reason
            span.set_attributes({
                "draftmesh.tokens": len(result.token_ids), "draftmesh.steps": len(result.steps),
                "draftmesh.tokens_per_step": round(result.mean_accepted_per_step, 3),
                "draftmesh.reused_tokens": result.reused_tokens, "draftmesh.lenient_tokens": result.lenient_tokens,
                "draftmesh.first_token_ms": round(1e3 * result.first_token_s, 3),
            })
        except Exception as exc:
            outcome = "error"
            tracing.record_error(span, exc)
            raise
        finally:
            span.set_attribute("draftmesh.finish_reason", outcome)
            span.end()

    def _stream(self, req: GenerationRequest, policy: AcceptancePolicy, trace_ctx) -> Iterator[StepEvent | GenerationResult]:
        target = self.target
        t_start = time.perf_counter()
        prompt = list(req.prompt_ids)
        pool = self.kv_pool if req.session_id else None
        # The cache must never go beyond prompt[:-1]: the last prompt token is the first root.
        state, cached = pool.checkout(req.session_id, prompt[:-1]) if pool is not None else (KVState(), [])
        reused = len(cached)
        with self._tracer.start_as_current_span("prefill", context=trace_ctx) as prefill_span:
            prefill_span.set_attributes({"draftmesh.tokens": len(prompt) - 1 - reused, "draftmesh.reused_tokens": reused})
            target.prefill(state, prompt[reused:-1])
        # The ids whose KV the cache holds, tracked apart from the output: a stop-string cut
        # drops emitted tokens whose KV stays in the cache.
        cached = prompt[:-1]
        pending = prompt[-1]
        generator = None if req.sampling.greedy else req.sampling.generator()
        lenient_total = 0
        text = TextStream(target.tokenizer, req.stop)
        generated: list[int] = []
        steps: list[StepRecord] = []
        spec = req.speculation
        active = [src for src in self.sources if spec.sources is None or src.name in spec.sources]
        speculate = spec.enabled and bool(active) and spec.max_nodes != 0
        first_token_s = 0.0
        finish: FinishReason | None = None
        while finish is None:
            step_span = (self._tracer.start_span("step", context=trace_ctx)
                         if len(steps) < self.trace_steps else trace.INVALID_SPAN)
            with trace.use_span(step_span, end_on_exit=True, record_exception=True):
                remaining = req.max_new_tokens - len(generated)
                t0 = time.perf_counter()
                tree, proposed, failed, ctx = TokenTree(), {}, (), None
                if speculate and remaining > 1:
                    ctx = self._context(req, prompt, generated, size_hint=self.builder.max_nodes)
                    with self._tracer.start_as_current_span("draft") as draft_span:
                        tree, proposed, failed = self._draft(ctx, active, spec.source_caps, state.length, remaining)
                        draft_span.set_attribute("draftmesh.tree_size", len(tree))
                t1 = time.perf_counter()
                with self._tracer.start_as_current_span("verify") as verify_span:
                    base = state.length
                    # Flags only restrict lenient acceptance: the exact policy never needs them. Their
                    # lookup (a Redis round trip) runs while the target computes the tree.
                    flags = None
                    if self.flag_provider is not None and not policy.lossless and ctx is not None and len(tree):
                        flags = self._flag_thread().submit(tracing.in_context(self._flags), ctx, tree)
                    logits = target.forward_tree(state, pending, tree)
                    flagged = flags.result() if flags is not None else frozenset()
                    verdict = policy.verify(tree, logits, req.sampling, generator, flagged)
                    target.commit(state, base, [0] + [1 + a for a in verdict.accepted])
                    cached += [pending] + [tree.tokens[a] for a in verdict.accepted]
                    if verify_span.is_recording():
                        verify_span.set_attributes({"draftmesh.tree_size": len(tree), "draftmesh.accepted": len(verdict.accepted),
                                                    "draftmesh.flagged_nodes": len(flagged)})
                t2 = time.perf_counter()
                self.builder.observe(tree, verdict, ctx)

                new = [tree.tokens[a] for a in verdict.accepted] + [verdict.next_token]
                taken = 0
                for tok in new:
                    generated.append(tok)
                    taken += 1
                    if tok in target.eos_token_ids:
                        finish = "eos"
                        break
                    if len(generated) >= req.max_new_tokens:
                        finish = "length"
                        break
                delta, cut = text.update(generated, len(generated) - taken)
                if cut is not None:
                    taken -= len(generated) - cut
                    del generated[cut:]
                    finish = "stop"
                accepted_by_source: dict[str, int] = {}
                for a in verdict.accepted[: min(taken, len(verdict.accepted))]:
                    for src in tree.sources[a]:
                        accepted_by_source[src] = accepted_by_source.get(src, 0) + 1
                nodes_by_source: dict[str, int] = {}
                for srcs in tree.sources:
                    for src in srcs:
                        nodes_by_source[src] = nodes_by_source.get(src, 0) + 1
                record = StepRecord(
                    tree_size=len(tree),
                    accepted=len(verdict.accepted),
                    emitted=taken,
                    draft_s=t1 - t0,
                    verify_s=t2 - t1,
                    proposed_by_source=proposed,
                    nodes_by_source=nodes_by_source,
                    accepted_by_source=accepted_by_source,
                    failed_sources=failed,
                    lenient=min(verdict.lenient, taken),
                )
                lenient_total += record.lenient
                steps.append(record)
                if not first_token_s:
                    first_token_s = time.perf_counter() - t_start
                if step_span.is_recording():
                    _describe_step(step_span, len(steps), record)
            pending = generated[-1] if generated else pending
            yield StepEvent(tuple(generated[len(generated) - taken :]), delta, record)
        # Only a request that ran to its end puts its cache back: after an exception or a
        # close (cancel) the state may be half-updated, and dropping it is always safe.
        if pool is not None:
            pool.checkin(req.session_id, cached, state)
        final_text = text.final(generated)
        result = GenerationResult(
            token_ids=tuple(generated),
            text=final_text,
            finish_reason=finish,
            prompt_tokens=len(prompt),
            steps=tuple(steps),
            seconds=time.perf_counter() - t_start,
            first_token_s=first_token_s,
            policy=policy.name,
            lossless=policy.lossless,
            lenient_tokens=lenient_total,
            reused_tokens=reused,
        )
        self.builder.finish(req.request_id)
        self._finish_sources(req, prompt, generated, final_text)
        yield result

    def _context(self, req: GenerationRequest, prompt: list[int], generated: list[int], size_hint: int) -> DraftContext:
        if req.speculation.max_nodes is not None:
            size_hint = min(size_hint, req.speculation.max_nodes)
        ids = tuple(prompt + generated)
        tail = self.target.tokenizer.decode(ids[-TEXT_TAIL_TOKENS:], skip_special_tokens=False)
        return DraftContext(
            token_ids=ids,
            prompt_len=len(prompt),
            text_tail=tail,
            documents=req.documents,
            session_id=req.session_id,
            request_id=req.request_id,
            size_hint=size_hint,
            options=self._options(req),
        )

    @staticmethod
    def _options(req: GenerationRequest) -> dict[str, Any]:
        """What sources may adapt to: sampling sources draw at the request's temperature."""
        options: dict[str, Any] = {
            "temperature": req.sampling.temperature,
            "top_p": req.sampling.top_p,
            "top_k": req.sampling.top_k,
        }
        if req.speculation.max_nodes is not None:
            options["max_nodes"] = req.speculation.max_nodes
        return options

    def _draft(
        self,
        ctx: DraftContext,
        sources: Sequence[DraftSource],
        caps: Mapping[str, int],
        cache_len: int,
        remaining: int,
    ) -> tuple[TokenTree, dict[str, int], tuple[str, ...]]:
        proposals: list[Proposal] = []
        proposed: dict[str, int] = {}
        answers = self.caller.call(sources, ctx)
        failed = list(answers.failed)
        for source in sources:
            if source.name not in answers.proposals:
                continue
            # Cut to what this step's tree can hold before anything looks at them: a source
            # (an external one above all) may send any number of proposals of any length.
            got = [bounded(p, ctx.size_hint) for p in answers.proposals[source.name][:MAX_PROPOSALS_PER_SOURCE]]
            valid = [p for p in got if self._usable(p)]
            if len(valid) < len(got):
                log.warning("draft source %s proposed tokens outside the vocabulary; dropped", source.name)
                failed.append(source.name)
            if source.name in caps:
                valid = _capped(valid, caps[source.name])
            proposals.extend(valid)
            proposed[source.name] = proposed.get(source.name, 0) + len(valid)
        try:
            tree = self.builder.build(proposals, ctx)
        except Exception:  # a bad draft must only cost speed: this step decodes one token
            log.exception("tree builder failed on %d proposals from %s; this step drafts nothing",
                          len(proposals), ", ".join(sorted(proposed)) or "no source")
            tree = TokenTree()
            failed.extend(sorted(proposed))
        # The bonus token always comes on top, and positions must stay inside the context.
        max_depth = min(remaining - 1, self.target.max_context - cache_len - 2)
        tree = tree.truncate_depth(max_depth)
        tree.validate(self.target.vocab_size)
        return tree, proposed, tuple(failed)

    def close(self) -> None:
        """Release the threads that ask sources and look up flags (a decoder being replaced)."""
        self.caller.close()
        if self._flag_pool is not None:
            self._flag_pool.shutdown(wait=False)

    def _flag_thread(self) -> ThreadPoolExecutor:
        if self._flag_pool is None:
            self._flag_pool = ThreadPoolExecutor(1, thread_name_prefix="draftmesh-flags")
        return self._flag_pool

    def _flags(self, ctx: DraftContext, tree: TokenTree) -> frozenset[int]:
        try:
            return frozenset(self.flag_provider(ctx, tree))
        except Exception:  # no annotations: lossy policies then accept nothing leniently
            log.exception("flag provider failed; treating every node as flagged")
            return frozenset(range(len(tree)))

    def _usable(self, proposal: Proposal) -> bool:
        if proposal.token_ids is None:
            return True
        vocab = self.target.vocab_size
        if not all(0 <= t < vocab for t in proposal.token_ids):
            return False
        dists = proposal.token_dists
        return dists is None or (dists.dim() == 2 and dists.shape[1] == vocab)

    def _finish_sources(self, req: GenerationRequest, prompt: list[int], generated: list[int], text: str) -> None:
        learners = [s for s in self.sources if isinstance(s, LearningSource)]
        if not learners:
            return
        ctx = self._context(req, prompt, [], size_hint=0)
        for source in learners:
            try:
                source.finish(ctx, list(generated), text)
            except Exception:
                log.exception("draft source %s failed to record a finished request", source.name)


def _describe_step(span: trace.Span, number: int, record: StepRecord) -> None:
    span.set_attributes({
        "draftmesh.step": number, "draftmesh.tree_size": record.tree_size, "draftmesh.accepted": record.accepted,
        "draftmesh.emitted": record.emitted, "draftmesh.draft_ms": round(1e3 * record.draft_s, 3),
        "draftmesh.verify_ms": round(1e3 * record.verify_s, 3), "draftmesh.lenient": record.lenient,
    })
    tracing.set_attributes(span, "draftmesh.proposed", record.proposed_by_source)
    tracing.set_attributes(span, "draftmesh.nodes", record.nodes_by_source)
    tracing.set_attributes(span, "draftmesh.accepted_by", record.accepted_by_source)
    if record.failed_sources:
        span.set_attribute("draftmesh.failed_sources", list(record.failed_sources))


def _capped(proposals: list[Proposal], budget: int) -> list[Proposal]:
    """Keep a source's most confident proposals within ``budget`` drafted tokens."""
    out = []
    for p in sorted(proposals, key=lambda p: -p.confidence):
        n = len(p.token_ids) if p.token_ids is not None else 1
        if n > budget:
            if p.token_ids is not None and budget > 0:
                out.append(sliced(p, 0, budget))
            break
        out.append(p)
        budget -= n
    return out
