"""Run by tests/core/test_tracing.py in a fresh process (tracing is set up once per process):
a tiny target decodes with one source behind a gRPC DraftSource server, tracing configured by
the OTEL_* environment. Prints what it did as JSON."""

from __future__ import annotations

import json
import sys

from draftmesh import tracing


def main(trace_steps: int) -> None:
    from tiny_models import tiny_target

    from draftmesh.draft.base import DraftContext, Proposal
    from draftmesh.draft.grpc_server import serve_source
    from draftmesh.draft.grpc_source import GrpcDraftSource
    from draftmesh.io_struct import GenerationRequest
    from draftmesh.verify.decoder import SpeculativeDecoder
    from draftmesh.verify.tree_builder import TrieBuilder

    target = tiny_target("llama")
    req = GenerationRequest((5, 6, 7, 8), max_new_tokens=24)
    reference = SpeculativeDecoder(target).generate(req).token_ids  # before tracing: not in the trace
    on = tracing.setup_tracing("engine")

    class Oracle:
        name = "oracle"

        def propose(self, ctx: DraftContext) -> list[Proposal]:
            truth = reference[len(ctx.generated_ids):][:3]
            return [Proposal(self.name, token_ids=tuple(truth))] if truth else []

    server, port = serve_source(Oracle(), 0)
    source = GrpcDraftSource("extern", f"127.0.0.1:{port}", token_ids_ok=True, timeout_s=10)
    decoder = SpeculativeDecoder(target, [source], TrieBuilder(max_nodes=16), source_deadline_s=10,
                                 trace_steps=trace_steps)
    result = decoder.generate(req)
    tracing.flush()
    server.stop(0)
    print(json.dumps({"tracing": on, "steps": len(result.steps), "tokens": len(result.token_ids),
                      "identical": result.token_ids == reference}))


if __name__ == "__main__":
    main(int(sys.argv[1]))
