"""The verifier feeds the recycle source the target's own successors of every step's inputs,
under the request's tenant; its drafts are accepted and every output stays plain greedy, in a
batch (float64 random-weight Llama and Gemma 3)."""

from __future__ import annotations

import random

import pytest
import torch
from batch_driver import drive, reference_greedy

from draftmesh.backend import KVState
from draftmesh.draft.recycle import RecycleSource
from draftmesh.io_struct import GenerationRequest, SpeculationParams
from draftmesh.verify.decoder import SpeculativeDecoder
from draftmesh.verify.tree_builder import CostAwareTreeBuilder


def successors_by_input(target, prompt, generated, k: int) -> dict[int, tuple[list[int], list[float]]]:
    """Plain decoding's top-k successors (ids, probabilities) after each input, its last occurrence winning."""
    state = KVState()
    target.prefill(state, list(prompt[:-1]))
    out = {}
    for tok in (prompt[-1], *generated[:-1]):
        logits = target.step(state, tok)[0].double()
        top = torch.topk(logits, k)
        out[tok] = (top.indices.tolist(), torch.softmax(logits, -1)[top.indices].tolist())
    return out


def test_each_steps_successors_are_fed_under_the_requests_tenant(tiny):
    rng = random.Random(1)
    prompt = tuple(rng.randrange(1, tiny.vocab_size) for _ in range(12))
    source = RecycleSource(tiny.vocab_size, top_k=3, min_prob=0.0)
    decoder = SpeculativeDecoder(tiny, [source])
    req = GenerationRequest(prompt, max_new_tokens=20, tenant="acme", speculation=SpeculationParams(enabled=False))
    result = decoder.generate(req)
    assert list(source._tables) == ["acme"]  # nothing under any other tenant
    table = source._tables["acme"]
    want = successors_by_input(tiny, prompt, result.token_ids, 3)
    for tok, (ids, probs) in want.items():
        assert table.ids[tok].tolist() == ids, f"input {tok}"
        assert table.probs[tok].tolist() == pytest.approx(probs, abs=1e-6)
    fed = set(want)
    never = [t for t in range(tiny.vocab_size) if t not in fed]
    assert (table.ids[never] == -1).all()  # only the step's inputs have rows


def test_recycled_drafts_are_accepted_and_every_output_stays_plain_greedy(tiny):
    """Two rounds of a batch of requests: the second round drafts from what the first one's steps
    saw, its recycled nodes are accepted, and every output equals its own batch-1 greedy output."""
    rng = random.Random(7)
    prompts = [tuple(rng.randrange(1, tiny.vocab_size) for _ in range(rng.randint(3, 30))) for _ in range(4)]
    want = [reference_greedy(tiny, p, 24) for p in prompts]
    source = RecycleSource(tiny.vocab_size, min_prob=0.0)
    decoder = SpeculativeDecoder(tiny, [source], CostAwareTreeBuilder({1: 1.0, 64: 1.0}), asking_probe_every=0)
    accepted = []
    for round_ in range(2):
        schedule = [(i, GenerationRequest(p, max_new_tokens=24, request_id=f"r{round_}-{i}"), None)
                    for i, p in enumerate(prompts)]
        results, rows = drive(decoder, schedule)
        assert max(rows) >= 2
        for i, result in results.items():
            assert result.token_ids == want[i], f"round {round_}, request {i}"
        accepted.append(sum(r.source_stats().get("recycle", {}).get("accepted", 0) for r in results.values()))
    assert accepted[1] > 0
    assert decoder.scheduler.kv.rows == 0


def test_a_source_that_fails_to_observe_only_drafts_less(tiny):
    class Broken(RecycleSource):
        def observe_successors(self, tenant, inputs, ids, probs):
            raise RuntimeError("observe broke")

    rng = random.Random(3)
    prompt = tuple(rng.randrange(1, tiny.vocab_size) for _ in range(9))
    decoder = SpeculativeDecoder(tiny, [Broken(tiny.vocab_size)])
    assert decoder.generate(GenerationRequest(prompt, max_new_tokens=12)).token_ids == reference_greedy(tiny, prompt, 12)


def test_a_step_whose_successors_cannot_be_read_still_decodes(tiny, monkeypatch):
    import draftmesh.verify.request_run as request_run

    def broken(*args):
        raise RuntimeError("top-k broke")

    monkeypatch.setattr(request_run, "_successors", broken)
    rng = random.Random(5)
    prompt = tuple(rng.randrange(1, tiny.vocab_size) for _ in range(7))
    source = RecycleSource(tiny.vocab_size)
    decoder = SpeculativeDecoder(tiny, [source])
    assert decoder.generate(GenerationRequest(prompt, max_new_tokens=10)).token_ids == reference_greedy(tiny, prompt, 10)
    assert source.nbytes == 0  # it learned nothing, and the request did not fail


def test_without_such_a_source_no_step_reads_successors(tiny):
    decoder = SpeculativeDecoder(tiny)
    assert decoder.successor_k == 0
    rng = random.Random(4)
    prompt = tuple(rng.randrange(1, tiny.vocab_size) for _ in range(5))
    ticket = decoder.submit(GenerationRequest(prompt, max_new_tokens=3))
    assert ticket.run.successor_k == 0
    decoder.scheduler.cancel(ticket)
