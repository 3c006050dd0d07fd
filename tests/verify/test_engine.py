"""The wired engine: all default sources on, per-request options, losslessness end to end."""

from __future__ import annotations

import random

import pytest
from tiny_models import tiny_target

from draftmesh.io_struct import GenerationRequest, SpeculationParams
from draftmesh.verify.engine import build_decoder


@pytest.fixture(scope="module")
def target():
    return tiny_target("gemma3", seed=3)


@pytest.fixture(scope="module")
def decoders(target):
    return build_decoder(target, []), build_decoder(target)


def test_all_default_sources_are_lossless_on_random_models(target, decoders):
    plain, spec = decoders
    assert [s.name for s in spec.sources] == ["history", "rules", "rag"]
    rng = random.Random(0)
    prompts = [tuple(rng.randrange(1, 64) for _ in range(rng.randint(3, 40))) for _ in range(12)]
    prompts += prompts[:4]  # repeated questions: the answer store drafts the earlier answers
    for i, prompt in enumerate(prompts):
        docs = (" ".join(f"w{rng.randrange(1, 64)}" for _ in range(60)),) if i % 3 == 0 else ()
        req = GenerationRequest(prompt, max_new_tokens=24, documents=docs, session_id="s" if i % 2 else None)
        want, got = plain.generate(req), spec.generate(req)
        assert got.token_ids == want.token_ids, f"prompt {i}"
        if i >= 12 and len(want.token_ids) > 4:
            assert got.mean_accepted_per_step > 2.0  # the stored answer is drafted
            assert sum(s.accepted_by_source.get("history", 0) for s in got.steps) > 0


def test_per_request_source_selection_caps_and_switches(target, decoders):
    plain, spec = decoders
    prompt = (5, 6, 7, 8, 5, 6, 7, 8, 5, 6)
    spec.generate(GenerationRequest(prompt, max_new_tokens=16))  # remembered by history
    only_rules = spec.generate(GenerationRequest(prompt, max_new_tokens=16, speculation=SpeculationParams(sources=("rules",))))
    assert all("history" not in s.proposed_by_source for s in only_rules.steps)
    off = spec.generate(GenerationRequest(prompt, max_new_tokens=16, speculation=SpeculationParams(enabled=False)))
    assert all(s.tree_size == 0 for s in off.steps)
    zero = spec.generate(GenerationRequest(prompt, max_new_tokens=16, speculation=SpeculationParams(max_nodes=0)))
    assert all(s.tree_size == 0 for s in zero.steps)
    capped = spec.generate(GenerationRequest(prompt, max_new_tokens=16, speculation=SpeculationParams(max_nodes=2)))
    assert all(s.tree_size <= 2 for s in capped.steps)
    one = spec.generate(GenerationRequest(prompt, max_new_tokens=16, speculation=SpeculationParams(source_caps={"history": 1})))
    assert all(s.tree_size <= 1 + 8 for s in one.steps)  # history adds at most one node
    want = plain.generate(GenerationRequest(prompt, max_new_tokens=16)).token_ids
    assert only_rules.token_ids == off.token_ids == zero.token_ids == capped.token_ids == one.token_ids == want


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(sources=("nope",)), "unknown draft source 'nope'"),
        (dict(source_caps={"nope": 2}), "unknown draft source 'nope'"),
        (dict(source_caps={"rules": -1}), r"speculation.source_caps\[rules\]: must be an integer"),
        (dict(max_nodes=-2), "speculation.max_nodes: must be an integer"),
        (dict(max_nodes=5000), "speculation.max_nodes: must be an integer"),
        (dict(policy="yolo"), "unknown acceptance policy 'yolo'"),
    ],
)
def test_bad_request_options(decoders, kwargs, message):
    with pytest.raises(ValueError, match=message):
        decoders[1].generate(GenerationRequest((1, 2, 3), max_new_tokens=4, speculation=SpeculationParams(**kwargs)))


def test_unknown_source_names_in_config_are_errors(target):
    with pytest.raises(ValueError, match="unknown draft source 'bogus'"):
        build_decoder(target, ["bogus"])
    with pytest.raises(ValueError, match="unknown draft sources: bogus"):
        build_decoder(target, [], source_options={"bogus": {}})
    with pytest.raises(ValueError, match="bad options for draft source 'history'"):
        build_decoder(target, ["history"], source_options={"history": {"no_such_option": 1}})


@pytest.mark.slow
def test_smollm2_all_sources_greedy_equals_plain(smollm2):
    from real_models import PROMPTS, assert_identical_or_near_tie

    from draftmesh.prompts import encode_messages

    plain, spec = build_decoder(smollm2, []), build_decoder(smollm2)
    for text in PROMPTS[:3] + PROMPTS[:1]:  # the last one repeats: answer-store drafts
        prompt = encode_messages(smollm2.tokenizer, [{"role": "user", "content": text}])
        req = GenerationRequest(tuple(prompt), max_new_tokens=48)
        want, got = plain.generate(req), spec.generate(req)
        assert_identical_or_near_tie(smollm2, prompt, want.token_ids, got.token_ids)
    assert len(got.steps) <= len(want.steps) / 2  # the remembered answer is drafted
    assert sum(s.accepted_by_source.get("history", 0) for s in got.steps) >= len(got.token_ids) / 2
