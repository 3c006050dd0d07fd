"""Ask a step's draft sources with a deadline: a slow or broken source is skipped, never awaited.

Sources run on worker threads; the step waits at most ``deadline_s`` for all of them, all of its
requests' calls together (``submit`` each request's, then ``collect`` each against one deadline).
A source that misses the deadline is counted as timed out; while its call for a request is
still running it is skipped as busy *for that request*: busy state is kept per (request,
source), so one request's slow call (rag indexing a large document, a remote source stuck on
one context) never makes the source busy for the other requests of a batch. A source has at
most ``max_per_source`` calls running across requests (beyond: busy), so a source that hangs
on every context holds at most that many of the ``max_workers`` threads and the other sources
keep theirs. Its late answer is not lost: at the next step of the same request, the token drafts
whose start matches what was committed meanwhile are used (advanced past those tokens),
so a source slightly slower than a step still contributes, one step behind. Without a
deadline the sources are called inline, which is cheapest for sources measured in
microseconds.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

from draftmesh import compute, tracing
from draftmesh.draft.base import DraftContext, DraftSource, Proposal, advance, propose_on_compute, runs_inline

log = logging.getLogger(__name__)
_tracer = tracing.tracer("draftmesh.draft")


def propose_traced(source: DraftSource, ctx: DraftContext) -> list[Proposal]:
    """One source's proposals, in a span of its own (a child of the step)."""
    with _tracer.start_as_current_span(f"source {source.name}", attributes={"draftmesh.source": source.name}) as span:
        proposals = list(propose_on_compute(source, ctx))
        span.set_attribute("draftmesh.proposals", len(proposals))
        return proposals


@dataclass
class _Call:
    future: cf.Future
    request_id: str
    token_ids: tuple[int, ...]
    late: bool = False
    """Missed its step's deadline: its answer may serve the request's next step."""
    forgotten: bool = False
    """Its request ended while it ran: kept only so it still counts against the source's cap."""


