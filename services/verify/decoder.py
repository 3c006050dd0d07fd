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
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator, Mapping, Sequence

from opentelemetry import trace

from draftmesh import tracing
from draftmesh.backend import TorchTarget
from draftmesh.config import BuilderConfig
from draftmesh.draft.base import (
    MAX_PROPOSALS_PER_SOURCE,
    DraftContext,
    DraftSource,
    LearningSource,
    PreparingSource,
    Proposal,
    RequestScopedSource,
    SuccessorObserver,
    bounded,
    sliced,
)
from draftmesh.io_struct import GenerationRequest, GenerationResult, InvalidField, StepEvent, StepRecord
from draftmesh.tree import TokenTree
from draftmesh.verify.policy import AcceptancePolicy, make_policy
from draftmesh.verify.request_run import RequestRun, StepPlan
from draftmesh.verify.scheduler import BatchLimits, BatchScheduler, Ticket
from draftmesh.verify.prefix_kv import PrefixKVPool
from draftmesh.verify.source_caller import SourceAnswers, SourceCaller
from draftmesh.verify.tree_builder import CostAwareTreeBuilder, ScoredTree, TreeBuilder, default_aligner

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
        kv_pool: PrefixKVPool | None = None,
        trace_steps: int = 256,
        batch_limits: BatchLimits | None = None,
        batch_observer: Any = None,
        max_document_tokens: int | None = None,
        rest_after: int = BuilderConfig.rest_after,
        max_rest: int = BuilderConfig.max_rest,
        rest_min_rows: int = BuilderConfig.rest_min_rows,
        asking_probe_every: int = BuilderConfig.asking_probe_every,
    ) -> None:
        if rest_after < 0 or max_rest < 1 or rest_min_rows < 1 or asking_probe_every < 0:
            raise ValueError(f"need rest_after >= 0, max_rest >= 1, rest_min_rows >= 1 and asking_probe_every >= 0, "
                             f"got {rest_after}, {max_rest}, {rest_min_rows}, {asking_probe_every}")
        self.target = target
        self.rest_after = rest_after
        """Dry steps before a request rests its sources (0: never rest; see ``ask_sources``)."""
        self.max_rest = max_rest
        """The longest rest, in steps (rests grow 1, 2, 4, ... up to it, one probe between two)."""
        self.rest_min_rows = rest_min_rows
        """Requests in a step's batch from which they rest: a smaller batch asks at every step."""
        self.asking_probe_every = asking_probe_every
        """Where asking has not paid at the batch's size lately (``AskingValue``), one step in this many
        asks; where it has, one in twice this many asks nobody (0: every step asks, as the rests allow)."""
        self.max_document_tokens = max_document_tokens
        """Target tokens of all of a request's documents together (``limits.max_document_tokens``)."""
        self._documents_ok: Sequence[str] | None = None
        self.sources = list(sources)
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            raise ValueError(f"draft source names must be unique, got {names}")
        self._successor_sources = [s for s in self.sources if isinstance(s, SuccessorObserver)]
        self.successor_k = max((s.top_k for s in self._successor_sources), default=0)
        """Top-k successors each decode step reads off its logits for them (0: no such source)."""
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
        self.batch_limits = batch_limits
        self.batch_observer = batch_observer
        self._scheduler: BatchScheduler | None = None
        self._scheduler_lock = threading.Lock()

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
        self._check_documents(req.documents)
        spec = req.speculation
        policy = make_policy(spec.policy, spec.policy_params, tokenizer=self.target.tokenizer)
        names = [src.name for src in self.sources]
        for name in list(spec.sources or ()) + list(spec.source_caps):
            if name not in names:
                raise ValueError(
                    f"unknown draft source {name!r}; this decoder has: {', '.join(names) or 'none'}"
                )
        return policy

    def _check_documents(self, documents: Sequence[str]) -> None:
        """Documents are indexed token by token (rag: ~0.8 KB of index per token), so their
        size is capped in tokens. Encoding is skipped when the UTF-8 size alone shows the cap
        cannot be reached (a byte-level tokenizer makes at most one token per byte, plus one
        for a leading marker)."""
        cap = self.max_document_tokens
        if cap is None or not documents or documents is self._documents_ok:
            return  # the last check passed these very documents (the replica validates, then streams)
        if sum(len(d.encode("utf-8", "surrogatepass")) + 1 for d in documents) <= cap:
            return
        encode = self.target.tokenizer.encode  # ~1.4 s a MiB of text on one core
        n = sum(len(encode(d, add_special_tokens=False)) for d in documents)
        if n > cap:
            raise InvalidField("documents", f"{n} tokens in all exceeds the limit of {cap} (limits.max_document_tokens)")
        self._documents_ok = documents

    # ------------------------------------------------------------------ the loop
    def generate(self, req: GenerationRequest) -> GenerationResult:
        result = None
        for event in self.stream(req):
            result = event
        assert isinstance(result, GenerationResult)
        return result

    def stream(self, req: GenerationRequest) -> Iterator[StepEvent | GenerationResult]:
        """Yield a StepEvent per step (possibly with empty text), then the GenerationResult.

        The request joins this decoder's batch (``BatchScheduler``): callers on other threads
        share every forward. Raises ``Busy`` when the replica cannot take it now."""
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
        scheduler = self.scheduler
        ticket = None
        try:
            ticket = self.submit(req, policy, span)
            while True:
                event = scheduler.next_event(ticket)
                if isinstance(event, GenerationResult):
                    # The answer stores' I/O runs here, on the caller's thread, never in a step.
                    self._finish_sources(req, list(req.prompt_ids), list(event.token_ids), event.text, policy.lossless)
                    outcome = event.finish_reason
                    span.set_attributes({
                        "draftmesh.tokens": len(event.token_ids), "draftmesh.steps": len(event.steps),
                        "draftmesh.tokens_per_step": round(event.mean_accepted_per_step, 3),
                        "draftmesh.reused_tokens": event.reused_tokens, "draftmesh.lenient_tokens": event.lenient_tokens,
                        "draftmesh.first_token_ms": round(1e3 * event.first_token_s, 3),
                    })
                    yield event
                    return
                yield event
        except Exception as exc:
            outcome = "error"
            tracing.record_error(span, exc)
            raise
        finally:
            if ticket is not None and not ticket.done:
                scheduler.cancel(ticket)
            span.set_attribute("draftmesh.finish_reason", outcome)
            span.end()

    def submit(self, req: GenerationRequest, policy: AcceptancePolicy | None = None,
               span: trace.Span = trace.INVALID_SPAN) -> Ticket:
        """Put the request in the batch (validated); its events then come from ``scheduler.next_event``."""
        if policy is None:
            policy = self.validate(req)
        if not req.request_id:
            req = dataclasses.replace(req, request_id=uuid.uuid4().hex)
        run = RequestRun(req, policy, self.target.tokenizer, self.target.eos_token_ids, span)
        run.successor_k = self.successor_k
        run.prepared = self._prepare(req)
        try:
            return self.scheduler.submit(run)
        except BaseException:
            self.end_request(run)
            raise

    def _prepare(self, req: GenerationRequest) -> dict[str, Any]:
        """Each active ``PreparingSource``'s per-request state, built here on the caller's
        thread before the request's first step (never inside a batched step). A source that
        fails to prepare only drafts less for this request."""
        spec = req.speculation
        if not spec.enabled or spec.max_nodes == 0:
            return {}
        preparing = [s for s in self.sources if isinstance(s, PreparingSource)
                     and (spec.sources is None or s.name in spec.sources)]
        if not preparing:
            return {}
        # the narrowest reading scope (own tenant only): preparing reads the request's own documents
        ctx = self._context(req, list(req.prompt_ids), [], size_hint=0, lossless=False)
        out: dict[str, Any] = {}
        for source in preparing:
            try:
                state = source.prepare(ctx)
            except Exception:
                log.exception("draft source %s failed to prepare request %s; it drafts without", source.name, req.request_id)
                continue
            if state is not None:
                out[source.name] = state
        return out

    def end_request(self, run: RequestRun) -> None:
        """Free what the request held outside its KV row: the builder's per-request state, the
        sources' late calls, per-request state (``RequestScopedSource``) and prepared state
        (rag's index). Called once per request by the
        scheduler when it finishes, fails or is cancelled (idempotent)."""
        rid = run.req.request_id
        self.builder.finish(rid)
        self.caller.forget(rid)
        prepared, run.prepared = run.prepared, {}
        for source in self.sources:
            if isinstance(source, RequestScopedSource):
                try:
                    source.forget(rid)
                except Exception:
                    log.exception("draft source %s failed to forget request %s", source.name, rid)
            if source.name in prepared:
                try:
                    source.release(prepared[source.name])
                except Exception:
                    log.exception("draft source %s failed to release request %s", source.name, rid)

    @property
    def scheduler(self) -> BatchScheduler:
        """The batch every request of this decoder joins (created on first use)."""
        with self._scheduler_lock:
            if self._scheduler is None:
                self._scheduler = BatchScheduler(self, self.batch_limits, self.batch_observer)
            return self._scheduler

    def batch_stats(self) -> dict:
        """The batch's counters: steps, rows and tokens per forward, queue, KV bytes, prompt tokens
        copied from the prefix pool."""
        sched = self._scheduler
        if sched is None:
            return {}
        st, kv = sched.stats, sched.kv
        return {
            "steps": st.steps, "forward_rows": st.forward_rows, "forward_tokens": st.forward_tokens,
            "drafted_rows": st.drafted_rows, "mean_rows": st.forward_rows / st.steps if st.steps else 0.0,
            "mean_tokens_per_forward": st.forward_tokens / st.steps if st.steps else 0.0,
            "speculating_share": st.drafted_rows / st.forward_rows if st.forward_rows else 0.0,
            "max_rows": st.max_rows_seen, "admitted": st.admitted, "finished": st.finished,
            "prefix_reused_tokens": self.kv_pool.stats()["reused_tokens"] if self.kv_pool is not None else 0,
            "cancelled": st.cancelled, "refused": st.refused, "interrupted": st.interrupted,
            "step_s": st.step_s_total, "forward_s": st.forward_s_total,
            "mean_wait_s": st.wait_s_total / st.admitted if st.admitted else 0.0,
            "active_rows": kv.rows, "kv_bytes_allocated": kv.allocated_bytes, "kv_bytes_used": kv.used_bytes,
            "kv_budget_bytes": sched.limits.kv_budget_bytes,
            "tree_cost_factors": {str(r): round(f, 3) for r, f in sched.tree_cost_factors().items()},
            "asking_rates": {str(r): [round(v, 1) for v in rates] for r in sorted(sched.asking.asking)
                             if (rates := sched.asking.rates(r)) is not None},
        }

    def sizes(self) -> dict[str, int]:
        """Bytes held by the replica's bounded caches, for the size gauges: the pooled prefix KV,
        the live rag indexes, the answer store and its Redis's ``used_memory``. The last two are
        Redis round trips: call this outside the steps (the replica does, after a request)."""
        out: dict[str, int] = {}
        sched = self._scheduler
        if self.kv_pool is not None and sched is not None:
            out["prefix_kv_bytes"] = self.kv_pool.stats()["cached_tokens"] * sched.kv.bytes_per_token
        for source in self.sources:
            stats = source.stats() if isinstance(source, PreparingSource) and hasattr(source, "stats") else None
            if isinstance(stats, dict) and "index_bytes" in stats:
                out["rag_index_bytes"] = out.get("rag_index_bytes", 0) + int(stats["index_bytes"])
        for source in self.sources:
            store = getattr(source, "store", None)
            if callable(getattr(store, "nbytes", None)):
                try:
                    out["answer_store_bytes"] = store.nbytes()
                    out["redis_used_bytes"] = int(store.client.info("memory")["used_memory"])
                except Exception:  # a size gauge never fails a request
                    log.warning("answer store sizes unavailable", exc_info=True)
                break
        return out

    # ------------------------------------------------------------------ a request's part of a step
    def rests_at(self, batch_rows: int) -> bool:
        """Whether requests in a batch of ``batch_rows`` may rest their sources (and the scheduler
        measures whether asking pays at that size): resting on, from ``rest_min_rows`` requests."""
        return self.rest_after > 0 and batch_rows >= self.rest_min_rows

    def ask_sources(self, run: RequestRun, batch_rows: int = 1, asking: bool | None = None) -> bool:
        """Start the request's source calls for this step; False when it drafts nothing this step
        (the plan then holds a fixed tree or none). ``batch_rows``: the requests in this step's
        batch (whether it may rest its sources). ``asking``: False when the step asks nobody (the
        scheduler's ``AskingValue``: asking has not paid at this batch size lately, or the step
        measures what a step without asking makes). A step asks every request's sources first, then
        collects them (``candidates``) against one deadline."""
        req, plan = run.req, run.plan
        spec = req.speculation
        active = [src for src in self.sources if spec.sources is None or src.name in spec.sources]
        if len(run.steps) < self.trace_steps:
            plan.span = self._tracer.start_span("step", context=trace.set_span_in_context(run.span))
        if not (spec.enabled and active and spec.max_nodes != 0 and run.remaining > 1):
            return False
        may_rest = self.rests_at(batch_rows)
        if run.rest > 0:  # no source had a draft for this request lately: a plain step, nobody asked
            if may_rest:
                run.rest -= 1
                return False
            run.rest = 0  # the batch shrank: asking is cheap again, the rest ends
        cooling = getattr(self.builder, "cooling_down", None)
        if cooling is not None and cooling(req.request_id):  # its trees kept failing: plain, nobody asked
            return False
        if asking is False:  # a step that asks nobody: the rest above still counts down
            return False
        t0 = time.perf_counter()
        plan.draft_span = self._tracer.start_span("draft", context=trace.set_span_in_context(plan.span))
        try:
            with trace.use_span(plan.draft_span):
                plan.ctx = ctx = self._context(req, run.prompt, run.generated, size_hint=self.builder.max_nodes,
                                               lossless=run.policy.lossless, prepared=run.prepared)
                plan.asked = self.caller.submit(active, ctx)
        except BaseException:  # no ``candidates`` will end it: the request fails here
            plan.draft_span.end()
            raise
        plan.may_rest = may_rest
        plan.draft_s = time.perf_counter() - t0
        run.asks += 1
        return True

    def candidates(self, run: RequestRun, cache_len: int, deadline_at: float | None) -> ScoredTree | None:
        """The request's candidate nodes for the batch budget from the answers of its sources
        (``ask_sources``), awaited until ``deadline_at``; None when the plan holds a fixed tree
        (a builder that sizes its own) or no source had anything."""
        req, plan = run.req, run.plan
        t0 = time.perf_counter()
        ctx = plan.ctx
        with trace.use_span(plan.draft_span, end_on_exit=True):
            proposals, plan.proposed, failed = self._proposals(ctx, self.caller.collect(plan.asked, deadline_at),
                                                               req.speculation.source_caps)
            plan.asked = None
            # The bonus token always comes on top, and positions must stay inside the context.
            max_depth = min(run.remaining - 1, self.target.max_context - cache_len - 2)
            candidate = None
            try:
                if hasattr(self.builder, "candidates"):  # the batch's budget picks its nodes
                    candidate = self.builder.candidates(proposals, ctx, max_depth)
                else:
                    plan.tree = self.builder.build(proposals, ctx).truncate_depth(max_depth)
            except Exception:  # a bad draft must only cost speed: this step decodes one token
                log.exception("tree builder failed on %d proposals from %s; this step drafts nothing",
                              len(proposals), ", ".join(sorted(plan.proposed)) or "no source")
                failed.extend(sorted(plan.proposed))
            plan.failed = tuple(failed)
        plan.draft_s += time.perf_counter() - t0
        return candidate

    def _count_dry(self, run: RequestRun) -> None:
        """After the batch's budget chose: a step whose sources were asked and of which nothing
        is verified (no source had a draft, or the budget kept none of it) is dry for the
        request; ``rest_after`` dry steps in a row rest its sources (``ask_sources``)."""
        plan = run.plan
        if len(plan.tree):
            run.dry = run.rests = 0
            return
        run.dry += 1
        if plan.may_rest and run.dry >= self.rest_after:  # rest 1, 2, 4, ... max_rest steps, a dry probe between
            run.rest = min(self.max_rest, 1 << min(run.rests, 30))
            run.rests += 1

    def prepare_verify(self, run: RequestRun) -> None:
        """Once the batch's budget chose: count the step towards resting the request's sources
        (``_count_dry``), check the chosen tree and start the fact-check flag lookup (lossy policies
        only): a Redis round trip that runs while the target computes the batch."""
        plan = run.plan
        if plan is None or not plan.decode:
            return
        if plan.ctx is not None:  # its sources were asked this step
            self._count_dry(run)
        plan.tree.validate(self.target.vocab_size)
        if self.flag_provider is not None and not run.policy.lossless and plan.ctx is not None and len(plan.tree):
            plan.flags = self._flag_thread().submit(tracing.in_context(self._flags), plan.ctx, plan.tree)

    def observe_step(self, run: RequestRun, plan: StepPlan, batch_size: int, forward_start_ns: int) -> None:
        """Learn from the step's verdict and close its span (with a ``verify`` span from the batch's
        forward to the request's commit). The step's successors go to the ``SuccessorObserver``
        sources, under the request's tenant."""
        self.builder.observe(plan.tree, run.verdict, plan.ctx)
        if run.successors is not None:
            inputs, ids, probs = run.successors
            run.successors = None
            for source in self._successor_sources:
                try:
                    source.observe_successors(run.req.tenant, inputs, ids[:, : source.top_k], probs[:, : source.top_k])
                except Exception:  # it only drafts less
                    log.exception("draft source %s failed to observe a step's successors", source.name)
        span = plan.span
        if span.is_recording():
            verify = self._tracer.start_span("verify", context=trace.set_span_in_context(span), start_time=forward_start_ns,
                                             attributes={"draftmesh.tree_size": len(plan.tree), "draftmesh.batch_size": batch_size,
                                                         "draftmesh.accepted": run.steps[-1].accepted})
            verify.end()
            span.set_attribute("draftmesh.batch_size", batch_size)
            _describe_step(span, len(run.steps), run.steps[-1])
        span.end()

    def trace_prefill(self, run: RequestRun, *, done: bool) -> None:
        """The request's ``prefill`` span: opened when it joins the batch, closed when its prompt is
        cached (it may take several chunked steps)."""
        if run.prefill_span is None:
            run.prefill_span = self._tracer.start_span("prefill", context=trace.set_span_in_context(run.span), attributes={
                "draftmesh.tokens": run.to_prefill, "draftmesh.reused_tokens": run.reused})
        if done and run.prefill_span.is_recording():
            run.prefill_span.end()
            run.prefill_span = trace.INVALID_SPAN

    def _context(self, req: GenerationRequest, prompt: list[int], generated: list[int], size_hint: int,
                 lossless: bool, prepared: Mapping[str, Any] | None = None) -> DraftContext:
        """``lossless``: the request's policy is; a lossy one drafts from its own tenant's answers only and stores none."""
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
            prepared=prepared or {},
            tenant=req.tenant,
            answer_tenants=(req.tenant, *req.reads_answers_of) if lossless else (req.tenant,),
            store_answer=lossless,
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

    def _proposals(
        self, ctx: DraftContext, answers: SourceAnswers, caps: Mapping[str, int]
    ) -> tuple[list[Proposal], dict[str, int], list[str]]:
        """The answered proposals, cut to what the step's tree can hold, per-source caps applied."""
        proposals: list[Proposal] = []
        proposed: dict[str, int] = {}
        sources = [s for s in self.sources if s.name in answers.proposals]
        failed = list(answers.failed)
        for source in sources:
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
        return proposals, proposed, failed

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

    def _finish_sources(self, req: GenerationRequest, prompt: list[int], generated: list[int], text: str,
                        lossless: bool) -> None:
        learners = [s for s in self.sources if isinstance(s, LearningSource)]
        if not learners:
            return
        ctx = self._context(req, prompt, [], size_hint=0, lossless=lossless)
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
