"""Bad requests are ValueErrors that say what is wrong; nothing is generated for them."""

from __future__ import annotations

import pytest

from draftmesh.draft.base import Proposal
from draftmesh.io_struct import GenerationRequest, SamplingParams, SpeculationParams
from draftmesh.verify.decoder import SpeculativeDecoder


@pytest.fixture(scope="module")
def decoder():
    from tiny_models import tiny_target

    return SpeculativeDecoder(tiny_target("llama"))


def _lossy(policy: str, **params) -> SpeculationParams:
    return SpeculationParams(policy=policy, policy_params=params)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(prompt_ids=()), "prompt is empty"),
        (dict(prompt_ids=(1,) * 256), "model context is 256"),
        (dict(prompt_ids=(1, 2), max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
        (dict(prompt_ids=(1, 2), max_new_tokens=-5), "max_new_tokens must be an integer >= 1"),
        (dict(prompt_ids=(1, 2), max_new_tokens=255), "exceeds the model context"),
        (dict(prompt_ids=(1, 999)), "outside the vocabulary"),
        (dict(prompt_ids=(1, 2), stop=("",)), "stop strings must be non-empty"),
        # A lossy policy that would accept everything is refused, naming the parameter (the replica
        # answers a ValueError with Rejected, the router with INVALID_ARGUMENT).
        (dict(prompt_ids=(1, 2), speculation=_lossy("typical", epsilon=0.0)), r"typical policy: epsilon"),
        (dict(prompt_ids=(1, 2), speculation=_lossy("nkl", delta_max=3.0)), r"nkl policy: delta_max"),
        (dict(prompt_ids=(1, 2), speculation=_lossy("semantic", threshold=0.1)), r"semantic policy: threshold"),
    ],
)
def test_bad_requests(decoder, kwargs, message):
    with pytest.raises(ValueError, match=message):
        decoder.generate(GenerationRequest(**kwargs))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-0.1), r"temperature: must be a finite number in \[0, 100\], got -0.1"),
        (dict(temperature=float("nan")), "temperature: must be a finite number"),
        (dict(temperature=float("inf")), "temperature: must be a finite number"),
        (dict(temperature=101.0), r"temperature: must be a finite number in \[0, 100\]"),
        (dict(temperature="hot"), "temperature: must be a finite number"),
        (dict(top_p=0.0), r"top_p: must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p: must be in \(0, 1\]"),
        (dict(top_k=-1), "top_k: must be an integer in"),
        (dict(top_k=2_000_000), "top_k: must be an integer in"),
        (dict(seed=-3), "seed: must be a non-negative integer"),
    ],
)
def test_bad_sampling_parameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_a_source_drafting_outside_the_vocabulary_is_dropped_not_fatal(decoder):
    class Bad:
        name = "bad"

        def propose(self, ctx):
            return [Proposal("bad", token_ids=(10_000,)), Proposal("bad", token_ids=(-1, 2))]

    want = decoder.generate(GenerationRequest((1, 2, 3), max_new_tokens=6))
    got = SpeculativeDecoder(decoder.target, [Bad()]).generate(GenerationRequest((1, 2, 3), max_new_tokens=6))
    assert got.token_ids == want.token_ids
    assert got.steps[0].failed_sources == ("bad",) and got.steps[0].tree_size == 0


def test_a_raising_source_is_skipped_and_counted(decoder):
    class Broken:
        name = "broken"

        def propose(self, ctx):
            raise RuntimeError("boom")

    want = decoder.generate(GenerationRequest((1, 2, 3), max_new_tokens=8))
    got = SpeculativeDecoder(decoder.target, [Broken()]).generate(GenerationRequest((1, 2, 3), max_new_tokens=8))
    assert got.token_ids == want.token_ids
    # a request alone never rests its sources (builder.rest_min_rows): asked, failed and counted at each step
    assert all(step.failed_sources == ("broken",) for step in got.steps[:-1])


def test_invalid_proposals_are_rejected_at_construction():
    with pytest.raises(ValueError, match="exactly one of token_ids or text"):
        Proposal("x")
    with pytest.raises(ValueError, match="token_probs length"):
        Proposal("x", token_ids=(1, 2), token_probs=(0.5,))


def test_a_hanging_source_misses_its_deadline_and_never_stalls_a_step(decoder):
    import threading
    import time

    release = threading.Event()

    class Hangs:
        name = "hangs"

        def propose(self, ctx):
            release.wait(5)
            return []

    req = GenerationRequest((1, 2, 3), max_new_tokens=6)
    want = decoder.generate(req)
    spec = SpeculativeDecoder(decoder.target, [Hangs()], source_deadline_s=0.02)
    t0 = time.perf_counter()
    got = spec.generate(req)
    elapsed = time.perf_counter() - t0
    release.set()
    assert got.token_ids == want.token_ids
    assert elapsed < 2.0  # 5 steps, each waits at most the deadline
    reasons = [s.failed_sources for s in got.steps[:-1]]
    assert reasons[0] == ("hangs",) and all(r == ("hangs",) for r in reasons)  # alone: asked at every step
    assert got.source_stats()["hangs"]["failed_steps"] == len(got.steps) - 1


def test_source_names_must_be_unique(decoder):
    from draftmesh.draft.prompt_lookup import PromptLookupSource

    with pytest.raises(ValueError, match="unique"):
        SpeculativeDecoder(decoder.target, [PromptLookupSource(), PromptLookupSource()])


def test_a_late_answer_drafts_the_next_step_of_the_same_request(decoder):
    """A source slower than the step deadline still contributes, one step behind."""
    import time

    req = GenerationRequest((1, 2, 3), max_new_tokens=24)
    want = decoder.generate(req).token_ids

    class SlowOracle:
        """Knows the answer but always answers after the deadline."""

        name = "slow"

        def propose(self, ctx):
            time.sleep(0.07)
            done = len(ctx.token_ids) - ctx.prompt_len
            return [Proposal("slow", token_ids=tuple(want[done : done + 12]))]

    class Pacer:
        """Makes every step last 30 ms, like a real model's forward."""

        name = "pacer"

        def propose(self, ctx):
            time.sleep(0.03)
            return []

    spec = SpeculativeDecoder(decoder.target, [SlowOracle(), Pacer()], source_deadline_s=0.05)
    got = spec.generate(req)
    assert got.token_ids == want
    stats = got.source_stats()["slow"]
    assert stats["accepted"] > 0  # only late answers can have been accepted
    assert stats["failed_steps"] >= 1  # the first step had nothing to fall back on


def test_advance_drops_drafts_that_no_longer_apply():
    from draftmesh.draft.base import advance

    p = Proposal("x", token_ids=(5, 6, 7, 8), token_probs=(0.9, 0.8, 0.7, 0.6))
    moved = advance(p, (5, 6))
    assert moved.token_ids == (7, 8) and moved.token_probs == (0.7, 0.6)
    assert advance(p, (5, 9)) is None  # the target went elsewhere
    assert advance(p, (5, 6, 7, 8)) is None  # nothing left to draft
    assert advance(Proposal("x", text="hello"), ()) is None
