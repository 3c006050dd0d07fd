"""Greedy losslessness of tree speculation on the real packaged models (see real_models.py)."""

from __future__ import annotations

import pytest
from real_models import PROMPTS, assert_identical_or_near_tie, chat_ids

from draftmesh.backend import TorchTarget
from draftmesh.draft.prompt_lookup import PromptLookupSource
from draftmesh.io_struct import GenerationRequest
from draftmesh.verify.decoder import SpeculativeDecoder
from draftmesh.verify.tree_builder import TrieBuilder

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("text", PROMPTS)
def test_smollm2_speculative_greedy_equals_plain(smollm2, text):
    prompt = chat_ids(smollm2, text)
    req = GenerationRequest(tuple(prompt), max_new_tokens=64)
    want = SpeculativeDecoder(smollm2).generate(req)
    got = SpeculativeDecoder(smollm2, [PromptLookupSource()], TrieBuilder(max_nodes=24)).generate(req)
    assert_identical_or_near_tie(smollm2, prompt, want.token_ids, got.token_ids)
    assert len(got.steps) <= len(want.steps)


def test_gemma3_speculative_greedy_equals_plain():
    target = TorchTarget.load("gemma3-270m")
    prompt = chat_ids(target, PROMPTS[2])
    req = GenerationRequest(tuple(prompt), max_new_tokens=48)
    want = SpeculativeDecoder(target).generate(req)
    got = SpeculativeDecoder(target, [PromptLookupSource()], TrieBuilder(max_nodes=24)).generate(req)
    assert_identical_or_near_tie(target, prompt, want.token_ids, got.token_ids)


@pytest.mark.parametrize("text", PROMPTS[:2])
def test_smollm2_seeded_sampling_is_the_same_with_and_without_speculation(smollm2, text):
    """Draws keyed by output position: the drafts (accepted or not) cannot change a seeded
    output. fp32 tree vs one-token logits differ by ~1e-5, so a flip would need two perturbed
    scores that close: not expected in 48 tokens."""
    from draftmesh.io_struct import SamplingParams, SpeculationParams

    prompt = tuple(chat_ids(smollm2, text))
    sampling = SamplingParams(0.7, top_p=0.95, seed=3)
    want = SpeculativeDecoder(smollm2).generate(GenerationRequest(prompt, max_new_tokens=48, sampling=sampling,
                                                                  speculation=SpeculationParams(enabled=False)))
    got = SpeculativeDecoder(smollm2, [PromptLookupSource()], TrieBuilder(max_nodes=24)).generate(
        GenerationRequest(prompt, max_new_tokens=48, sampling=sampling))
    assert got.token_ids == want.token_ids and got.text == want.text
    assert len(got.steps) < len(want.steps)  # the drafts were used
