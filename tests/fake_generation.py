"""A fake ``draftmesh.v1.Generation`` server on loopback: real gRPC, scripted answers."""

from __future__ import annotations

from concurrent import futures

import grpc

from draftmesh.v1 import generation_pb2 as pb
from draftmesh.v1 import generation_pb2_grpc as pb_grpc

WORDS = ["The", " cat", " sat", "."]


def _prompt_of(request: pb.GenerateRequest) -> str:
    return request.prompt or (request.messages[-1].content if request.messages else "")


class FakeGeneration(pb_grpc.GenerationServicer):
    def __init__(self):
        self.requests: list[pb.GenerateRequest] = []
        self.metadata: list[dict] = []

    def _enter(self, request, context):
        md = dict(context.invocation_metadata())
        self.requests.append(request)
        self.metadata.append(md)
        if _prompt_of(request) == "bad":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens: must be >= 1")
        if _prompt_of(request) == "boom":
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "server busy")
        return md

    def _result(self, md) -> pb.GenerateResult:
        return pb.GenerateResult(
            request_id="r1",
            text="".join(WORDS) + f" auth={md.get('authorization', 'none')}",
            token_ids=[1, 2, 3, 4, 5],
            finish_reason="stop",
            usage=pb.Usage(prompt_tokens=7, completion_tokens=5, steps=2, cached_prompt_tokens=3),
            sources=[
                pb.SourceStats(source="history", nodes=10, accepted_tokens=4, acceptance=0.4, failed_steps=0),
                pb.SourceStats(source="rules", nodes=3, accepted_tokens=0, acceptance=0.0, failed_steps=1),
            ],
            mean_accepted_per_step=2.5,
            policy="exact",
            lossless=True,
            seconds=0.25,
            first_token_ms=17.25,
            replica="verifier-7",
        )

    def Generate(self, request, context):
        md = self._enter(request, context)
        if _prompt_of(request) == "noresult":
            yield pb.GenerateResponse(delta=pb.GenerateDelta(text="x"))
            return
        for i, word in enumerate(WORDS):
            yield pb.GenerateResponse(delta=pb.GenerateDelta(text=word, token_ids=[i]))
        yield pb.GenerateResponse(result=self._result(md))

    def Complete(self, request, context):
        return self._result(self._enter(request, context))


def start_fake_generation():
    """(server, "host:port", servicer): a FakeGeneration on a free loopback port."""
    servicer = FakeGeneration()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    pb_grpc.add_GenerationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}", servicer
