"""Print the trace of one request as a tree: start a mesh (with its fact-check worker) whose
processes export their spans to an in-process OTLP receiver, send one request, print its spans.

    .venv/bin/python examples/trace_tree.py ["prompt"] [--max-new-tokens N]

What Jaeger shows for the same request, as text (services, span names, durations, key attributes).
"""

from __future__ import annotations

import argparse
import os
import time

import grpc

from draftmesh.bench.otlp_receiver import OtlpReceiver, ReceivedSpan
from draftmesh.config import DraftmeshConfig
from draftmesh.net import free_port
from draftmesh.v1 import generation_pb2 as pb
from draftmesh.v1 import generation_pb2_grpc as pb_grpc

SHOWN = ("rpc.grpc.status_code", "draftmesh.tokens", "draftmesh.steps", "draftmesh.step", "draftmesh.tree_size",
         "draftmesh.accepted", "draftmesh.proposals", "draftmesh.factcheck.status", "draftmesh.factcheck.findings")


def print_tree(spans: list[ReceivedSpan], max_steps: int) -> None:
    children: dict[str, list[ReceivedSpan]] = {}
    for s in spans:
        children.setdefault(s.parent_id, []).append(s)
    ids = {s.span_id for s in spans}
    roots = [s for s in spans if s.parent_id not in ids]

    def show(span: ReceivedSpan, depth: int) -> None:
        attrs = " ".join(f"{k.split('.')[-1]}={span.attributes[k]}" for k in SHOWN if k in span.attributes)
        print(f"{'  ' * depth}{span.service:<20} {span.name:<40} {span.duration_ms:8.1f} ms  {attrs}")
        kids = sorted(children.get(span.span_id, []), key=lambda s: s.start_ns)
        steps = [k for k in kids if k.name == "step"]
        for kid in kids:
            if kid.name == "step" and steps.index(kid) >= max_steps:
                continue
            show(kid, depth + 1)
        if len(steps) > max_steps:
            print(f"{'  ' * (depth + 1)}... {len(steps) - max_steps} more steps")

    for root in roots:
        show(root, 0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("prompt", nargs="?", default="Repeat exactly: Douglas Adams was born on 11 March 1952 in Cambridge.")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--steps", type=int, default=8, help="steps to print")
    args = parser.parse_args()

    from draftmesh.router.launcher import start_mesh

    receiver = OtlpReceiver().start()
    os.environ.update(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint, OTEL_BSP_SCHEDULE_DELAY="200")
    cfg = DraftmeshConfig.from_dict({"engine": {"threads": 2}, "serve": {"grpc_port": free_port(), "log_level": "WARNING"}})
    mesh = start_mesh(cfg)
    try:
        trace_id = os.urandom(16).hex()
        with grpc.insecure_channel(mesh.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            request = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=args.prompt)],
                                         max_new_tokens=args.max_new_tokens)
            result = stub.Complete(request, metadata=[("traceparent", f"00-{trace_id}-{os.urandom(8).hex()}-01")],
                                   timeout=300)
        print(result.text)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            spans = [s for s in receiver.snapshot() if s.trace_id == trace_id]
            if any(s.name == "factcheck.annotate" for s in spans) and any(s.name.endswith("/Complete") for s in spans):
                break
            time.sleep(0.5)
        print(f"\ntrace {trace_id}: {len(spans)} spans from {len({s.service for s in spans})} services")
        print_tree(spans, args.steps)
    finally:
        mesh.stop()
        receiver.stop()


if __name__ == "__main__":
    main()
