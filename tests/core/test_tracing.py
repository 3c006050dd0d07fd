"""Tracing: off unless a collector is configured; when on, one decode is one trace whose spans
nest as the work does, across a gRPC draft source, and collected by a real OTLP receiver."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from draftmesh import tracing
from draftmesh.bench.otlp_receiver import OtlpReceiver

TESTS_DIR = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("env, on", [
    ({}, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, True),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, True),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317", "OTEL_SDK_DISABLED": "true"}, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317", "OTEL_TRACES_EXPORTER": "none"}, False),
])
def test_tracing_is_on_only_when_a_collector_is_named(env, on):
    assert tracing.configured_by_env(env) is on


def test_a_context_survives_its_carrier_and_grpc_metadata():
    parent = SpanContext(trace_id=0x1234, span_id=0x99, is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    ctx = trace.set_span_in_context(NonRecordingSpan(parent))
    carrier = tracing.inject(ctx)
    assert carrier["traceparent"] == f"00-{0x1234:032x}-{0x99:016x}-01"
    for got in (tracing.extract(carrier), tracing.from_metadata([("Traceparent", carrier["traceparent"]), ("x-bin", b"\0")])):
        span_context = trace.get_current_span(got).get_span_context()
        assert (span_context.trace_id, span_context.span_id, span_context.is_remote) == (0x1234, 0x99, True)
    assert not trace.get_current_span(tracing.extract({})).get_span_context().is_valid


def test_in_context_carries_the_callers_context_to_another_thread():
    parent = SpanContext(trace_id=7, span_id=8, is_remote=False)
    seen = {}
    with trace.use_span(NonRecordingSpan(parent)):
        bound = tracing.in_context(lambda: seen.setdefault("plain", trace.get_current_span().get_span_context()))
    thread = threading.Thread(target=bound)
    thread.start()
    thread.join()
    assert seen["plain"].trace_id == 7


def run_traced_engine(endpoint: str | None, trace_steps: int, **env: str) -> dict:
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    child_env.update(env, PYTHONPATH=os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")])),
                     OTEL_BSP_SCHEDULE_DELAY="100")
    if endpoint:
        child_env["OTEL_EXPORTER_OTLP_ENDPOINT"] = endpoint
    out = subprocess.run([sys.executable, str(TESTS_DIR / "traced_engine.py"), str(trace_steps)], env=child_env,
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture
def receiver():
    got = OtlpReceiver().start()
    yield got
    got.stop()


def test_a_decode_is_one_trace_with_its_steps_sources_and_grpc_calls(receiver):
    run = run_traced_engine(receiver.endpoint, trace_steps=256)
    assert run["tracing"] and run["identical"]
    spans = receiver.wait_for(lambda s: any(x.name == "decode" for x in s), timeout_s=20)
    assert len({s.trace_id for s in spans}) == 1
    assert {s.service for s in spans} == {"draftmesh-engine"}
    by_id = {s.span_id: s for s in spans}
    parent = lambda s: by_id.get(s.parent_id)  # noqa: E731
    named = lambda name: [s for s in spans if s.name == name]  # noqa: E731
    (decode,) = named("decode")
    assert decode.parent_id == "" and decode.attributes["draftmesh.steps"] == run["steps"]
    assert decode.attributes["draftmesh.tokens"] == run["tokens"] and decode.attributes["draftmesh.finish_reason"] == "length"
    steps = named("step")
    assert len(steps) == run["steps"] and all(parent(s) is decode for s in steps)
    assert sum(s.attributes["draftmesh.accepted_by.extern"] for s in steps if "draftmesh.accepted_by.extern" in s.attributes) > 0
    (prefill,) = named("prefill")
    assert parent(prefill) is decode
    assert all(parent(s).name == "step" for s in named("draft") + named("verify"))
    sources = named("source extern")
    assert sources and all(parent(s).name == "draft" for s in sources)
    # gRPC client span under the source's span, the server's span under the client's (traceparent in metadata)
    client = [s for s in named("/draftmesh.v1.DraftSource/Propose") if s.kind == 3]
    server = [s for s in named("/draftmesh.v1.DraftSource/Propose") if s.kind == 2]
    assert client and all(parent(s).name == "source extern" for s in client)
    assert len(server) == len(client) and all(parent(s) in client for s in server)


def test_trace_steps_bounds_the_step_spans_and_keeps_the_totals(receiver):
    run = run_traced_engine(receiver.endpoint, trace_steps=2)
    spans = receiver.wait_for(lambda s: any(x.name == "decode" for x in s), timeout_s=20)
    assert run["steps"] > 2
    assert len([s for s in spans if s.name == "step"]) == 2
    (decode,) = [s for s in spans if s.name == "decode"]
    assert decode.attributes["draftmesh.steps"] == run["steps"]


def test_without_a_collector_nothing_is_exported(receiver):
    run = run_traced_engine(None, trace_steps=256, OTEL_EXPORTER_OTLP_PROTOCOL="grpc")
    assert run == {**run, "tracing": False, "identical": True}
    assert receiver.snapshot() == []


def test_an_unknown_protocol_is_a_clear_error():
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_PROTOCOL"):
        tracing._otlp_exporter({"OTEL_EXPORTER_OTLP_PROTOCOL": "carrier-pigeon"})
