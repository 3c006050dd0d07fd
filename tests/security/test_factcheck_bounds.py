"""Fact-check streams and the FactCheck RPC under hostile or unlucky input (issue 18), against
a real redis-server: a hung annotator, spans trimmed before any worker read them, "failed"
annotations of content-keyed ids, and a flood of FactCheck waits."""

from __future__ import annotations

import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis

from draftmesh.config import FactCheckConfig
from draftmesh.factcheck.client import FactCheckBusy, FactCheckClient, FactCheckNotFound
from draftmesh.factcheck.protocol import Annotation, SpanEntry, StreamNames, annotation_id_for_text
from draftmesh.factcheck.worker import Worker
from draftmesh.io_struct import Finding

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "factcheck"))
import fc_annotators  # noqa: E402
from fc_annotators import wait_for, worker_thread  # noqa: E402


def config(**overrides) -> FactCheckConfig:
    return FactCheckConfig(**{"stream_prefix": f"test:sec:{uuid.uuid4().hex[:12]}", "block_ms": 50, **overrides})


def dead_letters(client: redis.Redis, names: StreamNames) -> list[dict[str, str]]:
    return [{k.decode(): v.decode() for k, v in f.items()} for _, f in client.xrange(names.dead_letter)]


@pytest.fixture
def release():
    """An event hung annotators wait on; set at teardown so no thread outlives the test for long."""
    event = threading.Event()
    yield event
    event.set()


# -- a hung annotate -----------------------------------------------------------------------------


def test_a_hung_annotate_times_out_is_retried_then_dead_lettered(redis_server, redis_client, release):
    cfg = config(annotate_timeout_s=0.2, claim_idle_ms=150, max_deliveries=2, concurrency=3)
    names = StreamNames.from_prefix(cfg.stream_prefix)
    started = []

    def hang(entry: SpanEntry) -> list[Finding]:
        started.append(time.monotonic())
        release.wait(60)
        return []

    entry = SpanEntry.for_text("draft", "A span whose check never returns.")
    worker = Worker(redis_client, cfg, hang, name="hung")
    with FactCheckClient(redis_server.url, cfg) as client, worker_thread(worker):
        client.submit([entry])
        failed = client.wait(entry.annotation_id, 10.0)  # the heartbeat used to keep it forever
        assert failed is not None and failed.status == "failed", failed
        assert "annotate_timeout_s" in failed.error
        (dead,) = dead_letters(redis_client, names)
        assert dead["reason"] == "max_deliveries" and dead["deliveries"] == "2"
        # the retry waits for the claim idle time after the last heartbeat, which stops at the timeout
        assert len(started) == 2 and started[1] - started[0] >= 0.15
        assert int(redis_client.xpending(names.stream, names.group)["pending"]) == 0
    assert worker.counters()["timeouts"] == 2 and not worker.stuck


