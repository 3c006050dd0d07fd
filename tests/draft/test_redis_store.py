"""What only the Redis store and its server have: TTL, key prefix, sharing between replicas.

The AnswerStore behaviour shared with the in-memory store is tested in test_history.py.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import time
import uuid

import pytest
import redis

from draftmesh.draft.base import DraftContext
from draftmesh.draft.history import HistorySource, prompt_key
from draftmesh.draft.redis_store import RedisAnswerStore
from draftmesh.redis_server import EmbeddedRedis, find_redis_server

QUESTION = "How do I reverse a list in Python without modifying the original?"
ANSWER = "Use slicing: items[::-1] returns a reversed copy and leaves items as it was."


@pytest.fixture
def prefix() -> str:
    return f"test:{uuid.uuid4().hex}:"


def keys_under(client: redis.Redis, prefix: str) -> list[bytes]:
    return sorted(client.scan_iter(match=prefix + "*"))


def test_embedded_redis_starts_answers_and_cleans_up(redis_server):
    assert find_redis_server() is not None
    with EmbeddedRedis() as second:
        assert second.port != redis_server.port
        client = redis.Redis.from_url(second.url)
        assert client.ping()
        assert client.config_get("save") == {"save": ""}  # a cache: nothing written to disk
        workdir = client.config_get("dir")["dir"]
        port = second.port
        client.close()
    assert second.port is None
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", port)) != 0
    assert not os.path.exists(workdir)
    second.stop()  # idempotent


@pytest.mark.skipif(sys.platform != "linux", reason="parent-death signal is Linux-only")
def test_embedded_redis_dies_with_a_killed_parent(redis_server):
    """A `draftmesh serve` killed with SIGKILL must not leave its redis-server running."""
    import signal
    import subprocess
    import time

    code = ("import sys, time\nfrom draftmesh.redis_server import EmbeddedRedis\n"
            "r = EmbeddedRedis().start(); print(r.port, flush=True); time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    port = int(parent.stdout.readline())
    client = redis.Redis(port=port)
    assert client.ping()
    parent.send_signal(signal.SIGKILL)
    parent.wait(10)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) != 0:
                break
        time.sleep(0.05)
    else:
        pytest.fail(f"redis-server on port {port} outlived its killed parent")


def test_embedded_redis_reports_a_server_that_dies_at_startup():
    false = shutil.which("false")
    assert false is not None
    with pytest.raises(RuntimeError, match="exited at startup"):
        EmbeddedRedis(binary=false).start()


def test_entries_expire_after_the_ttl(redis_client, prefix, encode):
    store = RedisAnswerStore(redis_client, prefix=prefix, ttl_s=0.3)
    question = encode(QUESTION)
    store.put(question, encode(ANSWER), session_id="s")
    assert store.get_exact(question) is not None
    assert all(0 < redis_client.pttl(key) <= 300 for key in keys_under(redis_client, prefix))
    time.sleep(0.5)
    assert store.get_exact(question) is None
    assert store.near(question) == []
    assert store.session_turns("s") == []
    assert keys_under(redis_client, prefix) == []


def test_all_keys_live_under_the_prefix_and_prefixes_are_isolated(redis_client, prefix, encode):
    other_prefix = prefix + "other:"
    mine = RedisAnswerStore(redis_client, prefix=prefix, ttl_s=None)
    other = RedisAnswerStore(redis_client, prefix=other_prefix, ttl_s=None)
    question = encode(QUESTION)
    mine.put(question, [1, 2], session_id="s")
    assert other.get_exact(question) is None and other.near(question) == [] and other.session_turns("s") == []
    assert keys_under(redis_client, prefix)
    assert all(redis_client.pttl(key) == -1 for key in keys_under(redis_client, prefix))  # no TTL asked
    assert keys_under(redis_client, other_prefix) == []


def test_eviction_removes_the_answer_from_its_lsh_bands(redis_client, prefix, encode):
    store = RedisAnswerStore(redis_client, prefix=prefix, max_entries=1)
    store.put(encode(QUESTION), [1])
    store.put(encode("Something else entirely, about the weather in Oslo."), [2])
    assert len(store) == 1 and store.get_exact(encode(QUESTION)) is None
    signature = store.hasher.signature(encode(QUESTION))
    bands = [prefix.encode() + b"b:" + band for band in store.hasher.band_keys(signature)]
    assert not any(redis_client.sismember(band, prompt_key(encode(QUESTION))) for band in bands)


def test_replicas_share_answers_and_sessions(redis_server, prefix, encode):
    replica_a = HistorySource(RedisAnswerStore.from_url(redis_server.url, prefix=prefix), max_tokens=8)
    replica_b = HistorySource(RedisAnswerStore.from_url(redis_server.url, prefix=prefix), max_tokens=8)
    question, answer = encode(QUESTION), encode(ANSWER)
    done = DraftContext(token_ids=tuple(question + answer), prompt_len=len(question), session_id="s")
    replica_a.finish(done, answer, ANSWER)
    repeat = DraftContext(token_ids=tuple(question), prompt_len=len(question), request_id="on-b")
    assert replica_b.propose(repeat)[0].token_ids == tuple(answer[:8])
    assert [t.output_ids for t in replica_b.store.session_turns("s")] == [tuple(answer)]
