"""``AnswerStore`` on Redis, so every replica drafts from every replica's finished requests.

Same contract and bounds as ``InMemoryAnswerStore`` (LRU over answers and sessions), plus
a TTL on every key and a key prefix so several deployments can share one Redis.
Keys under ``prefix``:

- ``e:<tenant>/<prompt hash>``: hash {out: int32 token ids, sig: uint32 MinHash signature}
- ``b:<tenant>/<band key>``: set of ``<tenant>/<prompt hash>`` whose signature has that LSH band
- ``lru`` / ``sessions``: sorted sets of ``<tenant>/<prompt hash>`` / session ids scored by
  ``clock``, a counter, so eviction order is global across replicas and tenants
- ``s:<session id>``: list of packed turns, oldest first (the router scopes session ids as
  ``<tenant>/<id>``)

Eviction and TTL refreshes are best-effort across concurrent writers: a stale band
member or LRU entry costs a wasted lookup, never a wrong answer.
"""

from __future__ import annotations

import struct
from collections import Counter
from typing import Any, Sequence

import numpy as np
import redis

from draftmesh.draft.history import DEFAULT_TENANT, MinHasher, NearAnswer, Turn, prompt_key, tenant_band, tenant_key


def _pack_ids(ids: Sequence[int]) -> bytes:
    return np.asarray(ids, dtype="<i4").tobytes()


def _unpack_ids(data: bytes) -> tuple[int, ...]:
    return tuple(np.frombuffer(data, dtype="<i4").tolist())


def _pack_turn(prompt_ids: Sequence[int], output_ids: Sequence[int]) -> bytes:
    return struct.pack("<I", len(prompt_ids)) + _pack_ids(prompt_ids) + _pack_ids(output_ids)


def _unpack_turn(data: bytes) -> Turn:
    (n,) = struct.unpack_from("<I", data)
    ids = _unpack_ids(data[4:])
    return Turn(ids[:n], ids[n:])


