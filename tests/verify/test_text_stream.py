"""Streamed text and stop strings under every step size.

Two properties, over the real SmolLM2 tokenizer (byte-level BPE: half-decoded characters
show as "\\ufffd") on a tiny float64 model, and over the tiny models' word tokenizer:

- the streamed deltas add up to the final text however the request ends (EOS, length, stop),
  even when the text ends in a held-back stop-string prefix or an incomplete character;
- speculative greedy decoding with stop strings ends at the same token, with the same text,
  as plain greedy decoding (stop strings drawn by hypothesis from the plain output itself, and
  "\\ufffd", which only exists on a prefix whose character the next token completes).
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import tiny_target, word_tokenizer

from draftmesh.draft.base import DraftContext, Proposal
from draftmesh.io_struct import GenerationRequest, GenerationResult
from draftmesh.verify.decoder import SpeculativeDecoder
from draftmesh.verify.text_stream import WINDOW, TextStream
from draftmesh.verify.tree_builder import TrieBuilder


class Oracle:
    """Drafts the known plain continuation (right for a random length, then sometimes wrong),
    so that steps accept several tokens at once (test double)."""

    name = "oracle"

    def __init__(self, reference: tuple[int, ...], vocab: list[int], seed: int) -> None:
        self.reference, self.vocab = reference, vocab
        self.rng = random.Random(seed)

    def propose(self, ctx: DraftContext) -> list[Proposal]:
        truth = list(self.reference[len(ctx.generated_ids):])
        n = self.rng.randint(1, 10)
        chain = [truth[i] if i < len(truth) else self.rng.choice(self.vocab) for i in range(n)]
        if self.rng.random() < 0.3:
            chain[self.rng.randrange(n)] = self.rng.choice(self.vocab)
        return [Proposal(self.name, token_ids=tuple(chain), confidence=1.0)]


@pytest.fixture(scope="module")
def smol_tokenizer():
    from draftmesh.models import load_tokenizer

    return load_tokenizer("smollm2-135m")


@pytest.fixture(scope="module")
def byte_model(smol_tokenizer):
    """A tiny float64 Llama over the real SmolLM2 vocabulary whose output only ever picks from a
    mix of lone UTF-8 bytes (which decode to "\\ufffd" until their character is complete),
    non-ASCII characters and ASCII pieces, so that half-decoded characters are frequent."""
    tok = smol_tokenizer
    pieces = {i: tok.decode([i]) for i in range(len(tok))}
    fragments = [i for i, s in pieces.items() if s == "\ufffd"]
    wide = [i for i, s in pieces.items() if s and "\ufffd" not in s and any(ord(c) > 127 for c in s)]
    ascii_ = [i for i, s in pieces.items() if s.strip() and s.isascii() and s.isprintable()]
    rng = random.Random(0)
    allowed = rng.sample(fragments, 60) + rng.sample(wide, 40) + rng.sample(ascii_, 40)
    target = tiny_target("llama", tokenizer=tok, seed=3, attn="eager")
    with torch.no_grad():
        weight = target.model.get_output_embeddings().weight
        keep = torch.zeros(weight.shape[0], dtype=torch.bool)
        keep[allowed] = True
        weight[~keep] = 0.0
    return target, allowed


def stream_of(decoder, req) -> tuple[str, GenerationResult]:
    events = list(decoder.stream(req))
    result = events[-1]
    assert isinstance(result, GenerationResult)
    return "".join(e.text for e in events[:-1]), result


def test_the_byte_model_really_produces_half_decoded_characters(byte_model):
    """The premise of the property below (else it could not fail)."""
    target, allowed = byte_model
    out = SpeculativeDecoder(target).generate(GenerationRequest(tuple(allowed[:6]), max_new_tokens=40))
    prefixes = [target.tokenizer.decode(out.token_ids[:n]) for n in range(1, 41)]
    assert sum(p.endswith("\ufffd") for p in prefixes) >= 3
    assert any(ord(c) > 127 and c != "\ufffd" for c in out.text)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_speculative_stop_strings_end_where_plain_decoding_ends(byte_model, data):
    target, allowed = byte_model
    prompt = tuple(data.draw(st.lists(st.sampled_from(allowed), min_size=1, max_size=12), label="prompt"))
    max_new = data.draw(st.integers(1, 40), label="max_new_tokens")
    plain = SpeculativeDecoder(target)
    free = plain.generate(GenerationRequest(prompt, max_new_tokens=max_new))
    prefixes = [target.tokenizer.decode(free.token_ids[:n], skip_special_tokens=True) for n in range(1, len(free.token_ids) + 1)]
    texts = [free.text] + prefixes
    stop_piece = st.sampled_from(texts).flatmap(
        lambda t: st.tuples(st.integers(0, max(0, len(t) - 1)), st.integers(1, 4)).map(lambda ab: t[ab[0]: ab[0] + ab[1]]))
    stops = data.draw(st.lists(st.one_of(st.just("\ufffd"), stop_piece.filter(bool), st.text(min_size=1, max_size=3)),
                               min_size=1, max_size=3), label="stop")
    req = GenerationRequest(prompt, max_new_tokens=max_new, stop=tuple(stops))
    want_text, want = stream_of(plain, req)
    spec = SpeculativeDecoder(target, [Oracle(free.token_ids, allowed, seed=len(stops))], TrieBuilder(max_nodes=16))
    got_text, got = stream_of(spec, req)
    assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
    assert want_text == want.text and got_text == got.text
    assert not any(s in want.text for s in stops)


def test_a_stop_on_a_half_decoded_character_ends_the_speculative_path_too(byte_model):
    """The issue's case: stop=["\\ufffd"] with a step that completes the character."""
    target, allowed = byte_model
    plain = SpeculativeDecoder(target)
    checked = 0
    for seed in range(30):
        rng = random.Random(seed)
        prompt = tuple(rng.choice(allowed) for _ in range(5))
        free = plain.generate(GenerationRequest(prompt, max_new_tokens=30))
        req = GenerationRequest(prompt, max_new_tokens=30, stop=("\ufffd",))
        want = plain.generate(req)
        if want.finish_reason != "stop":
            continue
        spec = SpeculativeDecoder(target, [Oracle(free.token_ids, allowed, seed)], TrieBuilder(max_nodes=16))
        got = spec.generate(req)
        assert got.token_ids == want.token_ids and got.text == want.text and got.finish_reason == "stop"
        checked += 1
    assert checked >= 10


