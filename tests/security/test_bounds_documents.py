"""Request documents are bounded: in bytes at the router, in tokens at the verifier, and the
rag index they make is built once before the first step, charged to a byte budget (over it the
request degrades instead of failing) and freed when the request ends.

The largest allowed document set (``limits.max_document_tokens`` = 65536 SmolLM2 tokens) is
indexed here with its memory measured by tracemalloc and its build time printed (``-s``)."""

from __future__ import annotations

import gc
import inspect
import json
import time
import tracemalloc

import pytest
from tiny_models import tiny_target, word_tokenizer

from draftmesh.config import LimitsConfig
from draftmesh.draft.base import DraftContext
from draftmesh.draft.rag import INDEX_BYTES_PER_TOKEN, RagSource
from draftmesh.io_struct import GenerationRequest, InvalidField
from draftmesh.models import load_tokenizer
from draftmesh.router.validation import InvalidRequest, parse_request
from draftmesh.v1 import generation_pb2 as pb
from draftmesh.verify.decoder import SpeculativeDecoder

MAX_TOKENS = LimitsConfig().max_document_tokens


# ---------------------------------------------------------------------------- caps
def test_router_caps_all_documents_together_in_bytes():
    limits = LimitsConfig(max_document_bytes=100, max_document_total_bytes=250)
    docs = [pb.Document(text="d" * 100)] * 3  # each within its own cap, 300 bytes together
    with pytest.raises(InvalidRequest) as err:
        parse_request(pb.GenerateRequest(prompt="hi", documents=docs), limits, sources=("rag",), policies=("exact",))
    assert err.value.field == "documents" and "300 UTF-8 bytes" in err.value.rule and "250" in err.value.rule
    ok = parse_request(pb.GenerateRequest(prompt="hi", documents=docs[:2]), limits, sources=("rag",), policies=("exact",))
    assert len(ok.documents) == 2


def test_verifier_caps_document_tokens_naming_the_field():
    target = tiny_target("llama")
    decoder = SpeculativeDecoder(target, max_document_tokens=10)
    ok = GenerationRequest(prompt_ids=(2, 3), max_new_tokens=2, documents=("w5 w6 w7 w8 w9", "w10 w11 w12 w13 w14"))
    decoder.validate(ok)  # exactly 10 tokens
    bad = GenerationRequest(prompt_ids=(2, 3), max_new_tokens=2, documents=ok.documents + ("w15",))
    with pytest.raises(InvalidField) as err:
        decoder.validate(bad)
    assert err.value.field == "documents" and "11 tokens" in err.value.rule
    assert "limits.max_document_tokens" in err.value.rule


# ---------------------------------------------------------------------------- the largest allowed request
@pytest.fixture(scope="module")
def smol_tokenizer():
    return load_tokenizer("smollm2-135m")


def _text_of_tokens(tokenizer, n: int) -> list[str]:
    """Real text (Python sources of the standard library) cut into 16 documents of n tokens together."""
    import argparse
    import dataclasses
    import email.message
    import logging
    import typing
    import unittest.case
    import urllib.request

    mods = (json.decoder, json.encoder, inspect, argparse, typing, dataclasses, logging, unittest.case,
            urllib.request, email.message)
    src = "".join(inspect.getsource(m) for m in mods)
    ids = tokenizer.encode(src, add_special_tokens=False)
    while len(ids) < n:
        ids = ids + ids
    per = n // 16
    return [tokenizer.decode(ids[i * per : (i + 1) * per]) for i in range(16)]


def test_the_largest_allowed_documents_index_is_measured_and_freed(smol_tokenizer):
    docs = _text_of_tokens(smol_tokenizer, MAX_TOKENS)
    n = sum(len(smol_tokenizer.encode(d, add_special_tokens=False)) for d in docs)
    assert 0.9 * MAX_TOKENS <= n <= 1.1 * MAX_TOKENS
    rag = RagSource(smol_tokenizer)
    ctx = DraftContext(token_ids=(1, 2, 3), prompt_len=3, documents=tuple(docs), request_id="big")
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        t0 = time.perf_counter()
        state = rag.prepare(ctx)
        build_s = time.perf_counter() - t0
        held = tracemalloc.get_traced_memory()[0] - before
        estimate = state.index.nbytes()
        assert not state.degraded and rag.stats()["index_bytes"] == estimate
        assert 0.8 * held <= estimate <= 1.25 * held, (estimate, held)
        assert rag.propose(DraftContext(token_ids=tuple(state.index.tokens[100:110]), prompt_len=3,
                                        request_id="big", prepared={"rag": state}))
        rag.release(state)
        gc.collect()
        after = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    print(f"\nmax documents: {n} tokens, {sum(len(d.encode()) for d in docs)} bytes; index {held / 2**20:.1f} MiB "
          f"measured, {estimate / 2**20:.1f} MiB estimated ({held / n:.0f} B/token); built in {build_s:.2f} s")
    assert rag.stats() == {"index_bytes": 0, "prepared": 0, "cached": 0, "degraded": 0, "budget_bytes": rag.budget_bytes}
    assert after < 0.1 * held  # released means freed, not only uncounted


