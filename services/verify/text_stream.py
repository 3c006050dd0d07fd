"""Detokenize a generation as it grows.

Deltas never end inside a multi-byte character or inside what could still become a stop
string, and a stop string is cut exactly where plain one-token decoding would have seen
it, so streamed text, final text and token ids agree whatever the step sizes were.
"""

from __future__ import annotations

from typing import Sequence


class TextStream:
    """Incremental detokenization of one generation: stream-safe deltas and stop-string cuts."""

    def __init__(self, tokenizer, stop: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.longest_stop = max((len(s) for s in self.stop), default=0)
        self.emitted = 0
        self.stop_at: int | None = None

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def update(self, generated: list[int], before: int) -> tuple[str, int | None]:
        """Return (new text safe to emit, token count to cut to if a stop string appeared)."""
        text = self._decode(generated)
        cut = None
        if self.stop:
            hit = self._find_stop(text)
            if hit is not None:
                self.stop_at = hit
                cut = self._tokens_for_stop(generated, before)
                text = text[:hit]
        safe = len(text)
        if cut is None:
            safe -= self._held_back(text)
        while safe > self.emitted and text[safe - 1] == "\ufffd":  # an incomplete UTF-8 sequence
            safe -= 1
        delta = text[self.emitted : safe] if safe > self.emitted else ""
        self.emitted = max(self.emitted, safe)
        return delta, cut

    def final(self, generated: list[int]) -> str:
        text = self._decode(generated)
        return text[: self.stop_at] if self.stop_at is not None else text

    def _find_stop(self, text: str) -> int | None:
        start = max(0, self.emitted - self.longest_stop)
        hits = [i for s in self.stop if (i := text.find(s, start)) >= 0]
        return min(hits) if hits else None

    def _tokens_for_stop(self, generated: list[int], before: int) -> int:
        """The fewest tokens whose text already contains a stop string (what plain decoding sees)."""
        for n in range(max(1, before), len(generated) + 1):
            if self._find_stop(self._decode(generated[:n])) is not None:
                return n
        return len(generated)

    def _held_back(self, text: str) -> int:
        """Length of the longest text suffix that could still grow into a stop string."""
        for k in range(min(self.longest_stop - 1, len(text)), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0
