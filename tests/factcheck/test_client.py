"""FactCheckClient against a real redis-server: submit/ready/wait end to end with a worker,
back-pressure, the bounded stream, and a Redis that is down (never raises, never blocks)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from draftmesh.config import FactCheckConfig
from draftmesh.factcheck.client import FactCheckBusy, FactCheckClient, FactCheckUnavailable
from draftmesh.factcheck.protocol import SpanEntry, StreamNames
from draftmesh.factcheck.worker import Worker
from draftmesh.net import free_port
from draftmesh.redis_server import EmbeddedRedis, _answers_ping, find_redis_server

sys.path.insert(0, str(Path(__file__).parent))
import fc_annotators  # noqa: E402
from fc_annotators import wait_for, worker_thread  # noqa: E402

FEB30 = "The treaty was signed on February 30, 1848."
PARIS = "Paris is the capital of France."


def config(**overrides) -> FactCheckConfig:
    return FactCheckConfig(**{"stream_prefix": f"test:fc:{uuid.uuid4().hex[:12]}", "block_ms": 50, **overrides})


def draft(text: str, **kw) -> SpanEntry:
    return SpanEntry.for_text("draft", text, **kw)


@pytest.fixture
def cfg():
    return config()


@pytest.fixture
def client(redis_server, cfg):
    with FactCheckClient(redis_server.url, cfg) as c:
        yield c


def test_submit_ready_wait_end_to_end(redis_server, redis_client, cfg, client):
    worker = Worker(redis_client, cfg, fc_annotators.impossible_dates, name="w1")
    tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    bad, good = draft(FEB30, request_id="r1", traceparent=tp), draft(PARIS, request_id="r1", start=0, end=5)
    with worker_thread(worker):
        report = client.submit([bad, good])
        assert (report.sent, report.skipped_known, report.unavailable) == (2, 0, 0)
        annotation = client.wait(bad.annotation_id, 5.0)
        assert annotation is not None and annotation.status == "done" and annotation.flagged
        (finding,) = annotation.findings
        assert FEB30[finding.start:finding.end] == "February 30" and finding.verdict == "contradicted"
        assert annotation.worker == "w1" and annotation.traceparent == tp  # carried through
        assert client.wait(good.annotation_id, 5.0) is not None
        found = client.ready([bad.annotation_id, good.annotation_id, "d-not-there"])
        assert set(found) == {bad.annotation_id, good.annotation_id}  # only what is ready
        assert not found[good.annotation_id].flagged and found[good.annotation_id].findings == ()
    assert client.ready([]) == {}
    assert worker.counters()["processed"] == 2
    assert client.available and client.stats()["sent"] == 2


def test_ready_is_one_round_trip_and_does_not_wait(redis_client, cfg, client):
    entries = [draft(f"Span number {i} mentions February 30.") for i in range(50)]
    client.submit(entries)
    worker = Worker(redis_client, cfg, fc_annotators.impossible_dates)
    for _ in range(25):  # half of them
        worker.run_once()
    commands = []
    original = client.redis.execute_command
    client.redis.execute_command = lambda *a, **kw: commands.append(a[0]) or original(*a, **kw)
    t0 = time.perf_counter()
    found = client.ready(e.annotation_id for e in entries)
    elapsed = time.perf_counter() - t0
    del client.redis.execute_command
    assert commands == ["MGET"] and len(found) == 25 and elapsed < 0.5


def test_many_waiters_on_one_id_all_wake(redis_client, cfg, client):
    entry = draft(FEB30)
    results = []
    waiters = [threading.Thread(target=lambda: results.append(client.wait(entry.annotation_id, 5.0))) for _ in range(3)]
    for t in waiters:
        t.start()
    time.sleep(0.1)  # they are blocked now
    t0 = time.monotonic()
    with worker_thread(Worker(redis_client, cfg, fc_annotators.impossible_dates)):
        client.submit([entry])
        for t in waiters:
            t.join(6)
    assert len(results) == 3 and all(r is not None and r.flagged for r in results)
    assert time.monotonic() - t0 < 3  # woken, not timed out


def test_wait_is_bounded(client):
    t0 = time.monotonic()
    assert client.wait("d-never-submitted", 0.3) is None
    assert 0.25 < time.monotonic() - t0 < 1.5
    assert client.stats()["wait_timeouts"] == 1


def test_check_text_enqueues_waits_and_reuses(redis_client, cfg, client):
    with worker_thread(Worker(redis_client, cfg, fc_annotators.impossible_dates)):
        annotation = client.check_text("Napoleon was born on February 31, 1769.", timeout_s=5.0)
        assert annotation is not None and annotation.flagged and annotation.annotation_id.startswith("q-")
    t0 = time.monotonic()
    again = client.check_text("Napoleon was born on February 31, 1769.", timeout_s=5.0)  # no worker now: cached
    assert again == annotation and time.monotonic() - t0 < 0.5
    t0 = time.monotonic()
    assert client.check_text("Nobody is reading this stream.", timeout_s=0.3) is None
    assert time.monotonic() - t0 < 1.5
    with pytest.raises(ValueError):
        client.check_text("   ")


def test_submit_skips_recently_submitted_ids(client, redis_client, cfg):
    a, b = draft("Span A is long enough."), draft("Span B is long enough.")
    report = client.submit([a, b, a])
    assert (report.sent, report.skipped_backpressure, report.skipped_known, report.unavailable) == (2, 0, 1, 0)
    assert client.submit([a, b]).skipped_known == 2  # the same drafts proposed in the next step
    client.forget([a.annotation_id])
    assert client.submit([a, b]).sent == 1
    assert redis_client.xlen(StreamNames.from_prefix(cfg.stream_prefix).stream) == 3
    stats = client.stats()
    assert (stats["sent"], stats["skipped_known"]) == (3, 4)


def test_known_ids_expire_and_are_bounded(redis_server, cfg):
    with FactCheckClient(redis_server.url, cfg, known_ttl_s=0.05, known_size=2) as c:
        a, b, d = (draft(f"Span {x} is here.") for x in "ABD")
        assert c.submit([a]).sent == 1
        time.sleep(0.06)
        assert c.submit([a]).sent == 1  # forgotten after known_ttl_s
        c.submit([b, d])  # a is evicted (LRU of 2)
        assert c.submit([a]).sent == 1


def test_backpressure_skips_and_counts(redis_server, redis_client):
    cfg = config(max_lag=5)
    names = StreamNames.from_prefix(cfg.stream_prefix)
    with FactCheckClient(redis_server.url, cfg, lag_cache_s=10.0) as c:
        batch = lambda tag, n: [draft(f"Span {tag}{i} for the lag test.") for i in range(n)]  # noqa: E731
        assert c.submit(batch("a", 3)).sent == 3  # no stream, no group: lag 0
        r = c.submit(batch("b", 3))  # the cached lag counts what this client sent
        assert (r.sent, r.skipped_backpressure) == (2, 1)
        assert c.submit(batch("c", 2)).skipped_backpressure == 2
        assert c.lag(refresh=True) == 5 == redis_client.xlen(names.stream)  # no group: the stream length
        assert c.stats()["skipped_backpressure"] == 3
        with pytest.raises(FactCheckBusy):
            c.check_text("An on-demand check under back-pressure.", 0.1)
        # A worker drains the stream: the producer is let through again.
        drain = config(stream_prefix=cfg.stream_prefix, concurrency=5)
        worker = Worker(redis_client, drain, fc_annotators.impossible_dates)
        assert worker.run_once() == 5
        assert c.lag(refresh=True) == 0
        assert c.submit(batch("d", 2)).sent == 2
        assert c.lag(refresh=True) == 2  # Redis 7: the group's lag field


def test_stream_stays_bounded_by_maxlen(redis_server, redis_client):
    cfg = config(maxlen=10, max_lag=100_000)
    with FactCheckClient(redis_server.url, cfg) as c:
        for start in range(0, 400, 50):
            assert c.submit([draft(f"Span {i} of many.") for i in range(start, start + 50)]).sent == 50
    length = redis_client.xlen(StreamNames.from_prefix(cfg.stream_prefix).stream)
    assert length <= cfg.maxlen + 100  # MAXLEN ~ trims whole stream nodes (100 entries by default)


# -- Redis down ----------------------------------------------------------------------------


def assert_fast_and_quiet(c: FactCheckClient, entry: SpanEntry) -> None:
    for _ in range(5):
        t0 = time.perf_counter()
        report = c.submit([entry])
        found = c.ready([entry.annotation_id])
        waited = c.wait(entry.annotation_id, 2.0)
        assert time.perf_counter() - t0 < 0.1, "a call took more than 100 ms with Redis down"
        assert report.unavailable == 1 and report.sent == 0 and found == {} and waited is None
    assert not c.available


def test_closed_port_never_raises_and_never_blocks():
    cfg = config()
    with FactCheckClient(f"redis://127.0.0.1:{free_port()}/0", cfg) as c:
        entry = draft(FEB30)
        t0 = time.perf_counter()
        assert c.submit([entry]).unavailable == 1  # the first failure
        assert time.perf_counter() - t0 < 1.0
        assert_fast_and_quiet(c, entry)
        with pytest.raises(FactCheckUnavailable):
            c.check_text("Is Redis there?", 1.0)
        stats = c.stats()
        assert stats["unavailable"] >= 11 and stats["errors"] == 1  # one real attempt; the breaker answered the rest


def _start_plain_redis(port: int, workdir: Path) -> subprocess.Popen:
    proc = subprocess.Popen([find_redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(workdir)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    wait_for(lambda: _answers_ping("127.0.0.1", port), 10, "redis-server to answer PING")
    return proc


def test_redis_dies_then_returns(tmp_path):
    if find_redis_server() is None:
        pytest.skip("no redis-server binary")
    server = EmbeddedRedis().start()
    port, url = server.port, server.url
    cfg = config()
    with FactCheckClient(url, cfg, breaker_s=0.3) as c:
        entry = draft(FEB30)
        assert c.submit([draft(PARIS)]).sent == 1 and c.available  # a pooled connection exists now
        server.stop()
        assert c.submit([entry]).unavailable == 1
        assert_fast_and_quiet(c, entry)
        proc = _start_plain_redis(port, tmp_path)  # the same address comes back
        try:
            time.sleep(0.7)  # the breaker's pause (doubled once by the failures above)
            wait_for(lambda: c.submit([entry]).sent == 1, 3, "the client to reconnect")
            assert c.available
        finally:
            proc.terminate()
            proc.wait(10)


# -- Redis 6.2: no lag field in XINFO GROUPS ---------------------------------------------------


def test_lag_without_the_lag_field(redis62):
    import redis

    r = redis.Redis.from_url(redis62.url)
    assert "lag" not in str(r.execute_command("XINFO", "HELP"))  # really the old server
    cfg = config(max_lag=4, concurrency=2)
    with FactCheckClient(redis62.url, cfg, lag_cache_s=0.0) as c:
        assert c.lag() == 0  # no stream
        assert c.submit([draft(f"Old server span {i}.") for i in range(3)]).sent == 3
        assert c.lag() == 3  # no group: the length
        worker = Worker(r, cfg, fc_annotators.impossible_dates)
        worker.ensure_group()
        assert c.lag() == 3  # counted after last-delivered-id
        assert worker.run_once() == 2
        assert c.lag() == 1
        r.xadd(c.names.stream, draft("One more span.").to_fields())
        for i in range(10):
            r.xadd(c.names.stream, draft(f"Many more span {i}.").to_fields())
        assert c.lag() == 5  # counting stops at max_lag + 1
    r.close()
