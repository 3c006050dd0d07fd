"""What one verifier replica does with its requests, without Ray.

Each request's decode loop runs on its own thread so the replica's event loop stays free
to stream results and notice cancellations; the requests share one batch (the decoder's
``BatchScheduler``): every step is one forward over all of them, run by whichever request
thread finds the step free. A cancelled request (client gone, deadline passed) leaves the
batch within one step. The fact-check of a finished output runs on the request's thread,
never inside a step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import asdict, dataclass
from typing import AsyncIterator

from opentelemetry import context as otel_context

from draftmesh import tracing
from draftmesh.io_struct import (
    FactCheckReport,
    GenerationRequest,
    GenerationResult,
    Rejected,
    ServedResult,
    ServeRequest,
    StepEvent,
)
from draftmesh.prompts import encode_messages, encode_prompt
from draftmesh.verify.decoder import SpeculativeDecoder
from draftmesh.verify.factcheck_link import FactCheckLink
from draftmesh.verify.metrics import VerifierMetrics
from draftmesh.verify.scheduler import Busy

log = logging.getLogger(__name__)

_DONE = object()


@dataclass
class ReplicaStats:
    active: int = 0
    served: int = 0
    rejected: int = 0
    cancelled: int = 0
    failed: int = 0
    steps: int = 0
    tokens: int = 0


class VerifierReplica:
    def __init__(
        self,
        decoder: SpeculativeDecoder,
        name: str = "verifier",
        factcheck_link: FactCheckLink | None = None,
        factcheck_wait_s: float = 2.0,
        metrics: VerifierMetrics | None = None,
        stream_interval: int = 1,
    ) -> None:
        self.decoder = decoder
        self.stream_interval = stream_interval
        """Tokens a streamed StepEvent carries at least (``serve.stream_interval``): see ``run``."""
        self.name = name
        self.factcheck_link = factcheck_link
        """Annotates outputs; the decoder's flag provider is the same link (set by the deployment)."""
        self.factcheck_wait_s = factcheck_wait_s
        self.metrics = metrics
        self._stats = ReplicaStats()
        self._stats_lock = threading.Lock()
        self._sizes_at = float("-inf")

    # ------------------------------------------------------------------ requests
    def to_generation_request(self, req: ServeRequest) -> GenerationRequest:
        """Tokenize and build the decoder's request; ValueError says what is wrong."""
        tokenizer = self.decoder.target.tokenizer
        if req.messages is not None:
            ids = encode_messages(tokenizer, [{"role": r, "content": c} for r, c in req.messages])
        else:
            ids = encode_prompt(tokenizer, req.prompt or "")
        return req.to_generation(tuple(ids))

    async def run(self, req: ServeRequest) -> AsyncIterator[StepEvent | GenerationResult | Rejected]:
        """Yield ``Rejected`` (bad request), or StepEvents and then the ``ServedResult``.

        A StepEvent per step, unless ``stream_interval`` > 1: then the first tokens go out at once (the
        time to first token is unchanged) and later steps are merged until an event holds that many
        tokens or the request ends. Every event crosses the router, Serve's proxy and the gateway, each
        a Python process taking CPU from the forward; metrics still count every step."""
        try:
            gen_req = self.to_generation_request(req)
            self.decoder.validate(gen_req)
        except ValueError as exc:
            self._count(rejected=1)
            yield Rejected(str(exc))
            return
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()

        def post(item) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop is gone: nobody is listening any more
                cancel.set()

        parent = tracing.extract(req.trace_context)

        def work() -> None:
            otel_context.attach(parent)  # this thread's own context: the router's span is the parent
            events = self.decoder.stream(gen_req)
            try:
                for event in events:
                    if cancel.is_set():
                        break
                    if isinstance(event, GenerationResult):  # outside any step: the others go on
                        event = ServedResult(event, self.name, self._annotate(req, gen_req.request_id, event))
                        self._report_sizes()
                    post(event)
            except Busy as exc:  # the replica's KV budget or queue: RESOURCE_EXHAUSTED, not the caller's fault
                post(Rejected(str(exc), reason="busy"))
            except BaseException as exc:  # reported to the awaiting coroutine, never lost
                post(exc)
            finally:
                events.close()
                if self.factcheck_link is not None:
                    self.factcheck_link.forget(gen_req.request_id)
                post(_DONE)

        self._count(active=1)
        thread = threading.Thread(target=work, name=f"decode-{req.request_id[:8]}", daemon=True)
        thread.start()
        outcome = "cancelled"
        pending: StepEvent | None = None  # steps not streamed yet (stream_interval)
        streamed = False  # whether tokens have gone out
        try:
            while True:
                item = await queue.get()
                if item is _DONE:
                    break
                if isinstance(item, BaseException):
                    outcome = "failed"
                    raise item
                if isinstance(item, Rejected):
                    outcome = "rejected"
                    yield item
                    continue
                if isinstance(item, StepEvent):
                    self._count(steps=1, tokens=len(item.token_ids))
                    if self.metrics is not None:
                        self.metrics.step(item.record)
                    pending = item if pending is None else pending.then(item)
                    if streamed and len(pending.token_ids) < self.stream_interval:
                        continue
                    streamed = streamed or bool(pending.token_ids)
                    item, pending = pending, None
                else:
                    outcome = "served"
                    if self.metrics is not None:
                        self.metrics.prompt(item.result.prompt_tokens, item.result.reused_tokens)
                    if pending is not None:
                        yield pending
                        pending = None
                yield item
        finally:
            cancel.set()
            self._count(active=-1, **{outcome: 1})

    def _report_sizes(self, every_s: float = 1.0) -> None:
        """Set the cache size gauges, at most once a second (they cost Redis round trips)."""
        now = time.monotonic()
        if self.metrics is None or now - self._sizes_at < every_s:
            return
        self._sizes_at = now
        try:
            self.metrics.sizes(self.decoder.sizes())
        except Exception:
            log.warning("cache sizes not reported", exc_info=True)

    def _annotate(self, req: ServeRequest, request_id: str, result: GenerationResult) -> FactCheckReport | None:
        """The output's fact-check report; never fails the request."""
        if self.factcheck_link is None:
            return None
        options = req.factcheck_options
        wait = self.factcheck_wait_s if options.wait_ms is None else options.wait_ms / 1000
        try:
            return self.factcheck_link.annotate_output(request_id, result.text, wait, enabled=options.enabled)
        except Exception as exc:
            log.exception("fact-check of request %s failed", request_id)
            return FactCheckReport(status="failed", error=f"{type(exc).__name__}: {exc}")

    # ------------------------------------------------------------------ introspection
    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for key, value in deltas.items():
                setattr(self._stats, key, getattr(self._stats, key) + value)
            active = self._stats.active
        if self.metrics is not None and "active" in deltas:
            self.metrics.set_active(active)

    def stats(self) -> dict:
        with self._stats_lock:
            out = asdict(self._stats)
        if self.decoder.kv_pool is not None:
            out["kv_pool"] = self.decoder.kv_pool.stats()
        out["batch"] = self.decoder.batch_stats()
        if self.factcheck_link is not None:
            out["factcheck"] = self.factcheck_link.stats()
        out["replica"] = self.name
        return out
