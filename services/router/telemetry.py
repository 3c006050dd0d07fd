"""What the router reports about each RPC: its server span (the root of the request's trace,
or a child of the client's ``traceparent``) and its request metrics.

Serve's gRPC proxy hands the router the caller's metadata, so the W3C context a client sent
(an OpenTelemetry-instrumented channel) is extracted here by hand.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
from opentelemetry import trace

from draftmesh import tracing
from draftmesh.io_struct import ServedResult
from draftmesh.metrics import LATENCY_BUCKETS_S, MetricsBackend

SERVICE = "draftmesh.v1.Generation"
SERVER_FAULTS = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNIMPLEMENTED,
                 grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS}
"""Codes that mark a server span as failed (OpenTelemetry's gRPC conventions); the others
(INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ...) are the caller's, recorded but not errors."""

_tracer = tracing.tracer("draftmesh.router")


class RouterMetrics:
    def __init__(self, backend: MetricsBackend) -> None:
        self.requests = backend.counter("draftmesh_requests", "RPCs answered, by method and gRPC status code", ("method", "code"))
        self.seconds = backend.histogram("draftmesh_request_seconds", "RPC duration, by method", LATENCY_BUCKETS_S, ("method",))
        self.first_token = backend.histogram("draftmesh_time_to_first_token_seconds", "time from admission to the first step",
                                             LATENCY_BUCKETS_S, ())
        self.tokens = backend.counter("draftmesh_generated_tokens", "tokens generated, by acceptance policy", ("policy",))
        self.lenient = backend.counter("draftmesh_lenient_tokens", "tokens only a lossy policy accepted", ("policy",))
        self.in_flight = backend.gauge("draftmesh_router_in_flight", "requests admitted by this router replica and not finished", ())
        self.factcheck_lag = backend.gauge("draftmesh_factcheck_lag", "span-stream entries the fact-check workers have not read", ())


class RpcCall:
    """One RPC: its span and, when it ends, its metrics; a context manager around the RPC's body,
    whose exception (RpcError, a cancellation, a bug) becomes the call's status code."""

    def __init__(self, method: str, metadata: Any, metrics: RouterMetrics | None) -> None:
        self.method = method
        self.metrics = metrics
        self.code = grpc.StatusCode.OK
        self.t0 = time.perf_counter()
        self.first_token_s: float | None = None
        self.span = _tracer.start_span(
            f"{SERVICE}/{method}", context=tracing.from_metadata(metadata), kind=tracing.SpanKind.SERVER,
            attributes={"rpc.system": "grpc", "rpc.service": SERVICE, "rpc.method": method},
        )

    def __enter__(self) -> "RpcCall":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is not None:
            self.fail(exc)
        self.end()
        return False

    @property
    def context(self):
        """The span's context, to make children of it (never made current: the RPC is a generator)."""
        return trace.set_span_in_context(self.span)

    def carrier(self) -> dict[str, str]:
        return tracing.inject(self.context)

    def admitted(self, request_id: str, policy: str) -> None:
        self.span.set_attributes({"draftmesh.request_id": request_id, "draftmesh.policy": policy})

    def step(self) -> None:
        if self.first_token_s is None:
            self.first_token_s = time.perf_counter() - self.t0
            if self.metrics is not None:
                self.metrics.first_token.observe(self.first_token_s)

    def result(self, served: ServedResult) -> None:
        result = served.result
        self.step()
        if self.span.is_recording():
            self.span.set_attributes({
                "draftmesh.tokens": len(result.token_ids), "draftmesh.steps": len(result.steps),
                "draftmesh.tokens_per_step": round(result.mean_accepted_per_step, 3),
                "draftmesh.finish_reason": result.finish_reason, "draftmesh.lossless": result.lossless,
                "draftmesh.replica": served.replica,
            })
        if self.metrics is not None:
            tags = {"policy": result.policy}
            if result.token_ids:
                self.metrics.tokens.inc(len(result.token_ids), tags)
            if result.lenient_tokens:
                self.metrics.lenient.inc(result.lenient_tokens, tags)

    def fail(self, exc: BaseException) -> None:
        code = getattr(exc, "code", None)
        if isinstance(code, grpc.StatusCode):
            self.code = code
            self.span.set_attribute("rpc.grpc.status_message", str(getattr(exc, "details", ""))[:300])
        elif isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
            self.code = grpc.StatusCode.CANCELLED
        else:
            self.code = grpc.StatusCode.INTERNAL
        if self.code in SERVER_FAULTS:
            tracing.record_error(self.span, exc)

    def end(self) -> None:
        self.span.set_attribute("rpc.grpc.status_code", self.code.value[0])
        self.span.end()
        if self.metrics is not None:
            self.metrics.requests.inc(1, {"method": self.method, "code": self.code.name})
            self.metrics.seconds.observe(time.perf_counter() - self.t0, {"method": self.method})
