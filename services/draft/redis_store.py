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
- ``bytes``: what the answers and turns take (``max_bytes`` bounds it): each entry's payload,
  key and band memberships (its ``sz`` field), plus each kept turn's packed length

Bounded by count (``max_entries``, ``max_sessions``, ``max_turns``) and by bytes
(``max_bytes``, config ``serve.answer_store_max_bytes``): past it, the oldest answers and
sessions (by ``clock``) are evicted until the store fits. Every key has a TTL, so the embedded
Redis's ``volatile-lru`` policy may evict them too (``draftmesh.redis_server``); the byte
counter then overstates what is left, which only evicts early, and it is reset when nothing
is left to evict.

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
        max_bytes: int = 0,
        min_similarity: float = 0.5,
        max_candidates: int = 32,
        hasher: MinHasher | None = None,
    ) -> None:
        self.client = client
        self.prefix = prefix.encode()
        self.ttl_ms = None if ttl_s is None else max(1, int(ttl_s * 1000))
        self.max_entries, self.max_sessions, self.max_turns = max_entries, max_sessions, max_turns
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 (0: no byte bound), got {max_bytes}")
        self.max_bytes = max_bytes
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
        entry, lru, total = self._key(b"e:", key), self._key(b"lru"), self._key(b"bytes")
        pipe = self.client.pipeline(transaction=True)
        if answer:  # a lossy request's output joins its session's turns but is never an answer
            out, sig = _pack_ids(output_ids), signature.tobytes()
            bands = [self._key(b"b:", tenant_band(tenant, band)) for band in self.hasher.band_keys(signature)]
            size = len(out) + len(sig) + len(entry) + len(key) * (len(bands) + 1)
            pipe.hget(entry, b"sz")
            pipe.hset(entry, mapping={b"out": out, b"sig": sig, b"sz": size})
            for band in bands:
                pipe.sadd(band, key)
            pipe.zadd(lru, {key: tick})
            pipe.incrby(total, size)
            self._expire(pipe, entry, lru, self._key(b"clock"), total, *bands)
        if session_id is not None:
            turns, sessions = self._key(b"s:", session_id), self._key(b"sessions")
            turn = _pack_turn(prompt_ids, output_ids)
            rpush_at = len(pipe.command_stack)
            pipe.rpush(turns, turn)
            pipe.incrby(total, len(turn))
            pipe.zadd(sessions, {session_id: tick})
            self._expire(pipe, turns, sessions)
        pipe.zcard(lru)
        pipe.zcard(self._key(b"sessions"))
        results = pipe.execute()
        old_size, n_entries, n_sessions = (results[0] if answer else None), results[-2], results[-1]
        freed = int(old_size) if old_size is not None else 0  # an answer replaced: its old size goes
        if session_id is not None:
            n_turns = results[rpush_at]
            if n_turns > self.max_turns:
                dropped = self.client.lpop(self._key(b"s:", session_id), n_turns - self.max_turns) or []
                freed += sum(len(d) for d in dropped)
        if freed:
            self.client.decrby(total, freed)
        if n_entries > self.max_entries:
            self._evict_entries(n_entries - self.max_entries)
        if n_sessions > self.max_sessions:
            self._evict_sessions(n_sessions - self.max_sessions)
        if self.max_bytes:
            self._evict_to_bytes()

    def nbytes(self) -> int:
        """Bytes of answers and session turns held (the ``max_bytes`` counter)."""
        return int(self.client.get(self._key(b"bytes")) or 0)

    def _evict_to_bytes(self, max_rounds: int = 10_000) -> None:
        """Evict the oldest answer or session (whichever was used longer ago) until the store fits."""
        total, lru, sessions = self._key(b"bytes"), self._key(b"lru"), self._key(b"sessions")
        for _ in range(max_rounds):
            if self.nbytes() <= self.max_bytes:
                return
            oldest_entry = self.client.zrange(lru, 0, 0, withscores=True)
            oldest_session = self.client.zrange(sessions, 0, 0, withscores=True)
            if not oldest_entry and not oldest_session:
                self.client.set(total, 0)  # what is counted was evicted by Redis or expired
                return
            if oldest_session and (not oldest_entry or oldest_session[0][1] < oldest_entry[0][1]):
                self._evict_sessions(1)
            else:
                self._evict_entries(1)

    def _evict_sessions(self, count: int) -> None:
        popped = self.client.zpopmin(self._key(b"sessions"), count)
        if not popped:  # a concurrent writer evicted them first
            return
        keys = [self._key(b"s:", sid) for sid, _ in popped]
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.lrange(key, 0, -1)
        freed = sum(len(t) for turns in pipe.execute() for t in turns)
        pipe.delete(*keys)
        if freed:
            pipe.decrby(self._key(b"bytes"), freed)
        pipe.execute()

    def _evict_entries(self, count: int) -> None:
        keys = [key for key, _ in self.client.zpopmin(self._key(b"lru"), count)]
        signatures = self.client.pipeline(transaction=False)
        for key in keys:
            signatures.hmget(self._key(b"e:", key), [b"sig", b"sz"])
        pipe = self.client.pipeline(transaction=False)
        freed = 0
        for key, (sig, size) in zip(keys, signatures.execute(), strict=True):
            freed += int(size) if size is not None else 0
            pipe.delete(self._key(b"e:", key))
            tenant = key.split(b"/", 1)[0].decode()
            if sig is not None:
                for band in self.hasher.band_keys(np.frombuffer(sig, dtype=np.uint32)):
                    pipe.srem(self._key(b"b:", tenant_band(tenant, band)), key)
        if freed:
            pipe.decrby(self._key(b"bytes"), freed)
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
