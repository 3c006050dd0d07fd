"""OpenTelemetry tracing: one setup per process, trace context carried by hand where nothing carries it.

Tracing is on only when the standard OTLP variables name a collector
(``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) and
``OTEL_SDK_DISABLED``/``OTEL_TRACES_EXPORTER=none`` do not turn it off. Otherwise the
OpenTelemetry API's no-op tracer stays in place: spans cost a context switch of a few
microseconds and nothing is exported, so nothing breaks without a collector.

Every process names itself (``draftmesh-router``, ``draftmesh-verifier``, ``draftmesh-draft``,
``draftmesh-factcheck``, ``draftmesh-client``); the SDK reads the rest of the standard variables
itself: ``OTEL_EXPORTER_OTLP_PROTOCOL`` (grpc or http/protobuf), headers, timeouts,
``OTEL_TRACES_SAMPLER``/``OTEL_TRACES_SAMPLER_ARG``, ``OTEL_BSP_*``, ``OTEL_RESOURCE_ATTRIBUTES``.

Context crosses process boundaries as W3C ``traceparent``: in gRPC metadata (interceptors), in
an explicit carrier dict on Ray Serve handle calls (Ray propagates nothing), and as a field of
each Redis stream entry. Threads get it explicitly (``in_context``): a new thread starts with an
empty context.
"""

from __future__ import annotations

import contextvars
import logging
import os
import threading
from typing import Any, Callable, Mapping, MutableMapping, TypeVar

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, use_span

log = logging.getLogger(__name__)

T = TypeVar("T")

SERVICE_PREFIX = "draftmesh-"
_lock = threading.Lock()
_service: str | None = None
"""The service name this process exports under, once tracing is set up."""


def configured_endpoint(env: Mapping[str, str] | None = None) -> str | None:
    """The collector the standard OTEL_* variables ask to export traces to (None: tracing off)."""
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() in ("none", ""):
        return None
    return env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None


def configured_by_env(env: Mapping[str, str] | None = None) -> bool:
    return configured_endpoint(env) is not None


def setup_tracing(service: str, env: Mapping[str, str] | None = None) -> bool:
    """Install an SDK tracer provider exporting OTLP as ``draftmesh-<service>``; True if tracing is on.

    Once per process: a second call (another deployment in the same worker) keeps the first
    provider. A bad setting (an unknown protocol) raises ValueError naming it."""
    global _service
    env = os.environ if env is None else env
    with _lock:
        if _service is not None:
            return True
        if not configured_by_env(env):
            return False
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        name = service if service.startswith(SERVICE_PREFIX) else SERVICE_PREFIX + service
        provider = TracerProvider(resource=Resource.create({"service.name": name, "service.namespace": "draftmesh"}))
        provider.add_span_processor(BatchSpanProcessor(_otlp_exporter(env)))
        trace.set_tracer_provider(provider)
        _service = name
    log.info("tracing on: %s exports spans to %s", name, configured_endpoint(env))
    return True


def _otlp_exporter(env: Mapping[str, str]):
    protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc").strip()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    elif protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    else:
        raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL must be grpc or http/protobuf, got {protocol!r}")
    return OTLPSpanExporter()


def enabled() -> bool:
    """Whether this process exports spans (setup_tracing succeeded)."""
    return _service is not None


def flush(timeout_s: float = 5.0) -> None:
    """Export the spans still buffered (before a short-lived process exits)."""
    provider = trace.get_tracer_provider()
    force_flush = getattr(provider, "force_flush", None)
    if force_flush is not None:
        force_flush(int(timeout_s * 1000))


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


# ---------------------------------------------------------------------- carriers

def inject(ctx: otel_context.Context | None = None) -> dict[str, str]:
    """The W3C headers (``traceparent``, ``tracestate``) of ``ctx`` (default: the current context)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=ctx)
    return carrier


def extract(carrier: Mapping[str, str] | None) -> otel_context.Context:
    """The context a carrier names (an empty context when it names none)."""
    return propagate.extract(dict(carrier or {}))


def traceparent(ctx: otel_context.Context | None = None) -> str:
    return inject(ctx).get("traceparent", "")


def from_metadata(metadata: Any) -> otel_context.Context:
    """The context in gRPC invocation metadata (pairs of key, value)."""
    carrier: MutableMapping[str, str] = {}
    for key, value in metadata or ():
        if isinstance(value, str):
            carrier[key.lower()] = value
    return extract(carrier)


def in_context(fn: Callable[..., T], ctx: contextvars.Context | None = None) -> Callable[..., T]:
    """``fn`` bound to the caller's context (or ``ctx``), to run on another thread."""
    bound = contextvars.copy_context() if ctx is None else ctx

    def run(*args: Any, **kwargs: Any) -> T:
        return bound.copy().run(fn, *args, **kwargs)

    return run


# ---------------------------------------------------------------------- spans

def record_error(span: Span, exc: BaseException) -> None:
    span.record_exception(exc)
    span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"[:200]))


def set_attributes(span: Span, prefix: str, values: Mapping[str, Any]) -> None:
    """``prefix.<key>`` attributes for a mapping (per-source counts and the like)."""
    if span.is_recording():
        for key, value in values.items():
            span.set_attribute(f"{prefix}.{key}", value)


# ---------------------------------------------------------------------- gRPC

def traced_channel(channel: Any) -> Any:
    """A client channel that sends ``traceparent`` in metadata and records a client span per call
    (the channel itself when tracing is off)."""
    if not enabled():
        return channel
    from opentelemetry.instrumentation.grpc import client_interceptor
    from opentelemetry.instrumentation.grpc.grpcext import intercept_channel

    return intercept_channel(channel, client_interceptor())


def server_interceptors() -> list[Any]:
    """Interceptors for a sync ``grpc.server``: a server span per call, parent from the metadata."""
    if not enabled():
        return []
    from opentelemetry.instrumentation.grpc import server_interceptor

    return [server_interceptor()]


__all__ = [
    "Span", "SpanKind", "configured_by_env", "configured_endpoint", "enabled", "extract", "flush", "from_metadata", "in_context",
    "inject", "record_error", "use_span", "server_interceptors", "set_attributes", "setup_tracing", "traced_channel",
    "traceparent", "tracer",
]
