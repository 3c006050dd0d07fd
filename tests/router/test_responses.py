"""Decoder results as proto messages (built by hand: no model, no server)."""

from __future__ import annotations

import pytest

from draftmesh.io_struct import GenerationResult, ServedResult, StepEvent, StepRecord
from draftmesh.router.responses import result_to_proto, step_to_proto
from draftmesh.v1 import generation_pb2 as pb


def records() -> list[StepRecord]:
    return [
        StepRecord(tree_size=8, accepted=3, emitted=4, draft_s=0.0015, verify_s=0.055,
                   nodes_by_source={"history": 5, "rag": 3}, accepted_by_source={"history": 3},
                   failed_sources=("llm",)),
        StepRecord(tree_size=0, accepted=0, emitted=1, draft_s=0.0, verify_s=0.04),
        StepRecord(tree_size=4, accepted=2, emitted=3, draft_s=0.002, verify_s=0.05,
                   nodes_by_source={"rag": 4}, accepted_by_source={"rag": 2}, lenient=1),
    ]


def test_step_to_proto():
    rec = records()[0]
    msg = step_to_proto(7, StepEvent(token_ids=[11, 12, 13, 14], text=" the cat", record=rec))
    assert isinstance(msg, pb.GenerateResponse)
    assert msg.WhichOneof("event") == "delta"
    d = msg.delta
    assert d.text == " the cat" and list(d.token_ids) == [11, 12, 13, 14]
    s = d.stats
    assert (s.step, s.tree_nodes, s.accepted, s.emitted) == (7, 8, 3, 4)
    assert s.draft_ms == pytest.approx(1.5, rel=1e-5) and s.verify_ms == pytest.approx(55.0, rel=1e-5)
    assert dict(s.accepted_by_source) == {"history": 3}
    assert list(s.failed_sources) == ["llm"]
    assert pb.GenerateResponse.FromString(msg.SerializeToString()) == msg


def test_step_with_empty_text():
    msg = step_to_proto(0, StepEvent(token_ids=[], text="", record=records()[1]))
    assert msg.delta.text == "" and list(msg.delta.token_ids) == []
    assert msg.delta.stats.tree_nodes == 0 and msg.delta.stats.emitted == 1


def make_result(**overrides) -> GenerationResult:
    fields = dict(
        token_ids=(1, 2, 3, 4, 5, 6, 7, 8), text="hello world", finish_reason="eos", prompt_tokens=20,
        steps=tuple(records()), seconds=0.25, first_token_s=0.012, policy="typical", lossless=False,
        lenient_tokens=1, reused_tokens=12,
    )
    fields.update(overrides)
    return GenerationResult(**fields)


def test_result_to_proto():
    res = result_to_proto(ServedResult(make_result(), "verifier-0"), "req-9")
    assert isinstance(res, pb.GenerateResult)
    assert (res.request_id, res.replica, res.text, res.finish_reason) == ("req-9", "verifier-0", "hello world", "eos")
    assert list(res.token_ids) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert (res.usage.prompt_tokens, res.usage.completion_tokens, res.usage.cached_prompt_tokens, res.usage.steps) == (
        20, 8, 12, 3)
    assert res.mean_accepted_per_step == pytest.approx(8 / 3)
    assert (res.policy, res.lossless, res.lenient_tokens) == ("typical", False, 1)
    assert res.seconds == pytest.approx(0.25) and res.first_token_ms == pytest.approx(12.0, rel=1e-5)

    assert [s.source for s in res.sources] == ["history", "llm", "rag"]
    by = {s.source: s for s in res.sources}
    assert (by["history"].nodes, by["history"].accepted_tokens, by["history"].failed_steps) == (5, 3, 0)
    assert by["history"].acceptance == pytest.approx(0.6)
    assert (by["rag"].nodes, by["rag"].accepted_tokens) == (7, 2)
    assert by["rag"].acceptance == pytest.approx(2 / 7)
    assert (by["llm"].nodes, by["llm"].accepted_tokens, by["llm"].failed_steps, by["llm"].acceptance) == (0, 0, 1, 0.0)

    wrapped = pb.GenerateResponse(result=res)
    assert pb.GenerateResponse.FromString(wrapped.SerializeToString()).result == res


def test_plain_result():
    res = make_result(token_ids=(4, 5), steps=(records()[1], records()[1]), policy="exact", lossless=True,
                      lenient_tokens=0, reused_tokens=0, finish_reason="length")
    out = result_to_proto(ServedResult(res, ""), "r")
    assert out.usage.steps == 2 and out.mean_accepted_per_step == 1.0 and len(out.sources) == 0
    assert out.lossless and out.policy == "exact" and out.finish_reason == "length"
    assert out.usage.cached_prompt_tokens == 0 and not out.HasField("factcheck")


def test_a_delta_covering_several_steps_carries_their_sums():
    first, second, third = (StepEvent(token_ids=(i,), text=f" w{i}", record=r) for i, r in enumerate(records()))
    merged = first.then(second).then(third)
    assert (merged.token_ids, merged.text, merged.steps) == ((0, 1, 2), " w0 w1 w2", 3)
    s = step_to_proto(9, merged).delta.stats
    assert (s.step, s.steps, s.tree_nodes, s.accepted, s.emitted) == (9, 3, 12, 5, 8)
    assert s.draft_ms == pytest.approx(3.5, rel=1e-5) and s.verify_ms == pytest.approx(145.0, rel=1e-5)
    assert dict(s.accepted_by_source) == {"history": 3, "rag": 2}
    assert list(s.failed_sources) == ["llm"]
    assert merged.record.nodes_by_source == {"history": 5, "rag": 7} and merged.record.lenient == 1
    assert step_to_proto(1, first).delta.stats.steps == 1
