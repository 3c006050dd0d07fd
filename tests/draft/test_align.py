"""TextAligner against both packaged tokenizers (byte-level BPE and SentencePiece-style)."""

from __future__ import annotations

import os
import random

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from draftmesh.draft.align import TextAligner  # noqa: E402
from draftmesh.models import load_tokenizer  # noqa: E402

SENTENCES = [
    "The Federal Reserve raised interest rates by a quarter point on Wednesday.",
    "I moved to New York City in 2019, and I've loved it ever since!",
    "def add(self, x: int) -> int:\n    return self.total + x\n",
    '{"name": "Ada Lovelace", "born": 1815, "tags": ["math", "computing"]}',
    "Le café était délicieux, mais l'addition était salée.",
    "我们今天去公园散步，天气非常好。",
    "Great job 🎉🎉 — see you tomorrow at 5:30 p.m. 😀",
    "  Indented line\n\n\tTabbed line with trailing spaces   \n",
    "Massachusetts Institute of Technology (MIT) is in Cambridge, Massachusetts.",
    "for i in range(10):\n    if i % 2 == 0:\n        print(f\"even: {i}\")\n",
]

# A character both tokenizers split into several byte tokens.
SPLIT_CHAR = "\U00013000"


@pytest.fixture(scope="module", params=["smollm2-135m", "gemma3-270m"])
def tokenizer(request):
    return load_tokenizer(request.param)


@pytest.fixture(scope="module")
def aligner(tokenizer):
    return TextAligner(tokenizer)


