"""A request whose sources have had nothing to draft for a few steps rests them: its next steps
decode plainly without asking, in growing rests of 1, 2, then 4 steps with one probe between, so
a batch does not pay every row's source calls for rows with nothing to copy; a draft found by a
probe ends the rest. Only in a batch of ``builder.rest_min_rows`` requests or more, and a request
in the builder's cool-down is not asked either. In such a batch the steps also measure whether
asking pays at all at its size (``AskingValue``), and where it does not, most steps ask nobody.
Output stays plain greedy's."""

from __future__ import annotations

import time

import pytest
from batch_driver import drive, reference_greedy

from draftmesh.config import BuilderConfig
from draftmesh.draft.base import DraftContext, Proposal
from draftmesh.io_struct import GenerationRequest
from draftmesh.verify.decoder import SpeculativeDecoder
from draftmesh.verify.engine import build_decoder
from draftmesh.verify.tree_builder import CostAwareTreeBuilder, TrieBuilder


class Counting:
    """Silent until ``wake`` tokens have been generated, then drafts the next 3 true tokens."""

    name = "counting"

    def __init__(self, reference: list[int], wake: int) -> None:
        self.reference, self.wake = reference, wake
        self.asked_at: list[int] = []

    def propose(self, ctx: DraftContext) -> list[Proposal]:
        n = len(ctx.generated_ids)
        self.asked_at.append(n)
        truth = self.reference[n:][:3]
        return [Proposal(self.name, token_ids=tuple(truth))] if n >= self.wake and truth else []


@pytest.fixture
def llama():
    from tiny_models import tiny_target

    return tiny_target("llama")


def test_a_silent_source_is_rested_and_a_probe_that_finds_drafts_ends_the_rest(llama):
    req = GenerationRequest(prompt_ids=(5, 6, 7, 8), max_new_tokens=48)
    reference = list(SpeculativeDecoder(llama).generate(req).token_ids)
    assert len(reference) == 48
    source = Counting(reference, wake=30)
    result = SpeculativeDecoder(llama, [source], TrieBuilder(max_nodes=8), rest_min_rows=1,
                                asking_probe_every=0).generate(req)  # the rests alone: every step may ask
    assert list(result.token_ids) == reference  # resting changes the speed, never the output
    silent = [n for n in source.asked_at if n < 30]
    # dry 4 steps (asked at 0..3), rest 1 (4), probe 5, rest 2 (6, 7), probe 8, rest 4 (9..12), probe 13, ...
    assert silent[:7] == [0, 1, 2, 3, 5, 8, 13]
    assert len(silent) <= 30 // 5 + 4  # about one step in five once the rests reach 4 steps
    assert any(s.accepted for s in result.steps)  # once awake, its drafts were found and accepted


def test_without_rests_every_step_asks(llama):
    """The same run with resting off (``builder.rest_after`` 0): the source is asked at every step."""
    req = GenerationRequest(prompt_ids=(5, 6, 7, 8), max_new_tokens=48)
    reference = list(SpeculativeDecoder(llama).generate(req).token_ids)
    source = Counting(reference, wake=30)
    result = SpeculativeDecoder(llama, [source], TrieBuilder(max_nodes=8), rest_after=0, rest_min_rows=1).generate(req)
    assert list(result.token_ids) == reference
    assert [n for n in source.asked_at if n < 30] == list(range(30))


def test_rests_follow_the_builder_config(llama):
    """``builder.rest_after`` and ``builder.max_rest`` reach the decoder that ``build_decoder`` makes:
    2 dry steps, then rests of 1 and 2 steps (never longer), one probe between them."""
    req = GenerationRequest(prompt_ids=(5, 6, 7, 8), max_new_tokens=48)
    reference = list(SpeculativeDecoder(llama).generate(req).token_ids)
    source = Counting(reference, wake=30)
    config = BuilderConfig(rest_after=2, max_rest=2, rest_min_rows=1, asking_probe_every=0)
    decoder = build_decoder(llama, [], builder_config=config, extra_sources=[source], source_deadline_s=None)
    assert list(decoder.generate(req).token_ids) == reference
    # dry at 0, 1; rest 1 (2), probe 3, rest 2 (4, 5), probe 6, rest 2 (7, 8), probe 9, ...
    assert [n for n in source.asked_at if n < 30] == [0, 1, 3, 6, 9, 12, 15, 18, 21, 24, 27]


class Silent:
    """Never drafts; records which request asked at which generated length."""

    name = "silent"

    def __init__(self) -> None:
        self.asked: dict[str, list[int]] = {}

    def propose(self, ctx: DraftContext) -> list[Proposal]:
        self.asked.setdefault(ctx.request_id, []).append(len(ctx.generated_ids))
        return []


