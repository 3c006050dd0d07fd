"""A hostile external draft source (a raw gRPC DraftSource server, not our servicer) can only cost
speed: whatever it answers (huge, out of vocabulary, infinite scores, floods, hangs), every step
stays bounded, the request finishes, and the output is plain greedy's token for token."""

from __future__ import annotations

import math
import threading
import time
from concurrent import futures

import grpc
import pytest

from draftmesh.draft.grpc_source import MAX_ANSWER_BYTES, GrpcDraftSource
from draftmesh.io_struct import GenerationRequest
from draftmesh.v1 import draft_source_pb2 as pb
from draftmesh.v1 import draft_source_pb2_grpc as pb_grpc
from draftmesh.verify.decoder import SpeculativeDecoder
from draftmesh.verify.tree_builder import CostAwareTreeBuilder, TrieBuilder

NEW_TOKENS = 24
GUARD_S = 120.0
"""A request that has not finished by then is hung: the test fails instead of waiting forever."""


def answer(kind: str, ctx_ids: list[int], vocab: int) -> pb.ProposeResponse:
    out = pb.ProposeResponse(source="hostile")
    if kind == "huge":  # 8 proposals of 20k ids: the case that held a replica at 100% CPU for minutes
        for k in range(8):
            out.proposals.add(token_ids=[(ctx_ids[-1] + k + i) % vocab for i in range(20_000)], confidence=1.0)
    elif kind == "many":
        for k in range(20_000):
            out.proposals.add(token_ids=[k % vocab, (k * 7) % vocab, 3], confidence=0.9)
    elif kind == "out_of_vocab":
        out.proposals.add(token_ids=[vocab, vocab + 5, 2**31], confidence=1.0)
        out.proposals.add(token_ids=[1, 2, vocab * 100], confidence=1.0)
    elif kind == "infinite":
        out.proposals.add(token_ids=[1, 2, 3], token_probs=[math.inf, math.nan, -math.inf], confidence=math.inf)
        out.proposals.add(token_ids=[4, 5], token_probs=[1e30, -1e30], confidence=math.nan)
    elif kind == "long_text":
        out.proposals.add(text="w3 w4 w5 " * 200_000, confidence=1.0, text_complete=True)  # 1.8 MB
    elif kind == "flood":  # beyond the answer size we read at all
        out.proposals.add(text="w7 " * (MAX_ANSWER_BYTES // 2), confidence=1.0)
    else:
        raise ValueError(kind)
    return out


class Hostile(pb_grpc.DraftSourceServicer):
    def __init__(self, kind: str, vocab: int) -> None:
        self.kind, self.vocab, self.calls = kind, vocab, 0
        self.release = threading.Event()

    def Propose(self, request, context):  # noqa: N802 - the gRPC method name
        self.calls += 1
        if self.kind == "hang":
            self.release.wait(30)
            return pb.ProposeResponse(source="hostile")
        return answer(self.kind, list(request.token_ids), self.vocab)


@pytest.fixture(scope="module")
def target():
    from tiny_models import tiny_target

    return tiny_target("llama")


@pytest.fixture
def hostile_server():
    started = []

    def start(kind: str, vocab: int):
        server = grpc.server(futures.ThreadPoolExecutor(4), options=[("grpc.max_send_message_length", 64 << 20)])
        servicer = Hostile(kind, vocab)
        pb_grpc.add_DraftSourceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        started.append((server, servicer))
        return servicer, port

    yield start
    for server, servicer in started:
        servicer.release.set()
        server.stop(None)


def finish_within(fn, seconds: float):
    box: dict = {}
    thread = threading.Thread(target=lambda: box.setdefault("out", fn()), daemon=True)
    t0 = time.perf_counter()
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"the request did not finish within {seconds:.0f} s"
    return box["out"], time.perf_counter() - t0


@pytest.mark.parametrize("builder", ["cost-aware", "trie"])
@pytest.mark.parametrize("kind", ["huge", "many", "out_of_vocab", "infinite", "long_text", "flood", "hang"])
def test_a_hostile_source_only_costs_speed(target, hostile_server, kind, builder):
    servicer, port = hostile_server(kind, target.vocab_size)
    source = GrpcDraftSource("hostile", f"127.0.0.1:{port}", timeout_s=2.0 if kind != "hang" else 0.2,
                             token_ids_ok=True)
    tree_builder = CostAwareTreeBuilder({1: 1.0, 8: 1.1, 64: 1.5}) if builder == "cost-aware" else TrieBuilder(64)
    decoder = SpeculativeDecoder(target, [source], tree_builder)
    prompt = (5, 9, 13, 17, 5, 9, 13)
    try:
        result, seconds = finish_within(lambda: decoder.generate(GenerationRequest(prompt, max_new_tokens=NEW_TOKENS)),
                                        GUARD_S)
    finally:
        source.close()
    plain = SpeculativeDecoder(target).generate(GenerationRequest(prompt, max_new_tokens=NEW_TOKENS))
    assert result.token_ids == plain.token_ids
    assert servicer.calls >= 1
    assert all(step.tree_size <= 64 for step in result.steps)
    if kind in ("out_of_vocab", "flood", "hang"):  # nothing usable came: calls count as failed
        assert any("hostile" in step.failed_sources for step in result.steps)
        assert not any(step.accepted_by_source.get("hostile") for step in result.steps)
    print(f"{kind}/{builder}: {len(result.steps)} steps in {seconds:.2f} s, largest tree "
          f"{max(s.tree_size for s in result.steps)} nodes")


class BrokenBuilder(TrieBuilder):
    """Fails on every build (a builder bug a draft happens to trigger)."""

    def build(self, proposals, ctx):
        raise OverflowError("cannot convert float infinity to integer")


class Echo:
    name = "echo"

    def propose(self, ctx):
        from draftmesh.draft.base import Proposal

        return [Proposal(self.name, token_ids=tuple(ctx.token_ids[-3:]))]


def test_a_builder_failure_costs_one_step_of_drafting_not_the_request(target, caplog):
    prompt = (5, 9, 13, 17, 5, 9, 13)
    result = SpeculativeDecoder(target, [Echo()], BrokenBuilder()).generate(GenerationRequest(prompt, max_new_tokens=12))
    plain = SpeculativeDecoder(target).generate(GenerationRequest(prompt, max_new_tokens=12))
    assert result.token_ids == plain.token_ids
    assert all(step.tree_size == 0 for step in result.steps)
    # every step that drafted (all but the last, which has room for its bonus token only) failed
    assert sum(step.failed_sources == ("echo",) for step in result.steps) >= len(result.steps) - 1
    assert "tree builder failed" in caplog.text
