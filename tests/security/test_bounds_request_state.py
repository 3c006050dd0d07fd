"""Per-request state of the sources (history's indexes, llm's draft KV, the source caller's late
calls) is freed when a request ends, however it ends, and bounded in count and bytes."""

from __future__ import annotations

import threading

from tiny_models import tiny_target

from draftmesh.draft.base import DraftContext
from draftmesh.draft.history import HistorySource
from draftmesh.draft.llm import LLMSource
from draftmesh.io_struct import GenerationRequest
from draftmesh.verify.decoder import SpeculativeDecoder


def _ctx(ids, rid: str) -> DraftContext:
    return DraftContext(token_ids=tuple(ids), prompt_len=len(ids), request_id=rid)


def test_a_cancelled_request_frees_its_history_and_llm_state():
    target = tiny_target("llama")
    history = HistorySource()
    llm = LLMSource(tiny_target("llama", seed=1), max_depth=2)
    decoder = SpeculativeDecoder(target, [history, llm])
    events = decoder.stream(GenerationRequest(prompt_ids=(5, 6, 7, 5, 6), max_new_tokens=30, request_id="gone"))
    next(events)
    assert "gone" in history.tracked_requests and "gone" in llm.cached_requests
    events.close()  # cancelled: finish() is never called, only the decoder's end of request
    # the old code kept both until 256 (history) / 8 (llm) later requests pushed them out
    assert history.tracked_requests == [] and history.state_bytes == 0
    assert llm.cached_requests == []


def test_history_state_is_bounded_by_bytes():
    one = HistorySource()
    ids = list(range(2, 60)) * 4
    one.propose(_ctx(ids, "x"))
    size = one.state_bytes
    assert size > 0
    src = HistorySource(max_bytes=int(2.5 * size))
    for rid in "abcde":
        src.propose(_ctx(ids, rid))
        assert src.state_bytes <= src.max_bytes
    assert src.tracked_requests == ["d", "e"]  # least recently used dropped
    src.forget("d")
    assert src.tracked_requests == ["e"] and src.state_bytes == size


def test_llm_caches_are_bounded_by_bytes_and_forget_never_waits():
    draft = tiny_target("llama", seed=1)
    src = LLMSource(draft, max_depth=2)
    ids = list(range(2, 40))
    src.propose(_ctx(ids, "a"))
    one = src.cache_bytes()
    assert one > 0
    bounded = LLMSource(draft, max_depth=2, max_bytes=int(1.5 * one))
    for rid in "abc":
        bounded.propose(_ctx(ids, rid))
        assert bounded.cache_bytes() <= bounded.max_bytes
    assert bounded.cached_requests == ["c"]
    # forget from the batched step while a draft runs: returns at once, applied at the next call
    with bounded._lock:
        done = threading.Event()
        threading.Thread(target=lambda: (bounded.forget("c"), done.set())).start()
        assert done.wait(2)
        assert bounded.cached_requests == ["c"]
    bounded.propose(_ctx(ids, "d"))
    assert bounded.cached_requests == ["d"]