@pytest.mark.parametrize("requests, rests", [(1, False), (2, False), (3, True)])
def test_requests_rest_only_in_a_batch_of_rest_min_rows(llama, requests, rests):
    """``builder.rest_min_rows`` (3 by default): one or two requests ask at every step (asking
    costs a row ~0.5 ms and the trees pay the most there); from three on, a dry request rests."""
    source = Silent()
    decoder = SpeculativeDecoder(llama, [source], TrieBuilder(max_nodes=8), asking_probe_every=0)
    reqs = [GenerationRequest(prompt_ids=(5, 6, 7, 8 + i), max_new_tokens=24, request_id=f"r{i}") for i in range(requests)]
    results, rows = drive(decoder, [(0, req, None) for req in reqs])
    assert max(rows) == requests
    for i, req in enumerate(reqs):
        assert tuple(results[i].token_ids) == reference_greedy(llama, req.prompt_ids, 24)
        asked = source.asked[req.request_id]
        assert asked == ([0, 1, 2, 3, 5, 8, 13, 18] if rests else list(range(23))), asked  # the last token: nobody asked


@pytest.mark.parametrize("field, value", [("rest_after", -1), ("max_rest", 0), ("rest_min_rows", 0),
                                          ("asking_probe_every", -1)])
def test_bad_rest_settings_name_their_field(field, value):
    with pytest.raises(ValueError, match=f"builder.{field}"):
        BuilderConfig(**{field: value})


class Wrong:
    """Always drafts 2 tokens the target never picks."""

    name = "wrong"

    def __init__(self, reference: list[int], vocab: int) -> None:
        self.reference, self.vocab = reference, vocab
        self.asked_at: list[int] = []

    def propose(self, ctx: DraftContext) -> list[Proposal]:
        n = len(ctx.generated_ids)
        self.asked_at.append(n)
        return [Proposal(self.name, token_ids=((self.reference[n] + 1) % self.vocab, 3), confidence=1.0)]


def test_a_request_cooling_down_after_failed_trees_does_not_ask_its_sources(llama):
    """The builder's cool-down (``fallback_after`` trees in a row accepted nothing: ``cooldown_steps``
    plain steps) skips asking the sources too, as a rest does: their drafts would be dropped."""
    req = GenerationRequest(prompt_ids=(5, 6, 7, 8), max_new_tokens=24)
    reference = list(SpeculativeDecoder(llama).generate(req).token_ids)
    source = Wrong(reference, llama.vocab_size)
    builder = CostAwareTreeBuilder({1: 1.0, 64: 1.0}, BuilderConfig(fallback_after=2, cooldown_steps=3))
    result = SpeculativeDecoder(llama, [source], builder).generate(req)
    assert list(result.token_ids) == reference
    # two failed trees (0, 1), three plain steps unasked (2, 3, 4), two more (5, 6), ...
    assert source.asked_at == [0, 1, 5, 6, 10, 11, 15, 16, 20, 21]
    assert sum(1 for s in result.steps if s.tree_size) == len(source.asked_at)


class Always:
    """Drafts the next 3 true tokens at every step; records who asked at which generated length."""

    name = "always"

    def __init__(self, references: dict[str, list[int]]) -> None:
        self.references = references
        self.asked: dict[str, list[int]] = {}

    def propose(self, ctx: DraftContext) -> list[Proposal]:
        n = len(ctx.generated_ids)
        self.asked.setdefault(ctx.request_id, []).append(n)
        truth = self.references[ctx.request_id][n:][:3]
        return [Proposal(self.name, token_ids=tuple(truth))] if truth else []


def test_a_request_whose_drafts_the_budget_keeps_none_of_rests_its_sources(llama, monkeypatch):
    """A dry step is one of which nothing is verified: sources that draft at every step, in a batch
    whose budget keeps none of their nodes (here: it never does), cost every row their calls for
    nothing, so the requests rest them as they would silent ones; outputs stay plain greedy."""
    import draftmesh.verify.scheduler as scheduler_module

    monkeypatch.setattr(scheduler_module, "choose_nodes", lambda candidates, cost, **kw: [[] for _ in candidates])
    reqs = [GenerationRequest(prompt_ids=(5, 6, 7, 8 + i), max_new_tokens=24, request_id=f"r{i}") for i in range(3)]
    refs = {r.request_id: list(reference_greedy(llama, r.prompt_ids, 24)) for r in reqs}
    source = Always(refs)
    decoder = SpeculativeDecoder(llama, [source], CostAwareTreeBuilder({1: 1.0, 2: 1.05, 8: 1.1, 64: 2.0}),
                                 asking_probe_every=0)  # the rests alone
    results, rows = drive(decoder, [(0, req, None) for req in reqs])
    assert max(rows) == 3
    for i, req in enumerate(reqs):
        assert list(results[i].token_ids) == refs[req.request_id]
        assert source.asked[req.request_id] == [0, 1, 2, 3, 5, 8, 13, 18]


