"""KV caches kept between the requests of one chat session, per verifier replica.

The next turn of a session starts with the previous prompt and answer, so the KV of a
finished request covers most of the next prompt; only the new suffix needs a prefill.
An entry is taken out while a request uses it (a concurrent request of the same session
starts from an empty cache: correct, just slower) and put back when the request ends.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Sequence

from draftmesh.backend import KVState


class SessionKVPool:
    """Per session, a cache and the token ids it holds; least recently used evicted first."""

    def __init__(self, max_sessions: int = 64, max_tokens: int = 1_000_000) -> None:
        if max_sessions < 0 or max_tokens < 0:
            raise ValueError(f"max_sessions and max_tokens must be >= 0, got {max_sessions}, {max_tokens}")
        self.max_sessions = max_sessions
        self.max_tokens = max_tokens
        self._entries: OrderedDict[str, tuple[list[int], KVState]] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()
        self._hits = self._misses = self._reused = self._evictions = 0

    def checkout(self, session_id: str, token_ids: Sequence[int]) -> tuple[KVState, list[int]]:
        """Take the session's cache, cropped to its longest common prefix with ``token_ids``.

        Returns the state and the ids it holds; a fresh state and [] when nothing is reusable.
        """
        with self._lock:
            entry = self._entries.pop(session_id, None)
            if entry is not None:
                self._tokens -= len(entry[0])
            n = _common_prefix(entry[0], token_ids) if entry is not None else 0
            if n == 0:
                self._misses += 1
            else:
                self._hits += 1
                self._reused += n
        if n == 0:
            return KVState(), []
        ids, state = entry
        if n < state.length:
            state.crop(n)
        return state, ids[:n]

    def checkin(self, session_id: str, cached_ids: Sequence[int], state: KVState) -> None:
        """Keep ``state``, which must hold exactly the KV of ``cached_ids``, for the session's next request."""
        cached_ids = list(cached_ids)
        if state.length != len(cached_ids):
            raise ValueError(f"state holds {state.length} tokens but {len(cached_ids)} ids were given")
        with self._lock:
            old = self._entries.pop(session_id, None)
            if old is not None:
                self._tokens -= len(old[0])
            if cached_ids:
                self._entries[session_id] = (cached_ids, state)
                self._tokens += len(cached_ids)
            while self._entries and (len(self._entries) > self.max_sessions or self._tokens > self.max_tokens):
                _, (ids, _) = self._entries.popitem(last=False)
                self._tokens -= len(ids)
                self._evictions += 1

    def shrink_to(self, max_tokens: int) -> None:
        """Evict least recently used sessions until at most ``max_tokens`` are pooled (the
        batch's KV budget needs the room for active requests)."""
        with self._lock:
            while self._entries and self._tokens > max_tokens:
                _, (ids, _) = self._entries.popitem(last=False)
                self._tokens -= len(ids)
                self._evictions += 1

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "hits": self._hits,
                "misses": self._misses,
                "reused_tokens": self._reused,
                "evictions": self._evictions,
                "sessions": len(self._entries),
                "cached_tokens": self._tokens,
            }


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
