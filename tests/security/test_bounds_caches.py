"""Caches are bounded by bytes (real redis-server): the answer store evicts its oldest answers and
sessions past ``serve.answer_store_max_bytes``, and the embedded Redis runs with a ``maxmemory``
under which cache keys (all with TTLs) are evicted while the fact-check streams (no TTL) stay."""

from __future__ import annotations

import uuid

import pytest
import redis

from draftmesh.config import DraftmeshConfig
from draftmesh.draft.redis_store import RedisAnswerStore
from draftmesh.redis_server import EmbeddedRedis


def stored_bytes(client: redis.Redis, prefix: str) -> int:
    """What Redis itself says the store's keys take (MEMORY USAGE, so overheads included)."""
    return sum(client.memory_usage(k) or 0 for k in client.scan_iter(match=prefix + "*"))


def test_the_answer_store_stays_under_its_bytes(redis_client):
    prefix = f"test:{uuid.uuid4().hex}:"
    cap = 64 * 1024
    store = RedisAnswerStore(redis_client, prefix=prefix, max_bytes=cap)
    answer = tuple(range(1000, 1500))  # 2 KB of int32 ids
    for i in range(200):  # ~400 KB offered
        store.put((1, 2, 3, i, i + 7), answer, session_id=f"s{i % 20}")
        assert store.nbytes() <= cap
    assert 0.5 * cap < store.nbytes() <= cap  # bounded, not emptied
    assert store.get_exact((1, 2, 3, 199, 206)) == answer  # the newest stay
    assert store.get_exact((1, 2, 3, 0, 7)) is None  # the oldest went
    # Redis's own accounting (with per-key overheads) stays within a small factor of the cap; before
    # this bound the store held every answer (max_entries=100k): 2.4 MB, 37x the cap here.
    assert stored_bytes(redis_client, prefix) < 3 * cap


def test_replacing_an_answer_and_trimming_turns_are_counted_once(redis_client):
    prefix = f"test:{uuid.uuid4().hex}:"
    store = RedisAnswerStore(redis_client, prefix=prefix, max_turns=2, max_bytes=1 << 20)
    for _ in range(5):
        store.put((4, 5, 6), (7, 8, 9, 10), session_id="s")
    one = RedisAnswerStore(redis_client, prefix=f"test:{uuid.uuid4().hex}:", max_turns=2)  # same key lengths
    one.put((4, 5, 6), (7, 8, 9, 10), session_id="s")
    one.put((4, 5, 6), (7, 8, 9, 10), session_id="s")
    assert store.nbytes() == one.nbytes()  # one answer, two turns: however many puts
    assert len(store.session_turns("s")) == 2


def test_the_embedded_redis_has_maxmemory_and_evicts_only_cache_keys():
    cap = DraftmeshConfig().serve.redis_maxmemory_bytes
    assert cap == 1 << 30  # the serve default
    with EmbeddedRedis(maxmemory_bytes=8 << 20) as server:
        client = redis.Redis.from_url(server.url)
        assert client.config_get("maxmemory") == {"maxmemory": str(8 << 20)}
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "volatile-lru"}
        for i in range(200):  # a fact-check stream: no TTL
            client.xadd("fc:spans", {"text": "x" * 1000, "i": str(i)})
        store = RedisAnswerStore(client, prefix="a:")  # TTLs on every key, no byte bound of its own
        big = tuple(range(20_000))  # 80 KB an answer: 200 of them is 16 MB, twice maxmemory
        for i in range(200):
            store.put((1, i, 2, i), big)
        info = client.info("memory")
        assert info["used_memory"] <= (8 << 20) * 1.1
        assert client.info("stats")["evicted_keys"] > 0
        assert client.xlen("fc:spans") == 200  # never evicted
        assert store.get_exact((1, 199, 2, 199)) == big  # the recent answers are there
        client.delete(*client.keys("a:*"))
        with pytest.raises(redis.exceptions.ResponseError, match="maxmemory"):
            # once only keys without a TTL are left, growing memory is refused (OOM), never silently evicted
            client.set("filler", "y" * (9 << 20))
        assert client.xlen("fc:spans") == 200
        client.close()


def test_no_maxmemory_when_unset():
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url)
        assert client.config_get("maxmemory") == {"maxmemory": "0"}
        client.close()


def test_a_history_served_outside_the_verifier_gets_the_byte_bound(redis_server):
    """A Serve draft deployment's history (built by ``build_source``) has the same bound as the verifier's."""
    from draftmesh.draft.registry import build_source

    source = build_source("history", "smollm2-135m", redis_url=redis_server.url, answer_store_max_bytes=12345)
    assert source.store.max_bytes == 12345