class Sleepy:
    """Never drafts, and takes ``delay_s`` to say so: asking it only costs the step time."""

    name = "sleepy"

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.calls = 0

    def propose(self, ctx: DraftContext) -> list[Proposal]:
        self.calls += 1
        time.sleep(self.delay_s)
        return []


class Oracle:
    """Drafts each request's next 4 true tokens (known by request id)."""

    name = "oracle"

    def __init__(self) -> None:
        self.truth: dict[str, tuple[int, ...]] = {}
        self.calls = 0

    def propose(self, ctx: DraftContext) -> list[Proposal]:
        self.calls += 1
        draft = self.truth[ctx.request_id][len(ctx.generated_ids):][:4]
        return [Proposal(self.name, token_ids=draft, confidence=1.0)] if draft else []


def _four_requests(llama, max_new: int):
    reqs = [GenerationRequest(prompt_ids=(5, 6, 7, 9 + i), max_new_tokens=max_new, request_id=f"r{i}")
            for i in range(4)]
    return reqs, {r.request_id: reference_greedy(llama, r.prompt_ids, max_new) for r in reqs}


@pytest.mark.parametrize("probe_every", [0, 4])
def test_where_asking_only_costs_time_the_batch_stops_asking(llama, probe_every):
    """Four requests whose source answers nothing, after 10 ms (and never rests: ``rest_after`` is
    longer than the run). Every other step asks until both kinds of step are measured; the steps
    that ask are far slower than those that ask nobody, so asking stops paying at 4 rows and from
    then on one step in ``asking_probe_every`` asks. With 0 every step asks. Outputs stay plain
    greedy's either way."""
    source = Sleepy(0.01)
    decoder = SpeculativeDecoder(llama, [source], TrieBuilder(max_nodes=8), rest_after=10_000,
                                 asking_probe_every=probe_every)
    reqs, want = _four_requests(llama, 96)
    results, rows = drive(decoder, [(0, req, None) for req in reqs])
    assert {r.request_id: tuple(results[i].token_ids) for i, r in enumerate(reqs)} == want
    every_step = 4 * 95  # each request, at every step but its last (nothing left to draft for)
    asking = decoder.scheduler.asking
    if not probe_every:
        assert source.calls == every_step and asking.rates(4) is None
        return
    asks, silent = asking.rates(4)
    assert silent > 2 * asks and asking.pays(4) is False
    assert asking.silent[4][2] > 1.5 * asking.asking[4][2]  # once measured, 3 steps in 4 asked nobody
    assert source.calls < 0.6 * every_step
    assert decoder.batch_stats()["asking_rates"]["4"] == [round(asks, 1), round(silent, 1)]


def test_where_asking_pays_the_batch_goes_on_asking(llama):
    """The same four requests with a source that drafts their true continuations: the steps that ask
    make several times the tokens per second of the steps that ask nobody, so once both are measured
    every step asks but the one in ``2 * asking_probe_every`` (16) that measures a silent step."""
    source = Oracle()
    decoder = SpeculativeDecoder(llama, [source], TrieBuilder(max_nodes=8))
    reqs, want = _four_requests(llama, 200)
    source.truth = want
    results, _ = drive(decoder, [(0, req, None) for req in reqs])
    assert {r.request_id: tuple(results[i].token_ids) for i, r in enumerate(reqs)} == want
    asking = decoder.scheduler.asking
    asks, silent = asking.rates(4)
    assert asks > 2 * silent and asking.pays(4) is True
    assert asking.asking[4][2] > 2 * asking.silent[4][2]


def test_a_batch_smaller_than_rest_min_rows_always_asks(llama):
    """Two requests (below ``builder.rest_min_rows``, 3) with the slow silent source: every step asks,
    and nothing is measured."""
    source = Sleepy(0.005)
    decoder = SpeculativeDecoder(llama, [source], TrieBuilder(max_nodes=8), rest_after=10_000, asking_probe_every=2)
    reqs, want = _four_requests(llama, 24)
    results, _ = drive(decoder, [(0, req, None) for req in reqs[:2]])
    assert source.calls == 2 * 23
    assert not decoder.scheduler.asking.asking and not decoder.scheduler.asking.silent