@pytest.mark.parametrize("end", ["length", "eos"])
def test_deltas_add_up_when_the_text_ends_in_a_held_back_stop_prefix(tiny, end):
    """The tail that could still have become a stop string is flushed when the request ends."""
    rng = random.Random(5)
    for _ in range(6):
        prompt = tuple(rng.randrange(1, tiny.vocab_size) for _ in range(8))
        free = SpeculativeDecoder(tiny).generate(GenerationRequest(prompt, max_new_tokens=24))
        target, want = tiny, free.token_ids
        if end == "eos":  # the tiny model seldom emits its EOS: make a token of its output the EOS
            k = len(want) // 2
            target = copy.copy(tiny)
            target.eos_token_ids = frozenset({want[k]})
            want = want[: want.index(want[k]) + 1]
        text = tiny.tokenizer.decode(want, skip_special_tokens=True)
        stop = text.split()[-1] + " never"  # the text ends in this stop string's first word
        req = GenerationRequest(prompt, max_new_tokens=24, stop=(stop,))
        for decoder in (SpeculativeDecoder(target), SpeculativeDecoder(target, [Oracle(want, list(range(tiny.vocab_size)), 1)])):
            streamed, result = stream_of(decoder, req)
            assert result.finish_reason == end and result.token_ids == want
            assert streamed == result.text == text


def test_deltas_add_up_when_the_text_ends_in_an_incomplete_character(byte_model):
    """A length limit that falls inside a character: the final text keeps its "\\ufffd", so must
    the stream (with and without stop strings)."""
    target, allowed = byte_model
    plain = SpeculativeDecoder(target)
    checked = 0
    for seed in range(40):
        rng = random.Random(seed)
        prompt = tuple(rng.choice(allowed) for _ in range(5))
        free = plain.generate(GenerationRequest(prompt, max_new_tokens=40))
        for n in range(1, len(free.token_ids) + 1):
            if target.tokenizer.decode(free.token_ids[:n]).endswith("\ufffd"):
                break
        else:
            continue
        for stop in ((), ("zzz",)):
            req = GenerationRequest(prompt, max_new_tokens=n, stop=stop)
            for decoder in (plain, SpeculativeDecoder(target, [Oracle(free.token_ids, allowed, seed)])):
                streamed, result = stream_of(decoder, req)
                assert result.text.endswith("\ufffd") and streamed == result.text
        checked += 1
        if checked >= 5:
            break
    assert checked >= 3


def test_text_stream_unit_flush_and_per_token_push(smol_tokenizer):
    """The stream by itself: a held-back tail and an incomplete character come out on flush;
    push sees a stop that only a prefix contains."""
    tok = smol_tokenizer
    ids = tok.encode("caf\u00e9 ol", add_special_tokens=False)
    assert tok.decode(ids) == "caf\u00e9 ol"
    stream = TextStream(tok, ("olé",))
    text = "".join(stream.push(ids[:n])[0] for n in range(1, len(ids) + 1))
    assert text == "caf\u00e9 " and stream.flush(ids) == "ol"
    byte_ids = [i for i in range(len(tok)) if tok.decode([i]) == "\ufffd"]
    lead = next(i for i in byte_ids if tok.convert_ids_to_tokens(i) == "\u00c3")  # byte 0xC3, first of "é"
    stream = TextStream(tok, ())
    assert stream.update(ids + [lead]) == "caf\u00e9 ol" and stream.flush(ids + [lead]) == "\ufffd"
    stream = TextStream(tok, ("\ufffd",))
    assert stream.push(ids + [lead]) == ("caf\u00e9 ol", True) and stream.final(ids + [lead]) == "caf\u00e9 ol"


