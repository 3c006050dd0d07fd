"""Turn a text draft into target token ids that continue the committed ids exactly.

Sources that think in text (rules, external engines, a drafter with another tokenizer)
know the next characters, but the verifier needs target ids. Tokenizing the draft alone
ignores how it joins the committed text, and its last token may still merge with text
that follows, so both ends are handled once, here, for every text source alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_Draft = tuple[list[int], list[tuple[int, int]]]
"""Draft token ids and each one's (start, end) character span in the draft text."""


def _mid_word(text: str, pos: int) -> bool:
    """True if ``pos`` falls between two letters/digits of a space-delimited word.

    Such a cut leaves a word piece that more letters could re-merge ("Inst" + "itute").
    Uncased letters (CJK, ...) are excluded: those scripts have no word spaces, so every
    boundary would qualify and nothing could ever be kept.
    """
    if not 0 < pos < len(text):
        return False
    a, b = text[pos - 1], text[pos]
    return (a.isdigit() or a.isupper() or a.islower()) and (b.isdigit() or b.isupper() or b.islower())


class TextAligner:
    """Aligns draft text to target ids that a verifier can check against the committed ids.

    Nothing is cached between calls: each call re-derives the context from the ids it gets,
    so the aligner can be shared by all requests of one tokenizer.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, lookback: int = 8, max_chars: int = 128) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise TypeError("TextAligner needs a fast (tokenizers-backed) tokenizer")
        if lookback < 1 or max_chars < 1:
            raise ValueError("lookback and max_chars must be >= 1")
        self.tokenizer = tokenizer
        self.lookback = lookback
        """Committed tokens re-tokenized with the draft: enough to settle how they join."""
        self.max_chars = max_chars
        """Draft text beyond this is ignored: no step verifies that many tokens, and
        tokenizing costs time proportional to the text."""
        self._backend = backend

    def align(self, committed_ids: Sequence[int], text: str, complete: bool = False) -> tuple[int, ...]:
        """Target ids continuing ``committed_ids`` with a stable prefix of ``text``.

        ``complete`` says the text ends where a unit ends (a whole name, a closing
        bracket): its last token is then kept unless it is trailing whitespace, which
        tokenizers attach to the next word. Returns () when nothing can be aligned
        safely; never raises on odd text.
        """
        if not text:
            return ()
        text = text[: self.max_chars]
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates: not text a tokenizer accepts
            return ()
        ctx_ids = [int(t) for t in committed_ids[-self.lookback :]]
        ctx_text = self._decode(ctx_ids)
        draft = self._joint(ctx_ids, ctx_text, text)
        if draft is None:
            context = self._context(ctx_ids)
            if context is None:
                return ()
            shrunk = len(context[0]) < len(ctx_ids)
            ctx_ids, ctx_text = context
            draft = self._joint(ctx_ids, ctx_text, text) if shrunk else None
            if draft is None:
                draft = self._forced(text)
        ids, spans = draft
        keep = self._stable_len(text, spans, complete)
        specials = self.tokenizer.all_special_ids
        for i in range(keep):  # a text draft never means a control token such as <eos>
            if ids[i] in specials:
                keep = i
                break
        if keep == 0:
            return ()
        kept = ids[:keep]
        # The ids must spell exactly the committed text + a prefix of the draft; this
        # catches tokenizers whose normalizer or decoder does not round-trip.
        if self._decode(ctx_ids + kept) != ctx_text + text[: spans[keep - 1][1]]:
            return ()
        return tuple(kept)

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=False)

    def _context(self, tail: list[int]) -> tuple[list[int], str] | None:
        """The longest suffix of ``tail`` that re-tokenizes to itself, with its text.

        A tail whose text tokenizes differently (a split UTF-8 character, a
        non-canonical merge) cannot anchor the comparison; shorter tails are tried.
        """
        for start in range(len(tail)):
            ids = tail[start:]
            text = self._decode(ids)
            if self._backend.encode(text, add_special_tokens=False).ids == ids:
                return ids, text
        return ([], "") if not tail else None

    def _joint(self, ctx_ids: list[int], ctx_text: str, text: str) -> _Draft | None:
        """Draft ids and spans from tokenizing context + draft together, if that
        reproduces the context ids and starts a token exactly at the boundary."""
        joint = self._backend.encode(ctx_text + text, add_special_tokens=False)
        n, base = len(ctx_ids), len(ctx_text)
        if joint.ids[:n] != ctx_ids or (len(joint.ids) > n and joint.offsets[n][0] != base):
            return None
        return joint.ids[n:], [(s - base, e - base) for s, e in joint.offsets[n:]]

    def _forced(self, text: str) -> _Draft:
        """The draft tokenized as if a token boundary were forced at its start.

        When the draft merges into the last committed token ("Re" + "serve"), the joint
        form is unreachable: committed ids are fixed, so the target's next token starts
        exactly at the boundary.
        """
        alone = self._backend.encode(text, add_special_tokens=False)
        return alone.ids, list(alone.offsets)

    @staticmethod
    def _stable_len(text: str, spans: list[tuple[int, int]], complete: bool = False) -> int:
        """How many leading draft tokens cannot change when more text follows.

        The last token can always merge with what comes next, and so can the pieces of a
        word it ends inside; tokens sharing a character (split UTF-8) go together.
        """
        if complete and spans:
            keep = len(spans)
            while keep and not text[spans[keep - 1][0] : spans[keep - 1][1]].strip():
                keep -= 1
            if keep and text[spans[keep - 1][1] - 1 : spans[keep - 1][1]].isspace():
                keep -= 1  # a token ending in whitespace may merge with the next word
            return keep
        if len(spans) < 2:
            return 0
        cut = spans[-1][0]
        keep = sum(1 for _, end in spans if end <= cut)
        while keep and _mid_word(text, spans[keep - 1][1]):
            keep -= 1
        return keep
