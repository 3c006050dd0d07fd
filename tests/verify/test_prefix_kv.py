"""The prefix KV pool: a copied prefix must equal a fresh prefill, and outputs must not change
(float64 random-weight Llama and Gemma 3), whether the prefix comes from the request's own session,
an earlier request of its tenant without one, or a batch of requests sharing a system prompt;
never from another tenant's."""

from __future__ import annotations

import random
import threading

import pytest
import torch
from batch_driver import drive, reference_greedy

from draftmesh.backend import KVState
from draftmesh.draft.base import DraftContext, Proposal
from draftmesh.draft.history import HistorySource
from draftmesh.draft.prompt_lookup import PromptLookupSource
from draftmesh.io_struct import GenerationRequest, SamplingParams
from draftmesh.verify.decoder import SpeculativeDecoder
from draftmesh.verify.prefix_kv import PrefixKVPool
from draftmesh.verify.scheduler import BatchLimits
from draftmesh.verify.tree_builder import TrieBuilder


def random_ids(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(1, vocab) for _ in range(n)]


def assert_prefix_equals_prefill(target, state: KVState, ids: list[int]) -> None:
    """The pooled state's first ``len(ids)`` positions (what a request copies) equal a fresh prefill."""
    fresh = KVState()
    target.prefill(fresh, ids)
    n = len(ids)
    assert state.length >= fresh.length == n
    for got, want in zip(state.cache.layers, fresh.cache.layers, strict=True):
        assert got.keys[:, :, :n].shape == want.keys.shape
        assert torch.allclose(got.keys[:, :, :n], want.keys) and torch.allclose(got.values[:, :, :n], want.values)


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
    pool = PrefixKVPool()
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
    pool = PrefixKVPool()
    # prompt lookup drafts trees, so the cache went through tree forwards and compaction
    decoder = SpeculativeDecoder(tiny, [PromptLookupSource()], kv_pool=pool)
    prompt = random_ids(rng, tiny.vocab_size, 8) * 3
    result = decoder.generate(GenerationRequest(tuple(prompt), max_new_tokens=20, session_id="s"))
    follow = prompt + list(result.token_ids) + random_ids(rng, tiny.vocab_size, 6)
    state, cached = pool.lookup("default", follow[:-1])
    assert cached == follow[: len(cached)] and len(cached) >= len(prompt)
    assert_prefix_equals_prefill(tiny, state, cached)


def test_divergent_prompt_is_cropped_and_output_unchanged(tiny):
    rng = random.Random(3)
    plain = SpeculativeDecoder(tiny)
    pool = PrefixKVPool()
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


@pytest.mark.parametrize("session", ["s", None])
def test_regenerating_the_same_prompt_reuses_all_but_its_last_token(tiny, session):
    rng = random.Random(4)
    pooled = SpeculativeDecoder(tiny, kv_pool=PrefixKVPool())
    prompt = tuple(random_ids(rng, tiny.vocab_size, 16))
    first = pooled.generate(GenerationRequest(prompt, max_new_tokens=8, session_id=session))
    again = pooled.generate(GenerationRequest(prompt, max_new_tokens=8, session_id=session))
    assert first.reused_tokens == 0 and again.reused_tokens == len(prompt) - 1
    assert again.token_ids == first.token_ids


def test_a_chat_resent_whole_reuses_its_last_turn_without_a_session(tiny):
    """A client that sends the whole history every turn (the OpenAI API's way) names no session:
    each turn still prefills only what the last one did not hold, and decodes as without the pool."""
    rng = random.Random(12)
    plain = SpeculativeDecoder(tiny)
    pool = PrefixKVPool(max_sessions=0)
    pooled = SpeculativeDecoder(tiny, kv_pool=pool)
    prompt = random_ids(rng, tiny.vocab_size, 18)
    for turn in range(3):
        req = GenerationRequest(tuple(prompt), max_new_tokens=10)
        got = pooled.generate(req)
        assert got.token_ids == plain.generate(req).token_ids
        assert got.reused_tokens == (0 if turn == 0 else len(prompt) - 6)  # all but the new message's 5 and the root
        prompt = prompt + list(got.token_ids) + random_ids(rng, tiny.vocab_size, 5)
    # each turn's entry began the next one's: only the longest is kept
    assert len(pool) == 1 and pool.stats()["prefixes"] == 1


