"""An external draft source: a phrase table behind draftmesh.v1.DraftSource/Propose.

It needs only grpcio, protobuf and stubs generated from protos/draftmesh/v1/*.proto; it
does not import draftmesh itself, so it reads like a server written in any language:
take the request's ``text_tail``, answer with text proposals. Here, when the tail ends
with the start of a known phrase (at least MIN_MATCH characters, from a word boundary),
it proposes the rest of that phrase.

Text proposals work with any tokenizer (the verifier aligns them to target tokens);
token-id proposals would be used only if the deployment marks this source
``token_ids: true``. Whatever this server proposes, the output stays the target
model's: a wrong draft only costs speed.

    python examples/external_source/echo_server.py --port 9200 [--phrases FILE]

Stubs: with draftmesh installed they are importable as ``draftmesh.v1``; elsewhere run
    python -m grpc_tools.protoc -I protos --python_out=. --grpc_python_out=. \\
        protos/draftmesh/v1/draft_source.proto protos/draftmesh/v1/generation.proto
which writes the same ``draftmesh/v1/*_pb2*.py`` modules next to this script's working directory.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import signal
import threading
from typing import Sequence

import grpc

from draftmesh.v1 import draft_source_pb2 as pb
from draftmesh.v1 import draft_source_pb2_grpc as pb_grpc

NAME = "echo"
MIN_MATCH = 6
"""Characters of a phrase the tail must already end with before the rest is proposed."""
MAX_PROPOSALS = 4

PHRASES = (
    "Once upon a time, there was",
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor",
    "The quick brown fox jumps over the lazy dog.",
    "To be, or not to be, that is the question.",
    "I hope this helps! Let me know if you have any other questions.",
    "Please note that this information may change over time.",
)


def complete(tail: str, phrases: Sequence[str], max_proposals: int = MAX_PROPOSALS) -> list[tuple[str, float]]:
    """(rest of phrase, confidence) for every phrase whose start the tail ends with; the
    longest matches first."""
    found = []
    for phrase in phrases:
        for k in range(min(len(phrase) - 1, len(tail)), MIN_MATCH - 1, -1):
            start = len(tail) - k
            if tail.endswith(phrase[:k]) and (start == 0 or not tail[start - 1].isalnum()):
                found.append((k, phrase[k:], min(0.9, 0.3 + 0.6 * k / len(phrase))))
                break
    found.sort(key=lambda f: -f[0])
    return [(rest, confidence) for _, rest, confidence in found[:max_proposals]]


class PhraseTableServicer(pb_grpc.DraftSourceServicer):
    def __init__(self, phrases: Sequence[str] = PHRASES) -> None:
        self.phrases = tuple(p for p in phrases if len(p) > MIN_MATCH)

    def Propose(self, request: pb.ProposeRequest, context: grpc.ServicerContext) -> pb.ProposeResponse:
        response = pb.ProposeResponse(source=NAME)
        for rest, confidence in complete(request.text_tail, self.phrases):
            # The rest ends where the phrase ends: its last token is as safe as the others.
            response.proposals.add(text=rest, confidence=confidence, text_complete=True)
        return response


def serve(port: int = 9200, host: str = "127.0.0.1", phrases: Sequence[str] = PHRASES) -> tuple[grpc.Server, int]:
    server = grpc.server(cf.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_DraftSourceServicer_to_server(PhraseTableServicer(phrases), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    server.start()
    return server, bound


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=9200)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--phrases", help="a text file, one phrase per line (default: a built-in table)")
    args = parser.parse_args()
    phrases: Sequence[str] = PHRASES
    if args.phrases:
        with open(args.phrases, encoding="utf-8") as fh:
            phrases = [line.rstrip("\n") for line in fh if line.strip()]
    server, port = serve(args.port, args.host, phrases)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(f"{NAME} draft source listening on {args.host}:{port}", flush=True)
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    server.stop(1.0).wait()


if __name__ == "__main__":
    main()
