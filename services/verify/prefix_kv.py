"""Finished requests' KV, kept for later requests of the same tenant that begin with the same tokens.

A verifier replica keeps the KV of a finished request (prompt and output) here. A later request of
the same tenant whose prompt begins with some of those tokens copies that prefix into its row and
prefills only the rest (automatic prefix caching, as vLLM and SGLang do):
- a session's next turn starts with the previous prompt and answer;
- a chat client that resends its whole history every turn (the OpenAI API's way) does the same
  without naming a session;
- requests that share a system prompt, a document or a repeated question share their first tokens.

The KV of a token depends only on the tokens before it, so a copied prefix is the KV a prefill would
compute (exactly in float64; in float32 up to the rounding of another forward's shape).

Two kinds of entries, each bounded by its own count and least recently used first: a session's
(``session_id``; the session's next request replaces it) and a request's without one. All together
are bounded by ``max_tokens``, and the scheduler shrinks them to what the replica's KV budget leaves
beside its batch. An entry whose tokens begin another entry of its tenant is dropped: the longer one
answers every lookup it could. Entries are shared, never taken out: a request copies what it uses.
Lookups stay within the request's tenant, so one tenant's KV never seeds another's request.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable, Sequence

import numpy as np

from draftmesh.backend import KVState


@dataclass
class _Entry:
    tenant: str
    ids: np.ndarray
    state: KVState
    session: bool


class PrefixKVPool:
    """Per tenant, finished requests' caches and the token ids each holds; found by longest common prefix."""

    def __init__(self, max_sessions: int = 64, max_prefixes: int = 64, max_tokens: int = 1_000_000) -> None:
        if max_sessions < 0 or max_prefixes < 0 or max_tokens < 0:
            raise ValueError(f"max_sessions, max_prefixes and max_tokens must be >= 0, "
                             f"got {max_sessions}, {max_prefixes}, {max_tokens}")
        self.max_sessions = max_sessions
        self.max_prefixes = max_prefixes
        self.max_tokens = max_tokens
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        self._counts = {True: 0, False: 0}
        self._tokens = 0
        self._keys = itertools.count()
        self._lock = threading.Lock()
        self._hits = self._misses = self._reused = self._evictions = 0

    def keeps(self, session_id: str | None) -> bool:
        """Whether a finished request (of a session, or none) is kept at all: callers skip the copy if not."""
        return (self.max_sessions if session_id else self.max_prefixes) > 0

    def lookup(self, tenant: str, token_ids: Sequence[int]) -> tuple[KVState | None, list[int]]:
        """The tenant's entry sharing the longest prefix with ``token_ids``, and that prefix.

        The entry stays in the pool (it is shared): the caller copies the state's first
        ``len(prefix)`` positions and must not change it. (None, []) when nothing is shared.
        """
        want = np.asarray(token_ids, dtype=np.int64)
        with self._lock:
            best_key, best_n = None, 0
            for key, entry in self._entries.items():
                if entry.tenant == tenant:
                    n = _common_prefix(entry.ids, want)
                    if n > best_n:
                        best_key, best_n = key, n
            if best_key is None:
                self._misses += 1
                return None, []
            self._entries.move_to_end(best_key)
            self._hits += 1
            self._reused += best_n
            return self._entries[best_key].state, [int(t) for t in want[:best_n]]

    def checkin(self, tenant: str, cached_ids: Sequence[int], state: KVState, session_id: str | None = None) -> None:
        """Keep ``state``, which must hold exactly the KV of ``cached_ids``, for the tenant's later requests
        (replacing the session's entry, when one is named)."""
        if state.length != len(cached_ids):
            raise ValueError(f"state holds {state.length} tokens but {len(cached_ids)} ids were given")
        if not self.keeps(session_id):
            return
        ids = np.asarray(cached_ids, dtype=np.int64)
        session = bool(session_id)
        with self._lock:
            if session:
                self._remove(("session", session_id))
            for key, entry in list(self._entries.items()):
                if entry.tenant != tenant:
                    continue
                shared = _common_prefix(entry.ids, ids)
                if shared == len(entry.ids) and not entry.session:
                    self._remove(key)  # the new entry answers every lookup this one could
                elif shared == len(ids) and not session:
                    self._entries.move_to_end(key)  # nothing new to keep: the longer one is fresh again
                    return
            if len(ids):
                key = ("session", session_id) if session else ("prefix", next(self._keys))
                self._entries[key] = _Entry(tenant, ids, state, session)
                self._counts[session] += 1
                self._tokens += len(ids)
            self._evict(self.max_tokens)

    def shrink_to(self, max_tokens: int) -> None:
        """Evict least recently used entries until at most ``max_tokens`` are pooled (the
        batch's KV budget needs the room for active requests)."""
        with self._lock:
            self._evict(max_tokens)

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
                "sessions": self._counts[True],
                "prefixes": self._counts[False],
                "cached_tokens": self._tokens,
            }

    # ------------------------------------------------------------------ under the lock
    def _remove(self, key: Hashable) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._counts[entry.session] -= 1
            self._tokens -= len(entry.ids)

    def _evict(self, max_tokens: int) -> None:
        limits = {True: self.max_sessions, False: self.max_prefixes}
        for session, limit in limits.items():
            while self._counts[session] > limit:
                key = next(k for k, e in self._entries.items() if e.session is session)
                self._remove(key)
                self._evictions += 1
        while self._entries and self._tokens > max_tokens:
            self._remove(next(iter(self._entries)))
            self._evictions += 1


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0 or a[0] != b[0]:
        return 0
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n