def enc(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def dec(tokenizer, ids) -> str:
    return tokenizer.decode(list(ids), clean_up_tokenization_spaces=False)


def assert_faithful(tokenizer, committed_ids, draft: str, aligned) -> None:
    """committed + aligned must spell the committed text followed by a prefix of the draft."""
    committed_text = dec(tokenizer, committed_ids)
    spelled = dec(tokenizer, list(committed_ids) + list(aligned))
    assert spelled.startswith(committed_text)
    assert draft.startswith(spelled[len(committed_text) :])


def assert_prefix_of_whole(tokenizer, committed_text: str, draft: str, aligned) -> None:
    """When the whole text tokenizes as committed + more, aligned is a prefix of the more."""
    committed = enc(tokenizer, committed_text)
    whole = enc(tokenizer, committed_text + draft)
    assert whole[: len(committed)] == committed, "test case must split at a token boundary"
    assert whole[len(committed) : len(committed) + len(aligned)] == list(aligned)


@pytest.mark.parametrize(
    ("committed_text", "draft"),
    [
        pytest.param("The cat sat on the", " mat and then fell asleep.", id="word"),
        pytest.param("Hello", "  world,  how are you?  ", id="whitespace"),
        pytest.param("First line.", "\n\nSecond line follows here.\n", id="newlines"),
        pytest.param("She asked", ': "Why not?" Then she left.', id="punctuation"),
        pytest.param("def area(self", ", width, height):\n    return width * height\n", id="code"),
        pytest.param("Le café", " était délicieux, 中文字符 😀 et voilà", id="utf8"),
    ],
)
def test_continuation_is_faithful_and_canonical(tokenizer, aligner, committed_text, draft):
    committed = enc(tokenizer, committed_text)
    aligned = aligner.align(committed, draft)
    assert aligned, "a multi-token draft at a clean boundary must align to something"
    assert_faithful(tokenizer, committed, draft, aligned)
    assert_prefix_of_whole(tokenizer, committed_text, draft, aligned)


def test_last_token_is_never_proposed(tokenizer, aligner):
    committed_text, draft = "The cat sat on the", " mat and then fell asleep"
    committed = enc(tokenizer, committed_text)
    remainder = enc(tokenizer, committed_text + draft)[len(committed) :]
    aligned = aligner.align(committed, draft)
    assert list(aligned) == remainder[: len(aligned)]
    assert len(aligned) < len(remainder)
    assert not dec(tokenizer, aligned).endswith("asleep")


def test_unfinished_word_is_dropped_whole(tokenizer, aligner):
    """Pieces of a word cut short could re-merge once the word goes on."""
    draft = " Massachusetts Instit"
    aligned = aligner.align(enc(tokenizer, "He studied at"), draft)
    assert dec(tokenizer, aligned) in ("", " Massachusetts")


def test_draft_continuing_inside_a_word(tokenizer, aligner):
    """'Re' is committed, so 'serve' must start a new token: the joint form is unreachable."""
    committed = enc(tokenizer, "The Federal Re")
    aligned = aligner.align(committed, "serve Bank said")
    assert dec(tokenizer, aligned).startswith("serve")
    assert list(aligned[: len(enc(tokenizer, "serve"))]) == enc(tokenizer, "serve")
    assert_faithful(tokenizer, committed, "serve Bank said", aligned)
    # alone, "serve" is one unstable last token ("served", "serves", ...)
    assert aligner.align(committed, "serve") == ()


def test_multibyte_characters_are_never_split(tokenizer, aligner):
    committed = enc(tokenizer, "Fun:")
    for draft in (f" {SPLIT_CHAR}{SPLIT_CHAR} x", " 😀😀 y", " 中文字符很多 z", f" a {SPLIT_CHAR}"):
        aligned = aligner.align(committed, draft)
        assert "\ufffd" not in dec(tokenizer, committed + list(aligned))
        assert_faithful(tokenizer, committed, draft, aligned)


def test_empty_draft(tokenizer, aligner):
    assert aligner.align(enc(tokenizer, "Anything"), "") == ()
    assert aligner.align([], "") == ()


def test_empty_committed(tokenizer, aligner):
    draft = "Hello there, friend"
    aligned = aligner.align([], draft)
    assert list(aligned) == enc(tokenizer, draft)[: len(aligned)]
    assert aligned


def test_odd_text_never_raises(tokenizer, aligner):
    committed = enc(tokenizer, "Odd:")
    specials = set(tokenizer.all_special_ids)
    for draft in ("\ud800 lone surrogate", "\x00\x01 ctrl", "\ufffd rep", "x" * 5000, "\r\n\r\n", " " * 40):
        aligned = aligner.align(committed, draft)
        assert isinstance(aligned, tuple)
    for token in tokenizer.all_special_tokens:
        aligned = aligner.align(committed, f" a b {token} c d e")
        assert not specials.intersection(aligned)


def test_split_character_in_committed_tail_gives_nothing(tokenizer, aligner):
    """A tail ending inside a character cannot anchor the draft at any lookback."""
    committed = enc(tokenizer, f"ok {SPLIT_CHAR}")[:-1]
    assert aligner.align(committed, " and more text here") == ()


def test_non_canonical_tail_shrinks_the_lookback(tokenizer, aligner):
    """Committed ids the tokenizer would not produce ('Re'+'serve') anchor on the shorter tail."""
    serve = enc(tokenizer, "serve")
    committed = enc(tokenizer, "The Federal Re") + serve
    assert enc(tokenizer, dec(tokenizer, committed)) != committed
    draft = " Bank said on Tuesday"
    aligned = aligner.align(committed, draft)
    assert aligned
    assert_faithful(tokenizer, committed, draft, aligned)
    assert list(aligned) == enc(tokenizer, "serve" + draft)[len(serve) : len(serve) + len(aligned)]


def test_random_splits_of_real_sentences(tokenizer, aligner):
    """Aligned ids are what the tokenizer gives the whole text, whatever the lookback sees."""
    rng = random.Random(20240611)
    clean = aligned_any = 0
    for sentence in SENTENCES:
        for _ in range(12):
            cut = rng.randrange(1, len(sentence))
            committed_text, draft = sentence[:cut], sentence[cut:]
            committed = enc(tokenizer, committed_text)
            aligned = aligner.align(committed, draft)
            assert_faithful(tokenizer, committed, draft, aligned)
            whole = enc(tokenizer, sentence)
            if whole[: len(committed)] == committed:
                clean += 1
                aligned_any += bool(aligned)
                assert whole[len(committed) : len(committed) + len(aligned)] == list(aligned)
    assert clean >= 30
    assert aligned_any >= clean // 2


def test_short_lookback_still_matches_full_context(tokenizer):
    aligner = TextAligner(tokenizer, lookback=2)
    for sentence in SENTENCES:
        cut = sentence.rfind(" ", 0, len(sentence) // 2 + 1)
        if cut <= 0:
            continue
        committed_text, draft = sentence[:cut], sentence[cut:]
        committed = enc(tokenizer, committed_text)
        aligned = aligner.align(committed, draft)
        assert_faithful(tokenizer, committed, draft, aligned)
        if enc(tokenizer, sentence)[: len(committed)] == committed:
            assert_prefix_of_whole(tokenizer, committed_text, draft, aligned)


def test_rejects_slow_tokenizers_and_bad_settings(tokenizer):
    with pytest.raises(TypeError):
        TextAligner(object())
    with pytest.raises(ValueError):
        TextAligner(tokenizer, lookback=0)


@pytest.mark.parametrize("spec", ["smollm2-135m", "gemma3-270m"])
def test_complete_text_keeps_its_last_token(spec):
    from draftmesh.draft.align import TextAligner
    from draftmesh.models import load_tokenizer

    tok = load_tokenizer(spec)
    aligner = TextAligner(tok)
    committed = tok.encode("The chair of the Federal Re", add_special_tokens=False)
    assert aligner.align(committed, "serve") == ()  # may still merge with what follows
    got = aligner.align(committed, "serve", complete=True)
    assert got and tok.decode(list(committed) + list(got)) == "The chair of the Federal Reserve"
    # trailing whitespace attaches to the next word and is never kept
    spaced = aligner.align(committed, "serve ", complete=True)
    assert spaced == got
