"""What a verifier replica records per step equals what the steps did (the Ray backend's rules
are enforced by MemoryMetrics, so a metric Ray would refuse fails here first)."""

from __future__ import annotations

import asyncio

import pytest

from draftmesh.draft.base import DraftContext, Proposal
from draftmesh.io_struct import ServedResult, ServeRequest, StepEvent
from draftmesh.metrics import MemoryMetrics
from draftmesh.verify.decoder import SpeculativeDecoder
from draftmesh.verify.metrics import VerifierMetrics
from draftmesh.verify.replica import VerifierReplica
from draftmesh.verify.tree_builder import TrieBuilder


class Oracle:
    """Drafts the next 3 tokens of a known continuation (all accepted under greedy)."""

    name = "oracle"

    def __init__(self, reference: list[int]) -> None:
        self.reference = reference

    def propose(self, ctx: DraftContext) -> list[Proposal]:
        truth = self.reference[len(ctx.generated_ids):][:3]
        return [Proposal(self.name, token_ids=tuple(truth))] if truth else []


class Wrong:
    """Drafts a token the target never picks first (rejected at once)."""

    name = "wrong"

    def __init__(self, reference: list[int], vocab: int) -> None:
        self.reference, self.vocab = reference, vocab

    def propose(self, ctx: DraftContext) -> list[Proposal]:
        truth = self.reference[len(ctx.generated_ids):]
        return [Proposal(self.name, token_ids=((truth[0] + 1) % self.vocab,))] if truth else []


class Broken:
    name = "broken"

    def propose(self, ctx: DraftContext) -> list[Proposal]:
        raise RuntimeError("down")


def run(replica: VerifierReplica, req: ServeRequest) -> list:
    async def collect():
        return [event async for event in replica.run(req)]

    return asyncio.run(collect())


@pytest.fixture
def llama():
    from tiny_models import tiny_target

    return tiny_target("llama")


def test_replica_records_steps_sources_and_queue_depth(llama):
    req = ServeRequest("r1", prompt="w5 w6 w7 w8", max_new_tokens=20)
    plain = SpeculativeDecoder(llama)
    reference = run(VerifierReplica(plain), req)[-1].result.token_ids
    decoder = SpeculativeDecoder(llama, [Oracle(reference), Wrong(reference, llama.vocab_size), Broken()],
                                 TrieBuilder(max_nodes=16))
    backend = MemoryMetrics()
    replica = VerifierReplica(decoder, name="r0", metrics=VerifierMetrics(backend, "r0"))
    events = run(replica, req)
    served = events[-1]
    assert isinstance(served, ServedResult) and served.replica == "r0"
    result = served.result
    assert result.token_ids == reference
    steps = [e.record for e in events if isinstance(e, StepEvent)]
    assert tuple(steps) == result.steps and len(steps) < len(reference)  # the oracle's drafts were used

    tags = {"replica": "r0"}
    assert backend.value("draftmesh_steps", **tags) == len(steps)
    assert backend.observed("draftmesh_tokens_per_step", **tags) == [s.emitted for s in steps]
    assert backend.observed("draftmesh_tree_nodes", **tags) == [s.tree_size for s in steps]
    assert backend.observed("draftmesh_draft_seconds", **tags) == [s.draft_s for s in steps]
    assert backend.observed("draftmesh_verify_seconds", **tags) == [s.verify_s for s in steps]
    stats = result.source_stats()
    for source in ("oracle", "wrong"):
        assert backend.value("draftmesh_source_tree_nodes", source=source, **tags) == stats[source]["nodes"] > 0
        assert backend.value("draftmesh_source_accepted_tokens", source=source, **tags) == stats[source]["accepted"]
    assert stats["oracle"]["accepted"] > 0 and stats["wrong"]["accepted"] == 0
    assert backend.value("draftmesh_source_failed_steps", source="broken", **tags) == stats["broken"]["failed_steps"] > 0
    assert backend.value("draftmesh_verifier_active_requests", **tags) == 0  # back to idle


def test_memory_backend_refuses_what_ray_refuses():
    backend = MemoryMetrics()
    counter = backend.counter("c", "", ("a",))
    with pytest.raises(ValueError):
        counter.inc(0, {"a": "x"})
    with pytest.raises(ValueError):
        counter.inc(1, {})  # a declared tag missing
    with pytest.raises(ValueError):
        counter.inc(1, {"a": "x", "b": "y"})
    with pytest.raises(ValueError):
        backend.histogram("h", "", (0, 1))


