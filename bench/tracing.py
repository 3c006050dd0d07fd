"""Tracing on and off in one process, for the bench's side-by-side of what tracing costs.

A process has one global tracer provider, set once. The bench installs a switch as that
provider: off, every tracer is the API's no-op tracer (exactly what a process without a
collector runs); on, the SDK's, with a batch processor exporting OTLP/gRPC to an in-process
receiver on this machine (as with a local collector), so the "traced" runs pay for span
creation, attributes, serialization and export as a served mesh does.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from draftmesh.bench.otlp_receiver import OtlpReceiver

_NOOP = trace.NoOpTracer()


class _SwitchTracer(trace.Tracer):
    def __init__(self, switch: "TracingSwitch", real: trace.Tracer) -> None:
        self._switch, self._real = switch, real

    def _tracer(self) -> trace.Tracer:
        return self._real if self._switch.on else _NOOP

    def start_span(self, *args: Any, **kwargs: Any) -> trace.Span:
        return self._tracer().start_span(*args, **kwargs)

    def start_as_current_span(self, *args: Any, **kwargs: Any):
        return self._tracer().start_as_current_span(*args, **kwargs)


class TracingSwitch(trace.TracerProvider):
    def __init__(self, provider: Any, sink: Any) -> None:
        self.provider = provider
        self.sink = sink
        self.on = False

    def get_tracer(self, *args: Any, **kwargs: Any) -> trace.Tracer:
        return _SwitchTracer(self, self.provider.get_tracer(*args, **kwargs))

    @contextlib.contextmanager
    def enabled(self) -> Iterator[None]:
        self.on = True
        try:
            yield
        finally:
            self.on = False

    def exported(self) -> int:
        """Spans the receiver got so far."""
        self.provider.force_flush()
        return self.sink.received


def noop_step_cost_us(sources: int = 3, number: int = 20000) -> float:
    """Microseconds the spans of one step cost with tracing off (the API's no-op tracer): a step,
    its draft and verify spans and one span per source, as the decode loop opens them."""
    import timeit

    tracer = _NOOP
    parent = trace.set_span_in_context(tracer.start_span("decode"))
    names = [f"source s{i}" for i in range(sources)]

    def step() -> None:
        with trace.use_span(tracer.start_span("step", context=parent), end_on_exit=True):
            with tracer.start_as_current_span("draft"):
                for name in names:
                    with tracer.start_as_current_span(name, attributes={"draftmesh.source": name}) as span:
                        span.set_attribute("draftmesh.proposals", 1)
            with tracer.start_as_current_span("verify") as span:
                span.is_recording()

    return 1e6 * min(timeit.repeat(step, number=number, repeat=5)) / number


_switch: TracingSwitch | None = None
_lock = threading.Lock()


def tracing_switch() -> TracingSwitch:
    """The process's switch, installed as the global tracer provider on first use."""
    global _switch
    with _lock:
        if _switch is None:
            sink = OtlpReceiver(keep=False).start()
            provider = TracerProvider(resource=Resource.create({"service.name": "draftmesh-bench"}))
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=sink.endpoint, insecure=True)))
            _switch = TracingSwitch(provider, sink)
            trace.set_tracer_provider(_switch)
        return _switch