# ---------------------------------------------------------------------------- in the decoder
class CountingRag(RagSource):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.builds: list[str] = []

    def _build(self, ctx, docs):
        import threading

        self.builds.append(threading.current_thread().name)
        return super()._build(ctx, docs)


DOCS = (" ".join(f"w{i}" for i in range(5, 60)),)


def _req(rid: str, **kw) -> GenerationRequest:
    return GenerationRequest(prompt_ids=(5, 6, 7, 8), max_new_tokens=12, documents=DOCS, request_id=rid, **kw)


def test_the_index_is_built_once_before_the_steps_and_freed_at_the_end():
    target = tiny_target("llama")
    rag = CountingRag(word_tokenizer(64))
    decoder = SpeculativeDecoder(target, [rag])
    plain = SpeculativeDecoder(target).generate(_req("p"))
    out = decoder.generate(_req("a"))
    assert out.token_ids == plain.token_ids
    assert len(rag.builds) == 1  # once, at submit: never rebuilt by a step
    st = rag.stats()
    # the old code kept every request's index cached after it ended (up to 256 of them)
    assert st["index_bytes"] == 0 and st["prepared"] == 0 and st["cached"] == 0
    assert decoder.caller.running() == 0


def test_a_cancelled_request_frees_its_index():
    target = tiny_target("llama")
    rag = RagSource(word_tokenizer(64))
    decoder = SpeculativeDecoder(target, [rag])
    events = decoder.stream(_req("c", ))
    next(events)
    assert rag.stats()["prepared"] == 1 and rag.stats()["index_bytes"] > 0
    events.close()  # the caller went away
    assert rag.stats()["prepared"] == 0 and rag.stats()["index_bytes"] == 0


def test_over_the_budget_a_request_drafts_without_its_documents():
    tok = word_tokenizer(64)
    one = RagSource(tok).prepare(DraftContext(token_ids=(5, 6), prompt_len=2, documents=DOCS, request_id="x")).nbytes
    budget = int(1.5 * max(one, INDEX_BYTES_PER_TOKEN * 55))  # room for one request's documents, not two
    rag = RagSource(tok, budget_bytes=budget)
    first = rag.prepare(DraftContext(token_ids=(5, 6), prompt_len=2, documents=DOCS, request_id="a"))
    assert not first.degraded and 0 < first.nbytes <= budget
    second = rag.prepare(DraftContext(token_ids=(5, 6), prompt_len=2, documents=DOCS, request_id="b"))
    assert second.degraded and len(second.index) == 0  # not refused: no document index
    assert rag.stats()["index_bytes"] <= budget and rag.stats()["degraded"] == 1
    rag.release(first)
    rag.release(second)
    third = rag.prepare(DraftContext(token_ids=(5, 6), prompt_len=2, documents=DOCS, request_id="c"))
    assert not third.degraded
    # a degraded request still decodes (exactly, as ever)
    target = tiny_target("llama")
    decoder = SpeculativeDecoder(target, [rag])
    assert decoder.generate(_req("d")).token_ids == SpeculativeDecoder(target).generate(_req("e")).token_ids
    assert rag.stats()["degraded"] == 2
    rag.release(third)
    assert rag.stats()["index_bytes"] == 0


def test_the_fallback_cache_is_bounded_by_count_and_bytes():
    """A context without prepared state (rag served outside the verifier) uses a small cache."""
    rag = RagSource(word_tokenizer(64), max_requests=2)
    for rid in "abc":
        rag.propose(DraftContext(token_ids=(5, 6), prompt_len=2, documents=DOCS, request_id=rid))
    assert rag.stats()["cached"] == 2
    one = rag.stats()["index_bytes"] // 2
    small = RagSource(word_tokenizer(64), budget_bytes=one + one // 2)
    for rid in "abc":
        small.propose(DraftContext(token_ids=(5, 6), prompt_len=2, documents=DOCS, request_id=rid))
    assert small.stats()["cached"] == 1 and small.stats()["index_bytes"] <= small.budget_bytes


def test_documents_checked_once_are_not_encoded_again(monkeypatch):
    """The replica validates, then streams (which validates again): large documents are encoded once."""
    target = tiny_target("llama")
    decoder = SpeculativeDecoder(target, max_document_tokens=10)
    req = GenerationRequest(prompt_ids=(2, 3), max_new_tokens=2, documents=("w5 w6 w7 w8 w9 w10 w11 w12",))
    calls = []
    encode = target.tokenizer.encode
    monkeypatch.setattr(target.tokenizer, "encode", lambda *a, **k: calls.append(a) or encode(*a, **k))
    decoder.validate(req)
    decoder.validate(req)
    assert len(calls) == 1
