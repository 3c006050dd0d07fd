"""An in-process OTLP/gRPC trace receiver: what a collector (Jaeger) would receive.

The tests assert on the spans it keeps; ``draftmesh bench`` exports its traced runs to one
(keeping only a count) so tracing's cost includes real OTLP serialization and export.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, Callable

import grpc
from opentelemetry.proto.collector.trace.v1 import (
    trace_service_pb2,
    trace_service_pb2_grpc,
)


@dataclass(frozen=True)
class ReceivedSpan:
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    service: str
    kind: int
    attributes: dict[str, Any] = field(hash=False)
    status_code: int = 0
    events: tuple[str, ...] = ()
    start_ns: int = 0
    end_ns: int = 0

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


def _value(v) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, keep: bool = True) -> None:
        self.keep = keep
        self.spans: list[ReceivedSpan] = []
        self.received = 0
        self._lock = threading.Lock()
        self._server: grpc.Server | None = None
        self.port = 0

    def Export(self, request, context):
        if not self.keep:
            count = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
            with self._lock:
                self.received += count
            return trace_service_pb2.ExportTraceServiceResponse()
        got = []
        for resource_spans in request.resource_spans:
            attrs = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            service = str(attrs.get("service.name", ""))
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    got.append(ReceivedSpan(
                        trace_id=s.trace_id.hex(), span_id=s.span_id.hex(), parent_id=s.parent_span_id.hex(),
                        name=s.name, service=service, kind=s.kind,
                        attributes={a.key: _value(a.value) for a in s.attributes},
                        status_code=s.status.code, events=tuple(e.name for e in s.events),
                        start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano,
                    ))
        with self._lock:
            self.spans.extend(got)
            self.received += len(got)
        return trace_service_pb2.ExportTraceServiceResponse()

    def start(self) -> "OtlpReceiver":
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()
        return self

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None)

    def snapshot(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self.spans)

    def wait_for(self, predicate: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 30.0) -> list[ReceivedSpan]:
        """The spans once ``predicate`` holds for them (or what arrived by the timeout)."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.snapshot()
            if predicate(spans) or time.monotonic() > deadline:
                return spans
            time.sleep(0.1)