@dataclass
class SourceAnswers:
    proposals: dict[str, list[Proposal]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    """Source name -> "error", "timeout" or "busy"."""
    late: set[str] = field(default_factory=set)
    """Sources whose proposals this step come from their previous, late answer."""


@dataclass
class PendingAnswers:
    """Calls started for one request's step (``SourceCaller.submit``), not yet collected."""

    ctx: DraftContext
    answers: SourceAnswers = field(default_factory=SourceAnswers)
    futures: dict[cf.Future, str] = field(default_factory=dict)
    """Pool calls -> their source's name."""
    late_answers: dict[str, list[Proposal]] = field(default_factory=dict)
    """A previous late answer per source, advanced to this step's context."""
    inline: list[DraftSource] = field(default_factory=list)
    """Sources that run on the caller's thread when collected."""


MAX_CALLS_PER_SOURCE = 4
"""Calls of one source running at once, across the requests of a replica."""


class SourceCaller:
    def __init__(self, deadline_s: float | None = None, max_workers: int = 8,
                 max_per_source: int = MAX_CALLS_PER_SOURCE) -> None:
        if deadline_s is not None and deadline_s <= 0:
            raise ValueError(f"source deadline must be > 0 seconds, got {deadline_s}")
        if max_workers < 1 or max_per_source < 1:
            raise ValueError(f"need max_workers >= 1 and max_per_source >= 1, got {max_workers}, {max_per_source}")
        self.deadline_s = deadline_s
        self.max_per_source = max_per_source
        # A source that runs torch without saying so (compute_bound) does it single-threaded here, or
        # its thread's OpenMP team would slow every forward of the compute thread (draftmesh.compute).
        self._pool = cf.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="draft-source",
                                           initializer=compute.confine_side_thread) if deadline_s else None
        self._running: dict[tuple[str, str], _Call] = {}
        """(request id, source name) -> the request's latest call of that source."""
        self._lock = threading.Lock()

    def _in_flight(self, name: str) -> int:
        return sum(1 for (_, n), c in self._running.items() if n == name and not c.future.done())

    def forget(self, request_id: str) -> None:
        """Drop an ended request's calls (a late answer can no longer serve it); one still running
        is kept until it returns, so a source hanging on every context stays within its cap."""
        with self._lock:
            for key in [k for k in self._running if k[0] == request_id]:
                if self._running[key].future.done():
                    del self._running[key]
                else:
                    self._running[key].forgotten = True

    def _prune(self) -> None:
        for key in [k for k, c in self._running.items() if c.forgotten and c.future.done()]:
            del self._running[key]

    def running(self) -> int:
        """Calls kept (running, or late answers waiting for their request's next step)."""
        with self._lock:
            return len(self._running)

    def call(self, sources: Sequence[DraftSource], ctx: DraftContext) -> SourceAnswers:
        """Ask ``sources`` for ``ctx`` and wait at most the deadline for them."""
        return self.collect(self.submit(sources, ctx), self.deadline_at())

    def deadline_at(self) -> float | None:
        """When calls started now must have answered (``time.monotonic``); None without a deadline."""
        return time.monotonic() + self.deadline_s if self.deadline_s else None

    def submit(self, sources: Sequence[DraftSource], ctx: DraftContext) -> PendingAnswers:
        """Start the calls of ``sources`` for ``ctx`` on the pool; ``collect`` waits for them.

        A step submits every request's calls first and then collects each with one deadline for
        all (``deadline_at`` taken after the last submission), so the step waits at most one
        deadline for its sources whatever its batch, and their thread hand-offs overlap."""
        pending = PendingAnswers(ctx)
        if self._pool is None:
            pending.inline = list(sources)
            return pending
        # A compute-bound source (a draft model) runs on the step's (compute) thread when collected,
        # while the others run on the pool: no deadline can stop it, so its own budget bounds it (draft.base).
        # So does a source marked ``inline`` (a bounded lookup cheaper than the pool's hand-off).
        pending.inline = [s for s in sources if runs_inline(s)]
        ids = tuple(ctx.token_ids)
        with self._lock:
            self._prune()
            for source in sources:
                if runs_inline(source):
                    continue
                key = (ctx.request_id, source.name)
                previous = self._running.get(key)
                if previous is not None and not previous.future.done():
                    pending.answers.failed[source.name] = "busy"
                    continue
                if self._in_flight(source.name) >= self.max_per_source:
                    pending.answers.failed[source.name] = "busy"
                    continue
                if previous is not None and previous.late:
                    pending.late_answers[source.name] = self._advance(previous, ctx)
                future = self._pool.submit(tracing.in_context(propose_traced), source, ctx)
                self._running[key] = _Call(future, ctx.request_id, ids)
                pending.futures[future] = source.name
        return pending

    def collect(self, pending: PendingAnswers, deadline_at: float | None) -> SourceAnswers:
        """The answers of ``submit``'s calls: the compute-bound sources run here, then the pool's
        are awaited until ``deadline_at`` (``time.monotonic``); the late ones are kept for the
        request's next step."""
        ctx, answers, futures = pending.ctx, pending.answers, pending.futures
        self._call_inline(pending.inline, ctx, answers)
        if not futures:
            return answers
        timeout = None if deadline_at is None else max(0.0, deadline_at - time.monotonic())
        done, late = cf.wait(futures, timeout=timeout)
        with self._lock:  # answered in time: nothing to keep for the next step
            for future in done:
                key = (ctx.request_id, futures[future])
                if self._running.get(key) is not None and self._running[key].future is future:
                    del self._running[key]
        for future in done:
            name = futures[future]
            try:
                answers.proposals[name] = list(future.result())
            except Exception as exc:
                log.error("draft source %s failed; skipped for this step: %r", name, exc)
                answers.failed[name] = "error"
        for future in late:
            name = futures[future]
            with self._lock:
                call = self._running.get((ctx.request_id, name))
                if call is not None and call.future is future:
                    call.late = True
            if pending.late_answers.get(name):
                answers.proposals[name] = pending.late_answers[name]
                answers.late.add(name)
                continue
            log.warning("draft source %s missed the %.0f ms deadline; skipped", name, 1e3 * (self.deadline_s or 0))
            answers.failed[name] = "timeout"
        return answers

    @staticmethod
    def _call_inline(sources: Sequence[DraftSource], ctx: DraftContext, answers: SourceAnswers) -> None:
        for source in sources:
            try:
                answers.proposals[source.name] = propose_traced(source, ctx)
            except Exception:  # a broken source costs speed, never the request
                log.exception("draft source %s failed; skipped for this step", source.name)
                answers.failed[source.name] = "error"

    @staticmethod
    def _advance(call: _Call, ctx: DraftContext) -> list[Proposal]:
        """A late answer's drafts that still apply to ``ctx`` (same request, moved on by a few tokens)."""
        ids = tuple(ctx.token_ids)
        n = len(call.token_ids)
        if call.request_id != ctx.request_id or ids[:n] != call.token_ids or call.future.exception() is not None:
            return []
        advanced = (advance(p, ids[n:]) for p in call.future.result())
        return [p for p in advanced if p is not None]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