def test_replica_reports_the_bounded_caches_sizes(llama, redis_server):
    """Prefix KV, rag index, answer-store and Redis bytes as gauges, set after a request; prompt tokens
    and those the prefix pool held as counters."""
    import uuid

    from tiny_models import word_tokenizer

    from draftmesh.draft.history import HistorySource
    from draftmesh.draft.rag import RagSource
    from draftmesh.draft.redis_store import RedisAnswerStore
    from draftmesh.verify.prefix_kv import PrefixKVPool

    store = RedisAnswerStore.from_url(redis_server.url, prefix=f"test:{uuid.uuid4().hex}:", max_bytes=1 << 20)
    rag = RagSource(word_tokenizer(llama.vocab_size))
    decoder = SpeculativeDecoder(llama, [HistorySource(store), rag], TrieBuilder(max_nodes=8),
                                 kv_pool=PrefixKVPool(max_sessions=4))
    backend = MemoryMetrics()
    replica = VerifierReplica(decoder, name="r0", metrics=VerifierMetrics(backend, "r0"))
    req = ServeRequest("r1", prompt="w5 w6 w7 w8", max_new_tokens=6, session_id="s1", documents=("w9 w10 w11 w12",))
    assert isinstance(run(replica, req)[-1], ServedResult)
    tags = {"replica": "r0"}
    assert backend.value("draftmesh_answer_store_bytes", **tags) == store.nbytes() > 0
    assert backend.value("draftmesh_redis_used_bytes", **tags) > 0
    assert backend.value("draftmesh_rag_index_bytes", **tags) == 0  # the request's index was freed at its end
    assert backend.value("draftmesh_prefix_kv_bytes", **tags) > 0  # the session's KV stays pooled
    assert backend.value("draftmesh_prompt_tokens", **tags) == 4 and backend.value("draftmesh_prefix_cached_tokens", **tags) == 0
    again = ServeRequest("r2", prompt="w5 w6 w7 w8", max_new_tokens=6)  # no session: its prefix still comes from the pool
    assert isinstance(run(replica, again)[-1], ServedResult)
    assert backend.value("draftmesh_prompt_tokens", **tags) == 8 and backend.value("draftmesh_prefix_cached_tokens", **tags) == 3


def expected_sizes(step_tokens: list[int], interval: int) -> list[int]:
    """The rule, stated on token counts: the first step alone, then steps merged until >= interval."""
    sizes, pending = [step_tokens[0]], 0
    for n in step_tokens[1:]:
        pending += n
        if pending >= interval:
            sizes.append(pending)
            pending = 0
    return sizes + ([pending] if pending else [])


@pytest.mark.parametrize("drafts,interval", [(False, 2), (False, 4), (True, 6), (True, 64)])
def test_a_stream_interval_merges_steps_into_fewer_events_with_the_same_tokens_and_metrics(llama, drafts, interval):
    """``serve.stream_interval``: the first tokens go out at once, later steps are merged until an event
    holds ``interval`` tokens or the request ends; tokens, text and the result are those of one event per
    step, and the metrics still count every step."""
    req = ServeRequest("r1", prompt="w5 w6 w7 w8", max_new_tokens=20)
    reference = run(VerifierReplica(SpeculativeDecoder(llama)), req)[-1].result.token_ids

    def decoder():
        if not drafts:
            return SpeculativeDecoder(llama)
        return SpeculativeDecoder(llama, [Oracle(reference[:9])], TrieBuilder(max_nodes=4))  # drafts, then none

    one = run(VerifierReplica(decoder()), req)
    backend = MemoryMetrics()
    merged = run(VerifierReplica(decoder(), name="r0", metrics=VerifierMetrics(backend, "r0"), stream_interval=interval), req)
    per_step = [e for e in one if isinstance(e, StepEvent)]
    deltas = [e for e in merged if isinstance(e, StepEvent)]
    assert all(e.steps == 1 for e in per_step) and len(per_step) > 3
    assert merged[-1].result.token_ids == one[-1].result.token_ids == reference
    assert tuple(t for e in deltas for t in e.token_ids) == reference
    assert "".join(e.text for e in deltas) == "".join(e.text for e in per_step)
    assert deltas[0].token_ids == per_step[0].token_ids  # the first tokens were not held back
    assert [len(e.token_ids) for e in deltas] == expected_sizes([len(e.token_ids) for e in per_step], interval)
    assert len(deltas) < len(per_step)
    assert sum(e.steps for e in deltas) == len(per_step) == backend.value("draftmesh_steps", replica="r0")
    assert sum(e.record.emitted for e in deltas) == len(reference)
    accepted = sum(e.record.accepted_by_source.get("oracle", 0) for e in deltas)
    assert accepted == sum(e.record.accepted_by_source.get("oracle", 0) for e in per_step)
    assert (accepted > 0) == drafts