def test_a_worker_whose_annotations_all_hang_stops(redis_client, release):
    cfg = config(annotate_timeout_s=0.1, claim_idle_ms=100, max_deliveries=5, concurrency=2)
    names = StreamNames.from_prefix(cfg.stream_prefix)
    worker = Worker(redis_client, cfg, lambda entry: release.wait(60) and [], name="stuck")
    for i in range(3):
        redis_client.xadd(names.stream, SpanEntry.for_text("draft", f"Hanging span {i}.").to_fields())
    thread = threading.Thread(target=worker.run, args=(threading.Event(),), daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive() and worker.stuck and worker.hung() == 2  # bounded: no third hung thread
    release.set()
    wait_for(lambda: worker.hung() == 0, 5, "the abandoned calls to end")


# -- spans trimmed before any worker read them ---------------------------------------------------


def test_a_span_trimmed_before_processing_ends_the_wait_as_failed(redis_server, redis_client):
    cfg = config(maxlen=10)
    names = StreamNames.from_prefix(cfg.stream_prefix)
    first = SpanEntry.for_text("output", "The first output, soon trimmed.", request_id="r1")
    with FactCheckClient(redis_server.url, cfg) as client:
        assert client.submit([first]).sent == 1
        for i in range(300):  # no worker yet: MAXLEN ~ 10 trims the first entry away
            redis_client.xadd(names.stream, {"v": "1", "id": f"q-{i:032x}", "kind": "query", "text": "x"},
                              maxlen=cfg.maxlen, approximate=True)
        assert redis_client.xlen(names.stream) < 300
        t0 = time.monotonic()
        lost = client.wait(first.annotation_id, 30.0)
        assert time.monotonic() - t0 < 5.0  # not the whole 30 s
        assert lost is not None and lost.status == "failed" and "trimmed" in lost.error
        assert client.stats()["lost"] == 1
        # Readers that do not wait see it too, and a later waiter gets the same answer at once.
        assert client.ready([first.annotation_id])[first.annotation_id].status == "failed"
        assert client.wait(first.annotation_id, 5.0).error == lost.error


def test_a_queued_span_is_not_taken_for_lost(redis_server, redis_client):
    """An entry still in the stream, or held by a worker after the stream dropped it, is waited for."""
    cfg = config()
    names = StreamNames.from_prefix(cfg.stream_prefix)
    entry = SpanEntry.for_text("draft", "A span a worker holds while it is trimmed.")
    with FactCheckClient(redis_server.url, cfg) as client:
        client.submit([entry])
        assert client.wait(entry.annotation_id, 0.3) is None  # queued: a plain timeout
        redis_client.xgroup_create(names.stream, names.group, id="0")
        redis_client.xreadgroup(names.group, "w", {names.stream: ">"})  # a worker holds it...
        redis_client.xtrim(names.stream, maxlen=0, approximate=False)  # ...and the stream drops it
        assert client.wait(entry.annotation_id, 0.3) is None and client.stats()["lost"] == 0


# -- failed annotations of content-keyed ids -----------------------------------------------------


def test_a_failed_annotation_of_a_text_keyed_id_expires_soon(redis_server, redis_client):
    cfg = config(max_deliveries=1, failed_ttl_s=2, annotation_ttl_s=3600)
    names = StreamNames.from_prefix(cfg.stream_prefix)
    query = SpanEntry.for_text("query", "This query trips the poisoned checker: poison.")
    output = SpanEntry.for_text("output", "This output trips it too: poison.", request_id="r9")
    annotate = fc_annotators.poison(config(redis_url=redis_server.url, stream_prefix=cfg.stream_prefix))
    worker = Worker(redis_client, cfg, annotate, name="w")
    with FactCheckClient(redis_server.url, cfg) as client:
        client.submit([query, output])
        while worker.run_once():
            pass
        assert client.wait(query.annotation_id, 1.0).status == "failed"
        assert 0 < redis_client.ttl(names.annotation_key(query.annotation_id)) <= 2
        assert redis_client.ttl(names.annotation_key(output.annotation_id)) > 3000  # the request's record
        wait_for(lambda: not redis_client.exists(names.annotation_key(query.annotation_id)), 5, "the failure to expire")
        # The same text can be checked again now (a healthy worker this time).
        healthy = Worker(redis_client, cfg, fc_annotators.impossible_dates, name="ok")
        with worker_thread(healthy):
            again = client.check_text(query.text, 5.0)
        assert again is not None and again.status == "done"


# -- the FactCheck RPC's admission (client side) -------------------------------------------------


def test_fetch_of_an_id_that_cannot_exist_is_not_found_at_once(redis_server):
    with FactCheckClient(redis_server.url, config()) as client:
        for bad in ("x", "d-123", "o-" + "g" * 32):
            with pytest.raises(FactCheckNotFound, match="not an annotation id"):
                client.fetch(bad, 60.0)
        never = annotation_id_for_text("output", "never produced", "no-such-request")
        t0 = time.monotonic()
        with pytest.raises(FactCheckNotFound, match="was queued"):
            client.fetch(never, 60.0)
        assert time.monotonic() - t0 < 1.0


def test_factcheck_waits_are_capped_in_number_and_length(redis_server):
    cfg = config(max_waiters=3, max_wait_ms=1500)
    entry = SpanEntry.for_text("output", "An output no worker annotates.", request_id="r1")
    with FactCheckClient(redis_server.url, cfg) as client:
        client.submit([entry])  # queued, so the id exists; there is no worker
        t0 = time.monotonic()

        def call(_):
            try:
                return client.fetch(entry.annotation_id, 60.0)
            except FactCheckBusy as exc:
                return exc

        with ThreadPoolExecutor(40) as pool:  # the flood: 40 calls asking for 60 s each
            results = list(pool.map(call, range(40)))
        elapsed = time.monotonic() - t0
        busy = [r for r in results if isinstance(r, FactCheckBusy)]
        assert len(busy) >= 40 - 3 and all("factcheck.max_waiters 3" in str(b) for b in busy)
        assert all(r is None for r in results if not isinstance(r, FactCheckBusy))  # timed out, still queued
        assert 1.4 < elapsed < 5.0, elapsed  # the cap, not 60 s
        # A zero-length read never takes a slot.
        assert client.fetch(entry.annotation_id, 0.0) is None
