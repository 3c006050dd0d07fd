"""Session KV reuse: a pooled cache must equal a fresh prefill, and outputs must not change."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from draftmesh.backend import KVState
from draftmesh.draft.base import DraftContext, Proposal
from draftmesh.draft.history import HistorySource
from draftmesh.draft.prompt_lookup import PromptLookupSource
from draftmesh.io_struct import GenerationRequest, SamplingParams
from draftmesh.verify.decoder import SpeculativeDecoder
from draftmesh.verify.session_kv import SessionKVPool
from draftmesh.verify.tree_builder import TrieBuilder


def random_ids(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(1, vocab) for _ in range(n)]


def assert_cache_equals_prefill(target, state: KVState, ids: list[int]) -> None:
    fresh = KVState()
    target.prefill(fresh, ids)
    assert state.length == fresh.length == len(ids)
    for got, want in zip(state.cache.layers, fresh.cache.layers, strict=True):
        assert got.keys.shape == want.keys.shape
        assert torch.allclose(got.keys, want.keys) and torch.allclose(got.values, want.values)


def fake_state(n: int) -> KVState:
    """Pool bookkeeping only looks at the length (test double)."""
    return KVState(length=n)


class OracleSource:
    """Drafts the known plain continuation, so whole chains get accepted (test double)."""

    name = "oracle"

    def __init__(self, reference: list[int]) -> None:
        self.reference = reference

    def propose(self, ctx: DraftContext) -> list[Proposal]:
        chain = tuple(self.reference[len(ctx.generated_ids) :][:6])
        return [Proposal(self.name, token_ids=chain, confidence=1.0)] if chain else []


def test_two_turns_reuse_the_previous_turn_and_match_plain_decoding(tiny):
    rng = random.Random(1)
    plain = SpeculativeDecoder(tiny)
    pool = SessionKVPool()
    pooled = SpeculativeDecoder(tiny, kv_pool=pool)
    prompt = random_ids(rng, tiny.vocab_size, 20)
    expected_reuse = 0
    for turn in range(3):
        want = plain.generate(GenerationRequest(tuple(prompt), max_new_tokens=12))
        got = pooled.generate(GenerationRequest(tuple(prompt), max_new_tokens=12, session_id="s"))
        assert got.token_ids == want.token_ids and got.text == want.text
        assert got.finish_reason == want.finish_reason
        assert got.reused_tokens == expected_reuse
        # plain decoding leaves the prompt and all but the last output token in the cache
        expected_reuse = len(prompt) + len(got.token_ids) - 1
        prompt = prompt + list(got.token_ids) + random_ids(rng, tiny.vocab_size, 5)
    assert pool.stats()["hits"] == 2 and pool.stats()["misses"] == 1
    assert len(pool) == 1


def test_pooled_cache_equals_a_fresh_prefill(tiny):
    rng = random.Random(2)
    pool = SessionKVPool()
    # prompt lookup drafts trees, so the cache went through tree forwards and compaction
    decoder = SpeculativeDecoder(tiny, [PromptLookupSource()], kv_pool=pool)
    prompt = random_ids(rng, tiny.vocab_size, 8) * 3
    result = decoder.generate(GenerationRequest(tuple(prompt), max_new_tokens=20, session_id="s"))
    follow = prompt + list(result.token_ids) + random_ids(rng, tiny.vocab_size, 6)
    state, cached = pool.checkout("s", follow[:-1])
    assert cached == follow[: len(cached)] and len(cached) >= len(prompt)
    assert_cache_equals_prefill(tiny, state, cached)
    tiny.prefill(state, follow[len(cached) : -1])  # what the decoder does next
    assert_cache_equals_prefill(tiny, state, follow[:-1])


def test_divergent_prompt_is_cropped_and_output_unchanged(tiny):
    rng = random.Random(3)
    plain = SpeculativeDecoder(tiny)
    pool = SessionKVPool()
    pooled = SpeculativeDecoder(tiny, kv_pool=pool)
    first = random_ids(rng, tiny.vocab_size, 24)
    pooled.generate(GenerationRequest(tuple(first), max_new_tokens=10, session_id="s"))
    # an edited earlier message: only the first 15 tokens still agree
    edited = first[:15] + [(t % (tiny.vocab_size - 1)) + 1 for t in first[15:]]
    assert edited[15] != first[15]
    for prompt, reuse in ((edited, 15), (edited[:10], 9)):
        req = GenerationRequest(tuple(prompt), max_new_tokens=10)
        got = pooled.generate(GenerationRequest(tuple(prompt), max_new_tokens=10, session_id="s"))
        assert got.reused_tokens == reuse  # a shorter prompt: reuse stops before its last token
        assert got.token_ids == plain.generate(req).token_ids


def test_regenerating_the_same_prompt_reuses_all_but_its_last_token(tiny):
    rng = random.Random(4)
    pooled = SpeculativeDecoder(tiny, kv_pool=SessionKVPool())
    prompt = tuple(random_ids(rng, tiny.vocab_size, 16))
    first = pooled.generate(GenerationRequest(prompt, max_new_tokens=8, session_id="s"))
    again = pooled.generate(GenerationRequest(prompt, max_new_tokens=8, session_id="s"))
    assert again.reused_tokens == len(prompt) - 1
    assert again.token_ids == first.token_ids


def test_lru_eviction_by_count_and_by_tokens():
    pool = SessionKVPool(max_sessions=2, max_tokens=100)
    pool.checkin("a", [1, 2, 3], fake_state(3))
    pool.checkin("b", [4, 5], fake_state(2))
    state, ids = pool.checkout("a", [1, 2, 3, 9])
    pool.checkin("a", ids, state)  # "a" is now the most recently used
    pool.checkin("c", [6], fake_state(1))
    assert len(pool) == 2 and pool.stats()["evictions"] == 1
    assert pool.checkout("b", [4, 5])[1] == []  # "b" was evicted
    assert pool.checkout("a", [1, 2, 3])[1] == [1, 2, 3]

    pool = SessionKVPool(max_tokens=10)
    pool.checkin("a", list(range(6)), fake_state(6))
    pool.checkin("b", list(range(5)), fake_state(5))
    assert len(pool) == 1 and pool.stats()["cached_tokens"] == 5
    pool.checkin("c", list(range(11)), fake_state(11))  # too big on its own: nothing fits
    assert len(pool) == 0 and pool.stats()["evictions"] == 3


def test_checkin_rejects_ids_that_do_not_match_the_cache():
    with pytest.raises(ValueError):
        SessionKVPool().checkin("s", [1, 2, 3], fake_state(2))


def test_concurrent_checkout_gives_the_second_caller_a_fresh_state(tiny):
    pool = SessionKVPool()
    state = KVState()
    tiny.prefill(state, [3, 4, 5, 6])
    pool.checkin("s", [3, 4, 5, 6], state)
    first, first_ids = pool.checkout("s", [3, 4, 5, 7])
    second, second_ids = pool.checkout("s", [3, 4, 5, 7])
    assert first_ids == [3, 4, 5] and first.length == 3
    assert second_ids == [] and second.length == 0 and second is not first

    pool.checkin("s", first_ids, first)
    results: list[list[int]] = []
    barrier = threading.Barrier(8)

    def take() -> None:
        barrier.wait()
        results.append(pool.checkout("s", [3, 4, 5])[1])

    threads = [threading.Thread(target=take) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [[]] * 7 + [[3, 4, 5]]


def test_stop_string_cut_leaves_a_consistent_entry(tiny):
    rng = random.Random(7)
    plain = SpeculativeDecoder(tiny)
    checked = 0
    for _ in range(10):
        prompt = random_ids(rng, tiny.vocab_size, 10)
        free = plain.generate(GenerationRequest(tuple(prompt), max_new_tokens=20))
        words = free.text.split()
        if len(words) < 8:
            continue
        stop = " ".join(words[3:5])
        pool = SessionKVPool()
        # whole chains get accepted, so the cut drops tokens that are already in the cache
        spec = SpeculativeDecoder(tiny, [OracleSource(free.token_ids)], kv_pool=pool)
        got = spec.generate(GenerationRequest(tuple(prompt), max_new_tokens=20, stop=(stop,), session_id="s"))
        assert got.finish_reason == "stop"
        assert got.token_ids == plain.generate(GenerationRequest(tuple(prompt), max_new_tokens=20, stop=(stop,))).token_ids
        state, cached = pool.checkout("s", prompt + list(free.token_ids))
        assert state.length == len(cached) > len(prompt) + len(got.token_ids)
        assert cached == (prompt + list(free.token_ids))[: len(cached)]
        assert_cache_equals_prefill(tiny, state, cached)
        # the next turn continues from the cut answer; reuse stops where it diverges
        pool.checkin("s", cached, state)
        follow = prompt + list(got.token_ids) + random_ids(rng, tiny.vocab_size, 4)
        again = spec.generate(GenerationRequest(tuple(follow), max_new_tokens=8, session_id="s"))
        assert again.reused_tokens >= len(prompt) + len(got.token_ids)
        assert again.token_ids == plain.generate(GenerationRequest(tuple(follow), max_new_tokens=8)).token_ids
        checked += 1
    assert checked >= 2


def test_a_cancelled_or_failed_request_does_not_check_in(tiny):
    rng = random.Random(9)
    pool = SessionKVPool()
    decoder = SpeculativeDecoder(tiny, kv_pool=pool)
    prompt = tuple(random_ids(rng, tiny.vocab_size, 12))
    decoder.generate(GenerationRequest(prompt, max_new_tokens=6, session_id="s"))
    assert len(pool) == 1
    stream = decoder.stream(GenerationRequest(prompt, max_new_tokens=6, session_id="s"))
    next(stream)
    stream.close()  # a cancelled request
    assert len(pool) == 0

    class FailingBuilder(TrieBuilder):
        def observe(self, tree, verdict, ctx=None):
            raise RuntimeError("boom")

    failing = SpeculativeDecoder(tiny, builder=FailingBuilder(), kv_pool=pool)
    with pytest.raises(RuntimeError):
        failing.generate(GenerationRequest(prompt, max_new_tokens=6, session_id="s"))
    assert len(pool) == 0
    again = decoder.generate(GenerationRequest(prompt, max_new_tokens=6, session_id="s"))
    assert again.reused_tokens == 0 and len(pool) == 1


def test_requests_without_a_session_leave_the_pool_alone(tiny):
    pool = SessionKVPool()
    result = SpeculativeDecoder(tiny, kv_pool=pool).generate(GenerationRequest((5, 6, 7), max_new_tokens=4))
    assert result.reused_tokens == 0 and len(pool) == 0 and pool.stats()["misses"] == 0


@pytest.mark.parametrize("source", ["prompt_lookup", "history"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_speculation_with_the_pool_matches_decoding_without_it(tiny, source, temperature):
    """Greedy: identical to plain decoding. Sampled: speculation draws differently from plain
    decoding (same law, other draws), so the reference is the same decoder without a pool."""
    rng = random.Random(11)
    plain = SpeculativeDecoder(tiny)
    make = PromptLookupSource if source == "prompt_lookup" else HistorySource
    reference = SpeculativeDecoder(tiny, [make()], TrieBuilder(max_nodes=16))
    pool = SessionKVPool()
    spec = SpeculativeDecoder(tiny, [make()], TrieBuilder(max_nodes=16), kv_pool=pool)
    sessions = {sid: random_ids(rng, tiny.vocab_size, 6) * 3 for sid in ("a", "b")}
    accepted = 0
    for turn in range(3):
        for sid, prompt in sessions.items():  # interleaved sessions
            req = GenerationRequest(tuple(prompt), max_new_tokens=16, sampling=SamplingParams(temperature, seed=turn),
                                    session_id=sid)
            want = reference.generate(req)
            got = spec.generate(req)
            assert got.token_ids == want.token_ids and got.text == want.text
            if temperature == 0.0:
                assert got.token_ids == plain.generate(req).token_ids
            assert (got.reused_tokens > 0) == (turn > 0) and want.reused_tokens == 0
            accepted += sum(step.accepted for step in got.steps)
            sessions[sid] = prompt + list(got.token_ids) + prompt[:4]
    assert accepted > 0 or temperature > 0  # greedy: the drafts were really used
    assert pool.stats()["hits"] == 4 and len(pool) == 2