class CountingTokenizer:
    """Counts the tokens handed to ``decode`` (test double around a real tokenizer)."""

    def __init__(self, tok) -> None:
        self.tok, self.decoded = tok, 0

    def decode(self, ids, **kw):
        self.decoded += len(ids)
        return self.tok.decode(ids, **kw)


@pytest.fixture(scope="module", params=["smollm2-135m", "gemma3-270m"])
def token_pool(request):
    """A real tokenizer and ids to draw from: lone UTF-8 bytes (byte-level BPE fragments, or
    SentencePiece byte-fallback tokens), pieces with non-ASCII characters, ASCII pieces with and
    without a leading space, and special tokens (skipped by the decode)."""
    from draftmesh.models import load_tokenizer

    tok = load_tokenizer(request.param)
    rng = random.Random(1)
    names = tok.convert_ids_to_tokens(list(range(len(tok))))
    fragments = [i for i, name in enumerate(names) if name and len(name) == 6 and name.startswith("<0x")]
    if not fragments:  # byte-level BPE: a lone byte decodes to "\ufffd"
        fragments = [i for i in range(len(tok)) if tok.decode([i]) == "\ufffd"]
    sample = rng.sample(range(len(tok)), 6000)
    pieces = {i: tok.decode([i]) for i in sample}
    wide = [i for i, s in pieces.items() if s and "\ufffd" not in s and any(ord(c) > 127 for c in s)]
    ascii_ = [i for i, s in pieces.items() if s.strip() and s.isascii()]
    special = list(tok.all_special_ids)
    assert len(fragments) >= 100 and len(wide) >= 20 and len(ascii_) >= 100 and special
    return tok, rng.sample(fragments, 100) + wide[:60] + ascii_[:100] + special


@settings(max_examples=80, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_incremental_text_equals_decoding_everything(token_pool, data):
    """Every prefix's text, as the stream computes it from its settled text and a window, is the
    tokenizer's decode of the whole prefix: fed one token at a time (stop strings) or a step of
    several (no stop strings)."""
    tok, pool = token_pool
    ids = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=60), label="ids")
    step = data.draw(st.integers(1, 5), label="tokens per call")
    stream = TextStream(tok, ())
    for n in list(range(step, len(ids), step)) + [len(ids)]:
        assert stream._text(ids[:n]) == tok.decode(ids[:n], skip_special_tokens=True), n


@pytest.mark.parametrize("step", [1, 2, 3, 5])
def test_a_run_of_skipped_tokens_longer_than_the_window_keeps_the_next_words_space(step):
    """Special tokens decode to nothing: a window made only of them gave the next word no
    context, and a word-joining decoder dropped its space ("w20w50"; seen in CI as a speculative
    text differing from plain over the same ids)."""
    tok = word_tokenizer(64)
    words = ["w20"] * 4 + ["w1"] * (WINDOW + 2) + ["w50"] * 3 + ["w0"] * (2 * WINDOW) + ["w7", "w8"]
    ids = tok.convert_tokens_to_ids(words)
    stream = TextStream(tok, ())
    for n in list(range(step, len(ids), step)) + [len(ids)]:
        assert stream._text(ids[:n]) == tok.decode(ids[:n], skip_special_tokens=True), n
    stream = TextStream(tok, ())
    deltas = "".join(stream.update(ids[:n]) for n in list(range(step, len(ids), step)) + [len(ids)]) + stream.flush(ids)
    assert deltas == tok.decode(ids, skip_special_tokens=True) == "w20 w20 w20 w20 w50 w50 w50 w7 w8"


def test_stop_strings_decode_a_long_output_in_linear_time(smol_tokenizer):
    """With stop strings every token is pushed alone; each push decodes a few tokens, not the
    whole output (which made a 2,000-token answer decode two million tokens)."""
    tok = CountingTokenizer(smol_tokenizer)
    paragraph = "Zürich's café served 3.5 crêpes — naïve, yet ☕ fine. "
    ids = smol_tokenizer.encode(paragraph * 120, add_special_tokens=False)
    assert len(ids) >= 2000
    stream = TextStream(tok, ("never appears", "\n\n"))
    streamed = "".join(stream.push(ids[:n])[0] for n in range(1, len(ids) + 1)) + stream.flush(ids)
    assert streamed == smol_tokenizer.decode(ids) == paragraph * 120
    assert tok.decoded <= 20 * len(ids)
