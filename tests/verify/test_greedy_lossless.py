"""Greedy speculative output must be identical to plain greedy decoding, whatever the drafts."""

from __future__ import annotations

import random

import pytest

from draftmesh.draft.base import DraftContext, Proposal
from draftmesh.io_struct import GenerationRequest
from draftmesh.verify.decoder import SpeculativeDecoder
from draftmesh.verify.tree_builder import TrieBuilder

MODES = ("all_right", "all_wrong", "deep_chain", "wide", "duplicates", "mix")


class ScriptedSource:
    """Drafts built from the known plain continuation, corrupted in a chosen way (test double)."""

    name = "scripted"

    def __init__(self, reference: list[int], mode: str, vocab: int, seed: int) -> None:
        self.reference, self.mode, self.vocab = reference, mode, vocab
        self.rng = random.Random(seed)

    def _wrong(self, right: int | None) -> int:
        tok = self.rng.randrange(self.vocab)
        return tok if tok != right else (tok + 1) % self.vocab

    def _chain(self, truth: list[int], length: int, error_at: int | None) -> tuple[int, ...]:
        out = []
        for i in range(length):
            right = truth[i] if i < len(truth) else None
            out.append(self._wrong(right) if (error_at is not None and i >= error_at) or right is None else right)
        return tuple(out)

    def propose(self, ctx: DraftContext) -> list[Proposal]:
        truth = self.reference[len(ctx.generated_ids) :]
        mode = self.rng.choice(MODES[:-1]) if self.mode == "mix" else self.mode
        rng = self.rng
        if mode == "all_right":
            chains = [self._chain(truth, rng.randint(1, 8), None)]
        elif mode == "all_wrong":
            chains = [self._chain(truth, rng.randint(1, 6), 0) for _ in range(rng.randint(1, 3))]
        elif mode == "deep_chain":
            chains = [self._chain(truth, 12, rng.randrange(0, 13))]
        elif mode == "wide":
            chains = [self._chain(truth, rng.randint(1, 3), rng.choice([0, 1, None])) for _ in range(8)]
        else:  # duplicates: the same branches several times, sharing prefixes
            base = self._chain(truth, 6, rng.randrange(0, 7))
            chains = [base, base, base[:3], base[:2] + (self._wrong(None),)]
        return [Proposal(self.name, token_ids=c, confidence=rng.random()) for c in chains if c]


@pytest.mark.parametrize("mode", MODES)
def test_greedy_output_identical_to_plain(tiny, mode):
    plain = SpeculativeDecoder(tiny)
    for prompt_no in range(50 if mode == "mix" else 8):
        rng = random.Random(f"{mode}/{prompt_no}")  # str seeds are stable; hash() of a str changes per process
        prompt = tuple(rng.randrange(1, tiny.vocab_size) for _ in range(rng.randint(1, 40)))
        req = GenerationRequest(prompt, max_new_tokens=rng.randint(1, 24))
        want = plain.generate(req)
        source = ScriptedSource(want.token_ids, mode, tiny.vocab_size, seed=prompt_no)
        spec = SpeculativeDecoder(tiny, [source], TrieBuilder(max_nodes=rng.choice([4, 16, 64])))
        got = spec.generate(req)
        assert got.token_ids == want.token_ids, f"prompt {prompt_no}: {prompt}"
        assert got.text == want.text
        assert got.finish_reason == want.finish_reason
        if mode == "all_right" and len(want.token_ids) > 4:
            assert len(got.steps) < len(want.steps)  # correct drafts must actually be used


def test_stop_strings_cut_identically(tiny):
    plain = SpeculativeDecoder(tiny)
    rng = random.Random(7)
    for _ in range(10):
        prompt = tuple(rng.randrange(1, tiny.vocab_size) for _ in range(10))
        free = plain.generate(GenerationRequest(prompt, max_new_tokens=20))
        words = free.text.split()
        if len(words) < 6:
            continue
        stop = " ".join(words[3:5])  # a stop string that appears mid-generation
        req = GenerationRequest(prompt, max_new_tokens=20, stop=(stop,))
        want = plain.generate(req)
        spec = SpeculativeDecoder(tiny, [ScriptedSource(free.token_ids, "all_right", tiny.vocab_size, 0)])
        got = spec.generate(req)
        assert want.finish_reason == "stop" and got.finish_reason == "stop"
        assert stop not in want.text and want.text == free.text[: free.text.index(stop)]
        assert got.text == want.text and got.token_ids == want.token_ids


def test_streamed_deltas_concatenate_to_the_final_text(tiny):
    rng = random.Random(8)
    prompt = tuple(rng.randrange(1, tiny.vocab_size) for _ in range(12))
    free = SpeculativeDecoder(tiny).generate(GenerationRequest(prompt, max_new_tokens=30))
    spec = SpeculativeDecoder(tiny, [ScriptedSource(free.token_ids, "mix", tiny.vocab_size, 1)])
    events = list(spec.stream(GenerationRequest(prompt, max_new_tokens=30)))
    result = events[-1]
    streamed = "".join(e.text for e in events[:-1])
    assert streamed == result.text == free.text
    assert tuple(t for e in events[:-1] for t in e.token_ids) == result.token_ids
    assert sum(e.record.emitted for e in events[:-1]) == len(result.token_ids)