def test_requests_sharing_a_system_prompt_in_a_batch_decode_as_alone(tiny):
    """Two waves of requests that begin with the same 24 tokens, different lengths, joining mid-stream:
    the second wave copies the prefix from the first's finished rows, and every greedy output equals
    its own plain batch-1 output."""
    rng = random.Random(13)
    system = random_ids(rng, tiny.vocab_size, 24)
    pool = PrefixKVPool()
    decoder = SpeculativeDecoder(tiny, [PromptLookupSource()], TrieBuilder(max_nodes=8), kv_pool=pool)
    schedule, want = [], {}
    for i in range(8):
        prompt = tuple(system + random_ids(rng, tiny.vocab_size, rng.randint(1, 20)))
        n = rng.randint(4, 16)
        want[i] = reference_greedy(tiny, prompt, n)
        schedule.append((0 if i < 4 else 60 + 2 * i, GenerationRequest(prompt, max_new_tokens=n, request_id=f"r{i}"), None))
    results, rows = drive(decoder, schedule)
    for i, result in results.items():
        assert result.token_ids == want[i], f"request {i}"
    assert max(rows) >= 3
    # the first wave started together: nothing to reuse; the second found the shared prefix (or more)
    assert [results[i].reused_tokens for i in range(4)] == [0] * 4
    assert all(results[i].reused_tokens >= len(system) for i in range(4, 8))


def test_one_tenants_kv_never_seeds_anothers_request(tiny):
    rng = random.Random(14)
    pool = PrefixKVPool()
    decoder = SpeculativeDecoder(tiny, kv_pool=pool)
    plain = SpeculativeDecoder(tiny)
    prompt = tuple(random_ids(rng, tiny.vocab_size, 20))
    decoder.generate(GenerationRequest(prompt, max_new_tokens=6, tenant="alice"))
    bob = decoder.generate(GenerationRequest(prompt, max_new_tokens=6, tenant="bob"))
    assert bob.reused_tokens == 0
    assert bob.token_ids == plain.generate(GenerationRequest(prompt, max_new_tokens=6)).token_ids
    again = decoder.generate(GenerationRequest(prompt, max_new_tokens=6, tenant="alice"))
    assert again.reused_tokens == len(prompt) - 1
    assert pool.lookup("carol", prompt) == (None, [])


def test_lru_eviction_by_count_per_kind_and_by_tokens():
    pool = PrefixKVPool(max_sessions=2, max_prefixes=1, max_tokens=100)
    pool.checkin("t", [1, 2, 3], fake_state(3), session_id="a")
    pool.checkin("t", [4, 5], fake_state(2), session_id="b")
    assert pool.lookup("t", [1, 2, 3, 9])[1] == [1, 2, 3]  # "a" is now the most recently used
    pool.checkin("t", [6], fake_state(1), session_id="c")
    assert len(pool) == 2 and pool.stats()["evictions"] == 1
    assert pool.lookup("t", [4, 5])[1] == []  # "b" was evicted
    pool.checkin("t", [7, 8], fake_state(2))
    pool.checkin("t", [9, 8], fake_state(2))  # one prefix entry at most: [7, 8] goes, the sessions stay
    assert pool.lookup("t", [7, 8])[1] == [] and pool.lookup("t", [9, 8])[1] == [9, 8]
    assert pool.stats()["sessions"] == 2 and pool.stats()["prefixes"] == 1

    pool = PrefixKVPool(max_tokens=10)
    pool.checkin("t", list(range(6)), fake_state(6), session_id="a")
    pool.checkin("t", list(range(10, 15)), fake_state(5), session_id="b")
    assert len(pool) == 1 and pool.stats()["cached_tokens"] == 5
    pool.checkin("t", list(range(20, 31)), fake_state(11), session_id="c")  # too big on its own: nothing fits
    assert len(pool) == 0 and pool.stats()["evictions"] == 3
    pool.checkin("t", [1, 2, 3], fake_state(3))
    pool.shrink_to(2)  # the batch's slab needs the room
    assert len(pool) == 0 and pool.stats()["cached_tokens"] == 0