class RedisAnswerStore:
    """An ``AnswerStore`` shared through Redis (redis-py client, ``decode_responses=False``)."""

    def __init__(
        self,
        client: redis.Redis,
        *,
        prefix: str = "draftmesh:answers:",
        ttl_s: float | None = 7 * 24 * 3600,
        max_entries: int = 100_000,
        max_sessions: int = 10_000,
        max_turns: int = 16,
        min_similarity: float = 0.5,
        max_candidates: int = 32,
        hasher: MinHasher | None = None,
    ) -> None:
        self.client = client
        self.prefix = prefix.encode()
        self.ttl_ms = None if ttl_s is None else max(1, int(ttl_s * 1000))
        self.max_entries, self.max_sessions, self.max_turns = max_entries, max_sessions, max_turns
        self.min_similarity, self.max_candidates = min_similarity, max_candidates
        self.hasher = hasher or MinHasher()

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> RedisAnswerStore:
        return cls(redis.Redis.from_url(url), **kwargs)

    def _key(self, kind: bytes, name: bytes | str = b"") -> bytes:
        return self.prefix + kind + (name.encode() if isinstance(name, str) else name)

    def _expire(self, pipe: redis.client.Pipeline, *keys: bytes) -> None:
        if self.ttl_ms is not None:
            for key in keys:
                pipe.pexpire(key, self.ttl_ms)

    def __len__(self) -> int:
        """Answers in the LRU order (an upper bound while TTLs expire entries one by one)."""
        return int(self.client.zcard(self._key(b"lru")))

    def put(
        self, prompt_ids: Sequence[int], output_ids: Sequence[int], session_id: str | None = None,
        *, tenant: str = DEFAULT_TENANT, answer: bool = True,
    ) -> None:
        key = tenant_key(tenant, prompt_key(prompt_ids))
        signature = self.hasher.signature(prompt_ids)
        tick = self.client.incr(self._key(b"clock"))
        entry, lru = self._key(b"e:", key), self._key(b"lru")
        pipe = self.client.pipeline(transaction=True)
        if answer:
            pipe.hset(entry, mapping={b"out": _pack_ids(output_ids), b"sig": signature.tobytes()})
            bands = [self._key(b"b:", tenant_band(tenant, band)) for band in self.hasher.band_keys(signature)]
            for band in bands:
                pipe.sadd(band, key)
            pipe.zadd(lru, {key: tick})
            self._expire(pipe, entry, lru, self._key(b"clock"), *bands)
        if session_id is not None:
            turns, sessions = self._key(b"s:", session_id), self._key(b"sessions")
            pipe.rpush(turns, _pack_turn(prompt_ids, output_ids))
            pipe.ltrim(turns, -self.max_turns, -1)
            pipe.zadd(sessions, {session_id: tick})
            self._expire(pipe, turns, sessions)
        pipe.zcard(lru)
        pipe.zcard(self._key(b"sessions"))
        *_, n_entries, n_sessions = pipe.execute()
        if n_entries > self.max_entries:
            self._evict_entries(n_entries - self.max_entries)
        if n_sessions > self.max_sessions:
            popped = self.client.zpopmin(self._key(b"sessions"), n_sessions - self.max_sessions)
            if popped:  # empty when a concurrent writer evicted them first
                self.client.delete(*(self._key(b"s:", sid) for sid, _ in popped))

    def _evict_entries(self, count: int) -> None:
        keys = [key for key, _ in self.client.zpopmin(self._key(b"lru"), count)]
        signatures = self.client.pipeline(transaction=False)
        for key in keys:
            signatures.hget(self._key(b"e:", key), b"sig")
        pipe = self.client.pipeline(transaction=False)
        for key, sig in zip(keys, signatures.execute(), strict=True):
            pipe.delete(self._key(b"e:", key))
            tenant = key.split(b"/", 1)[0].decode()
            if sig is not None:
                for band in self.hasher.band_keys(np.frombuffer(sig, dtype=np.uint32)):
                    pipe.srem(self._key(b"b:", tenant_band(tenant, band)), key)
        pipe.execute()

    def get_exact(self, prompt_ids: Sequence[int], *, tenant: str = DEFAULT_TENANT) -> tuple[int, ...] | None:
        key = tenant_key(tenant, prompt_key(prompt_ids))
        entry = self._key(b"e:", key)
        out, sig = self.client.hmget(entry, [b"out", b"sig"])
        if out is None:
            return None
        tick = self.client.incr(self._key(b"clock"))
        pipe = self.client.pipeline(transaction=False)
        pipe.zadd(self._key(b"lru"), {key: tick})
        signature = np.frombuffer(sig, dtype=np.uint32)
        bands = [self._key(b"b:", tenant_band(tenant, band)) for band in self.hasher.band_keys(signature)]
        self._expire(pipe, entry, self._key(b"lru"), self._key(b"clock"), *bands)
        pipe.execute()
        return _unpack_ids(out)

    def near(self, prompt_ids: Sequence[int], limit: int = 4, *, tenant: str = DEFAULT_TENANT) -> list[NearAnswer]:
        signature = self.hasher.signature(prompt_ids)
        pipe = self.client.pipeline(transaction=False)
        for band in self.hasher.band_keys(signature):
            pipe.smembers(self._key(b"b:", tenant_band(tenant, band)))
        hits = Counter(key for members in pipe.execute() for key in members)
        keys = [key for key, _ in hits.most_common(self.max_candidates)]
        for key in keys:
            pipe.hmget(self._key(b"e:", key), [b"out", b"sig"])
        found = []
        for out, sig in pipe.execute():
            if out is None:  # expired or evicted since its band was read
                continue
            similarity = self.hasher.similarity(signature, np.frombuffer(sig, dtype=np.uint32))
            if similarity >= self.min_similarity:
                found.append(NearAnswer(similarity, _unpack_ids(out)))
        return sorted(found, key=lambda a: -a.similarity)[:limit]

    def session_turns(self, session_id: str) -> list[Turn]:
        return [_unpack_turn(data) for data in self.client.lrange(self._key(b"s:", session_id), 0, -1)]
