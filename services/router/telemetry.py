"""What the router reports about each RPC or HTTP request: its server span (the root of the
request's trace, or a child of the client's ``traceparent``) and its request metrics.

Serve's proxies hand the router the caller's gRPC metadata or HTTP headers, so the W3C context a
client sent (an OpenTelemetry-instrumented channel or HTTP client) is extracted here by hand.
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
from draftmesh.router.errors import http_status

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
        self.http_requests = backend.counter("draftmesh_http_requests", "HTTP requests answered, by endpoint and status code",
                                             ("endpoint", "status"))
        self.http_seconds = backend.histogram("draftmesh_http_request_seconds", "HTTP request duration, by endpoint",
                                              LATENCY_BUCKETS_S, ("endpoint",))
        self.in_flight = backend.gauge("draftmesh_router_in_flight", "requests admitted by this router replica and not finished", ())
        self.tenant_requests = backend.counter("draftmesh_tenant_requests", "requests admitted, by tenant", ("tenant",))
        self.tenant_tokens = backend.counter("draftmesh_tenant_tokens", "tokens generated, by tenant", ("tenant",))
        self.tenant_rejections = backend.counter("draftmesh_tenant_rejections", "requests a tenant quota refused, by tenant "
                                                 "and quota (max_in_flight, tokens_per_minute)", ("tenant", "quota"))
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
        self.ticket: Any = None
        """The admitted request's hold on its tenant's quotas (``admission.Ticket``)."""
        self.tenant: str | None = None
        self.generated: int | None = None
        """Tokens of the result, once it came (corrects the tenant's token charge)."""
        self.span = self._start_span(metadata)

    def _start_span(self, metadata: Any):
        return _tracer.start_span(
            f"{SERVICE}/{self.method}", context=tracing.from_metadata(metadata), kind=tracing.SpanKind.SERVER,
            attributes={"rpc.system": "grpc", "rpc.service": SERVICE, "rpc.method": self.method},
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
        self.generated = len(result.token_ids)
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
                if self.tenant is not None:
                    self.metrics.tenant_tokens.inc(len(result.token_ids), {"tenant": self.tenant})
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


class HttpCall(RpcCall):
    """One HTTP request of the OpenAI-compatible face: an HTTP server span named after its route
    and the HTTP metrics; the router's steps still raise gRPC codes, mapped to an HTTP status at the end
    (``status`` set by the face for what it answers itself, e.g. a 404 model or a 400 body)."""

    def __init__(self, route: str, headers: Any, metrics: RouterMetrics | None, http_method: str = "POST") -> None:
        self.http_method = http_method
        self.status: int | None = None
        super().__init__(route, headers, metrics)

    def _start_span(self, headers: Any):
        return _tracer.start_span(
            f"{self.http_method} {self.method}", context=tracing.from_metadata(headers), kind=tracing.SpanKind.SERVER,
            attributes={"http.request.method": self.http_method, "http.route": self.method, "url.scheme": "http"},
        )

    def http_status(self) -> int:
        if self.status is not None:
            return self.status
        return 200 if self.code == grpc.StatusCode.OK else http_status(self.code)[0]

    def end(self) -> None:
        status = self.http_status()
        self.span.set_attribute("http.response.status_code", status)
        if status >= 500:
            self.span.set_status(trace.Status(trace.StatusCode.ERROR))
        self.span.end()
        if self.metrics is not None:
            self.metrics.http_requests.inc(1, {"endpoint": self.method, "status": str(status)})
            self.metrics.http_seconds.observe(time.perf_counter() - self.t0, {"endpoint": self.method})
