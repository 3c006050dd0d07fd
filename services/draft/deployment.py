"""The Ray Serve draft deployment: one draft source with its own resources and replicas.

Used for sources too heavy to sit in every verifier (the small LLM) and for a user's own
Python source (``factory: package.module:callable``). It speaks the DraftSource contract
(ProposeRequest -> ProposeResponse), the same messages an external gRPC source answers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextvars
import functools
import logging
from typing import Mapping

from ray import serve

from draftmesh import compute, tracing
from draftmesh.config import RemoteSource
from draftmesh.draft.base import propose_on_compute
from draftmesh.draft.registry import build_source
from draftmesh.draft.wire import context_from_proto, proposals_to_proto
from draftmesh.v1 import draft_source_pb2 as pb

log = logging.getLogger(__name__)


# A short graceful timeout, like the verifier's: a draft call lives for one step's deadline, and the
# mesh's stop lets Serve's shutdown finish before Ray's (launcher).
@serve.deployment(name="draft", max_ongoing_requests=8, health_check_period_s=10, graceful_shutdown_timeout_s=5)
class DraftDeployment:
    def __init__(self, name: str, model: str, spec: RemoteSource, redis_url: str | None = None,
                 answer_store_max_bytes: int = 0) -> None:
        tracing.setup_tracing("draft")
        # Not a module global: Serve pickles this class by value, with the globals its methods use.
        self._tracer = tracing.tracer("draftmesh.draft")
        self.name = name
        self.source = build_source(name, model, options=spec.options, factory=spec.factory, redis_url=redis_url,
                                   answer_store_max_bytes=answer_store_max_bytes)
        # The calls run here, as many as Serve lets in (max_ongoing_requests). A compute-bound source
        # (the llm source) hands its work on to the compute thread; torch that another source runs
        # here is single-threaded, or the threads' OpenMP teams would throttle each other
        # (draftmesh.compute). Not a module global: see above.
        self._pool = cf.ThreadPoolExecutor(max_workers=8, thread_name_prefix=f"draft-{name}",
                                           initializer=compute.confine_side_thread)

    async def Propose(self, request: pb.ProposeRequest, trace_context: Mapping[str, str] | None = None) -> pb.ProposeResponse:
        """``trace_context``: the W3C headers of the verifier step asking (ServeHandleSource)."""
        with self._tracer.start_as_current_span(f"draft deployment {self.name}", context=tracing.extract(trace_context),
                                           kind=tracing.SpanKind.SERVER) as span:
            ctx = context_from_proto(request)
            call = functools.partial(contextvars.copy_context().run, propose_on_compute, self.source, ctx)  # as asyncio.to_thread
            proposals = await asyncio.get_running_loop().run_in_executor(self._pool, call)
            span.set_attribute("draftmesh.proposals", len(proposals))
            return proposals_to_proto(self.name, proposals)