def test_an_entry_that_begins_another_of_its_tenant_is_not_kept_twice():
    pool = PrefixKVPool()
    pool.checkin("t", [1, 2, 3], fake_state(3))
    pool.checkin("u", [1, 2], fake_state(2))  # another tenant's: kept apart
    pool.checkin("t", [1, 2, 3, 4, 5], fake_state(5))  # answers every lookup [1, 2, 3] could
    assert pool.stats()["prefixes"] == 2 and pool.stats()["cached_tokens"] == 7
    pool.checkin("t", [1, 2], fake_state(2))  # nothing new
    assert pool.stats()["prefixes"] == 2
    pool.checkin("t", [1, 2], fake_state(2), session_id="s")  # a session's own entry is always kept
    assert pool.stats()["sessions"] == 1
    pool.checkin("t", [1, 2, 3, 4, 5, 6], fake_state(6))  # but only replaced by its own session
    assert pool.stats()["sessions"] == 1 and pool.stats()["prefixes"] == 2
    assert pool.lookup("u", [1, 2, 3])[1] == [1, 2]


def test_checkin_rejects_ids_that_do_not_match_the_cache():
    with pytest.raises(ValueError):
        PrefixKVPool().checkin("t", [1, 2, 3], fake_state(2), session_id="s")


def test_lookups_share_an_entry_and_leave_it_whole(tiny):
    pool = PrefixKVPool()
    state = KVState()
    tiny.prefill(state, [3, 4, 5, 6])
    pool.checkin("t", [3, 4, 5, 6], state, session_id="s")
    results: list[tuple[KVState | None, list[int]]] = []
    barrier = threading.Barrier(8)

    def take() -> None:
        barrier.wait()
        results.append(pool.lookup("t", [3, 4, 5, 7]))

    threads = [threading.Thread(target=take) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(got is state and ids == [3, 4, 5] for got, ids in results)
    assert state.length == 4 and len(pool) == 1 and pool.stats()["hits"] == 8


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
        pool = PrefixKVPool()
        # whole chains get accepted, so the cut drops tokens that are already in the cache
        spec = SpeculativeDecoder(tiny, [OracleSource(free.token_ids)], kv_pool=pool)
        got = spec.generate(GenerationRequest(tuple(prompt), max_new_tokens=20, stop=(stop,), session_id="s"))
        assert got.finish_reason == "stop"
        assert got.token_ids == plain.generate(GenerationRequest(tuple(prompt), max_new_tokens=20, stop=(stop,))).token_ids
        state, cached = pool.lookup("default", prompt + list(free.token_ids))
        assert len(cached) > len(prompt) + len(got.token_ids)
        assert cached == (prompt + list(free.token_ids))[: len(cached)]
        assert_prefix_equals_prefill(tiny, state, cached)
        # the next turn continues from the cut answer; reuse stops where it diverges
        follow = prompt + list(got.token_ids) + random_ids(rng, tiny.vocab_size, 4)
        again = spec.generate(GenerationRequest(tuple(follow), max_new_tokens=8, session_id="s"))
        assert again.reused_tokens >= len(prompt) + len(got.token_ids)
        assert again.token_ids == plain.generate(GenerationRequest(tuple(follow), max_new_tokens=8)).token_ids
        checked += 1
    assert checked >= 2


def test_a_cancelled_or_failed_request_does_not_check_in(tiny):
    rng = random.Random(9)
    pool = PrefixKVPool()
    decoder = SpeculativeDecoder(tiny, kv_pool=pool)
    prompt = tuple(random_ids(rng, tiny.vocab_size, 12))
    decoder.generate(GenerationRequest(prompt, max_new_tokens=6, session_id="s"))
    kept = pool.lookup("default", prompt)
    assert len(pool) == 1 and len(kept[1]) == len(prompt)
    longer = prompt + tuple(random_ids(rng, tiny.vocab_size, 8))
    stream = decoder.stream(GenerationRequest(longer, max_new_tokens=6, session_id="s"))
    next(stream)
    stream.close()  # a cancelled request: the session's entry stays the last finished one's
    assert len(pool) == 1 and pool.lookup("default", longer)[0] is kept[0]

    class FailingBuilder(TrieBuilder):
        def observe(self, tree, verdict, ctx=None):
            raise RuntimeError("boom")

    failing = SpeculativeDecoder(tiny, builder=FailingBuilder(), kv_pool=pool)
    with pytest.raises(RuntimeError):
        failing.generate(GenerationRequest(longer, max_new_tokens=6))
    assert len(pool) == 1 and pool.lookup("default", longer)[0] is kept[0]
    again = decoder.generate(GenerationRequest(prompt, max_new_tokens=6, session_id="s"))
    assert again.reused_tokens == len(prompt) - 1 and len(pool) == 1


def test_with_both_kinds_off_nothing_is_pooled(tiny):
    pool = PrefixKVPool(max_sessions=0, max_prefixes=0)
    decoder = SpeculativeDecoder(tiny, kv_pool=pool)
    for session in (None, "s", None):
        result = decoder.generate(GenerationRequest((5, 6, 7, 8), max_new_tokens=4, session_id=session))
        assert result.reused_tokens == 0
    assert len(pool) == 0 and pool.stats()["hits"] == 0


@pytest.mark.parametrize("source", ["prompt_lookup", "history"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_speculation_with_the_pool_matches_decoding_without_it(tiny, source, temperature):
    """Greedy: identical to plain decoding. Sampled: speculation draws differently from plain
    decoding (same law, other draws), so the reference is the same decoder without a pool."""
    rng = random.Random(11)
    plain = SpeculativeDecoder(tiny)
    make = PromptLookupSource if source == "prompt_lookup" else HistorySource
    reference = SpeculativeDecoder(tiny, [make()], TrieBuilder(max_nodes=16))
    pool = PrefixKVPool()
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


def test_pooled_entries_and_the_slab_share_the_kv_budget(tiny):
    """Finished requests' entries fill the pool only up to what the slab leaves of the budget; a new
    request that needs the room evicts them, and nothing is refused or fails for their sake."""
    rng = random.Random(15)
    pool = PrefixKVPool()
    probe = SpeculativeDecoder(tiny)
    per_token = probe.scheduler.kv.bytes_per_token
    budget = 3 * 64 * per_token  # one row of 64 slots, and room for about four finished requests
    decoder = SpeculativeDecoder(tiny, kv_pool=pool, batch_limits=BatchLimits(kv_budget_bytes=budget))
    plain = SpeculativeDecoder(tiny)
    for i in range(8):
        prompt = tuple(random_ids(rng, tiny.vocab_size, 30))
        got = decoder.generate(GenerationRequest(prompt, max_new_tokens=12))
        assert got.token_ids == plain.generate(GenerationRequest(prompt, max_new_tokens=12)).token_ids
        kv = decoder.scheduler.kv
        assert kv.allocated_bytes + pool.stats()["cached_tokens"] * per_token <= budget, i
    assert pool.stats()["evictions"] > 0 and len(pool) >= 1
