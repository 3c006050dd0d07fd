"""Detokenize a generation as it grows.

Deltas never end inside a multi-byte character or inside what could still become a stop
string; when the request ends (EOS, length, stop) ``flush`` hands out what was held back,
so the deltas always add up to the final text.

Stop strings are position-exact: the caller feeds tokens one at a time (``push``), so the
stream sees the same prefixes, in the same order, as plain one-token decoding, whatever
the step size. A stop string that only exists on a prefix (``"\\ufffd"`` of a half-decoded
character, completed by the next token of the same step) still ends the output at the
token plain decoding ends at. Without stop strings nothing can end mid-step, so one decode
per step (``update``) is enough.

The ids that decoding skips (special tokens) are dropped as they arrive, so the window before
the unsettled tail always holds text: a window of only skipped ids decoded to "" and the tail's
first token lost the space its context gives it ("w20w50" for "w20 w50").
"""

from __future__ import annotations

from typing import Sequence

WINDOW = 6
"""Tokens decoded before the unsettled tail, as context for the tail's first token."""
SETTLE_AFTER = 8
"""Unsettled tokens beyond which a run of invalid bytes (text ending in "\ufffd" for good) is settled."""


class TextStream:
    """Incremental detokenization of one generation: stream-safe deltas and stop-string cuts."""

    def __init__(self, tokenizer, stop: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.longest_stop = max((len(s) for s in self.stop), default=0)
        self.emitted = 0
        """Characters of the text handed out so far."""
        self.stop_at: int | None = None
        """Where the final text ends once a stop string appeared (the string itself is cut)."""
        self._settled = ""
        """``decode(ids[:_read])``: text no later token can change (it ends at a character boundary)."""
        self._read = 0
        self._start = 0
        """Where the window starts (``_read - WINDOW`` or 0); ``_head`` is ``decode(ids[_start:_read])``."""
        self._head = ""
        self.decoded_tokens = 0
        """Tokens handed to the tokenizer so far (what keeps a long output's stream linear)."""
        self._skipped = skipped_ids(tokenizer)
        self._kept: list[int] = []
        """The generation read so far without the ids decoding skips; ``_read``/``_start`` index it."""
        self._seen = 0
        """Tokens of the generation read into ``_kept``."""

    def _decode(self, ids: Sequence[int]) -> str:
        self.decoded_tokens += len(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _keep(self, generated: Sequence[int]) -> list[int]:
        if len(generated) < self._seen:  # not the output this stream has seen grow: start again
            self._settled, self._read, self._start, self._head = "", 0, 0, ""
            self._kept, self._seen = [], 0
        self._kept.extend(t for t in generated[self._seen :] if t not in self._skipped)
        self._seen = len(generated)
        return self._kept

    def _text(self, generated: Sequence[int]) -> str:
        """``decode(generated)``, from the settled text and a window over the tokens after it."""
        ids = self._keep(generated)
        window = self._decode(ids[self._start :])
        if not window.startswith(self._head):
            return self._decode(ids)  # the window's head decodes differently in context: no split here
        text = self._settled + window[len(self._head) :]
        n = len(ids)
        if not text.endswith("\ufffd"):
            self._settle(ids, n, text)
        elif n - self._read > SETTLE_AFTER:
            # A run of invalid bytes: the text up to 4 tokens back (at least 4 bytes, more than an
            # incomplete character can still take) is final if the longer text still begins with it.
            r = n - 4
            part = self._decode(ids[self._start : r])
            if part.startswith(self._head):
                text_r = self._settled + part[len(self._head) :]
                if text.startswith(text_r):
                    self._settle(ids, r, text_r)
        return text

    def _settle(self, ids: Sequence[int], r: int, text: str) -> None:
        self._settled, self._read = text, r
        self._start = max(0, r - WINDOW)
        self._head = self._decode(ids[self._start : r])

    def push(self, generated: list[int]) -> tuple[str, bool]:
        """After one more token: (new text safe to emit, whether a stop string now appears).

        Call it once per generated token, in order: that is what makes stop matching
        exact per token."""
        text = self._text(generated)
        hit = self._find_stop(text) if self.stop else None
        if hit is not None:
            self.stop_at = hit
            return self._emit(text, hit), True
        return self._emit(text, len(text) - self._held_back(text)), False

    def update(self, generated: list[int]) -> str:
        """After a step without stop strings: the new text safe to emit."""
        if self.stop:
            raise ValueError("with stop strings, feed tokens one at a time (push)")
        text = self._text(generated)
        return self._emit(text, len(text))

    def flush(self, generated: list[int]) -> str:
        """At the end of the request: everything of the final text not yet emitted."""
        text = self.final(generated)
        rest = text[self.emitted :]
        self.emitted = max(self.emitted, len(text))
        return rest

    def final(self, generated: list[int]) -> str:
        text = self._text(generated)
        return text[: self.stop_at] if self.stop_at is not None else text

    def _emit(self, text: str, safe: int) -> str:
        while safe > self.emitted and text[safe - 1] == "\ufffd":  # an incomplete UTF-8 sequence
            safe -= 1
        delta = text[self.emitted : safe] if safe > self.emitted else ""
        self.emitted = max(self.emitted, safe)
        return delta

    def _find_stop(self, text: str) -> int | None:
        start = max(0, self.emitted - self.longest_stop)
        hits = [i for s in self.stop if (i := text.find(s, start)) >= 0]
        return min(hits) if hits else None

    def _held_back(self, text: str) -> int:
        """Length of the longest text suffix that could still grow into a stop string."""
        for k in range(min(self.longest_stop - 1, len(text)), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0


def skipped_ids(tokenizer) -> frozenset[int]:
    """The ids ``decode(..., skip_special_tokens=True)`` leaves out: the special tokens, named or added."""
    ids = set(getattr(tokenizer, "all_special_ids", None) or ())
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids.update(i for i, token in added.items() if getattr(token, "special", False))
    return frozenset(ids)
