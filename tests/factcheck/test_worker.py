"""The worker against a real redis-server: idempotent writes, retries and the dead-letter
stream, malformed entries, a worker SIGKILLed mid-batch, a graceful SIGTERM, and its CLI."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import redis

from draftmesh.config import FactCheckConfig
from draftmesh.factcheck.client import FactCheckClient
from draftmesh.factcheck.protocol import Annotation, SpanEntry, StreamNames
from draftmesh.factcheck.worker import Worker, main
from draftmesh.io_struct import Finding
from draftmesh.redis_server import EmbeddedRedis

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import fc_annotators  # noqa: E402
from fc_annotators import calls, recording, total_calls, wait_for, worker_thread  # noqa: E402

FEB30 = "The treaty was signed on February 30, 1848."


def config(**overrides) -> FactCheckConfig:
    return FactCheckConfig(**{"stream_prefix": f"test:fc:{uuid.uuid4().hex[:12]}", "block_ms": 50, **overrides})


def draft(text: str, **kw) -> SpanEntry:
    return SpanEntry.for_text("draft", text, **kw)


def annotation(client: redis.Redis, names: StreamNames, annotation_id: str) -> Annotation | None:
    raw = client.get(names.annotation_key(annotation_id))
    return None if raw is None else Annotation.from_json(raw)


def pending(client: redis.Redis, names: StreamNames) -> int:
    return int(client.xpending(names.stream, names.group)["pending"])


def dead_letters(client: redis.Redis, names: StreamNames) -> list[dict[str, str]]:
    return [{k.decode(): v.decode() for k, v in f.items()} for _, f in client.xrange(names.dead_letter)]


# -- idempotency ---------------------------------------------------------------------------


def test_redelivered_entry_is_annotated_and_written_once(redis_server, redis_client):
    cfg = config()
    names = StreamNames.from_prefix(cfg.stream_prefix)
    entry = draft(FEB30)
    for _ in range(2):  # two producers (or a producer restart) queue the same span
        redis_client.xadd(names.stream, entry.to_fields())
    worker = Worker(redis_client, cfg, recording(redis_server.url, cfg.stream_prefix), name="w1")
    assert worker.run_once() == 1 and worker.run_once() == 1
    counters = worker.counters()
    assert (counters["processed"], counters["duplicates"]) == (1, 1)
    assert calls(redis_client, cfg.stream_prefix, entry.annotation_id) == [str(os.getpid())]  # annotated once
    written = annotation(redis_client, names, entry.annotation_id)
    assert written.status == "done" and written.flagged and written.worker == "w1"
    assert pending(redis_client, names) == 0
    assert redis_client.ttl(names.annotation_key(entry.annotation_id)) > cfg.annotation_ttl_s - 10


def test_an_annotation_written_meanwhile_is_not_overwritten(redis_client):
    """Two workers annotating the same id at once: SET NX keeps the first write."""
    cfg = config()
    names = StreamNames.from_prefix(cfg.stream_prefix)
    entry = draft(FEB30)
    first = Annotation(entry.annotation_id, "done", (), "other-worker", 1.0)

    def racing(span: SpanEntry) -> list[Finding]:
        redis_client.set(names.annotation_key(span.annotation_id), first.to_json())
        return fc_annotators.impossible_dates(span)

    redis_client.xadd(names.stream, entry.to_fields())
    worker = Worker(redis_client, cfg, racing)
    worker.run_once()
    assert annotation(redis_client, names, entry.annotation_id) == first
    assert (worker.counters()["processed"], worker.counters()["duplicates"]) == (0, 1)
    assert pending(redis_client, names) == 0
    assert redis_client.lrange(names.done_key(entry.annotation_id), 0, -1) == [b"1"]  # waiters still woken


# -- failures and the dead-letter stream ---------------------------------------------------------


def test_poison_is_retried_then_dead_lettered_with_its_error(redis_server, redis_client):
    cfg = config(max_deliveries=2, claim_idle_ms=50)
    names = StreamNames.from_prefix(cfg.stream_prefix)
    entry = draft("This span is poison for the checker.")
    with FactCheckClient(redis_server.url, cfg) as client:
        client.submit([entry])
        annotate = fc_annotators.poison(config(redis_url=redis_server.url, stream_prefix=cfg.stream_prefix))
        worker = Worker(redis_client, cfg, annotate)
        assert worker.run_once() == 1  # delivery 1 raises: left pending, error recorded
        assert pending(redis_client, names) == 1 and annotation(redis_client, names, entry.annotation_id) is None
        (recorded,) = redis_client.hvals(names.errors)
        assert "poisoned span" in json.loads(recorded)["error"]
        assert worker.run_once() == 0  # not idle long enough to be reclaimed yet
        time.sleep(0.08)
        assert worker.run_once() == 1  # delivery 2 (the last allowed) raises: dead letter
        (dead,) = dead_letters(redis_client, names)
        assert dead["reason"] == "max_deliveries" and "RuntimeError: poisoned span" in dead["error"]
        assert dead["deliveries"] == "2" and dead["annotation_id"] == entry.annotation_id
        assert json.loads(dead["fields"])["text"] == entry.text
        failed = client.wait(entry.annotation_id, 1.0)  # waiters get an answer, not a hang
        assert failed.status == "failed" and "poisoned span" in failed.error and failed.findings == ()
    assert pending(redis_client, names) == 0 and redis_client.hlen(names.errors) == 0
    assert calls(redis_client, cfg.stream_prefix, entry.annotation_id) == [str(os.getpid())] * 2
    counters = worker.counters()
    assert (counters["failed"], counters["dead_lettered"], counters["reclaimed"]) == (2, 1, 1)


def test_entry_whose_workers_keep_dying_is_dead_lettered(redis_client):
    cfg = config(max_deliveries=2, claim_idle_ms=0)
    names = StreamNames.from_prefix(cfg.stream_prefix)
    entry = draft(FEB30)
    redis_client.xgroup_create(names.stream, names.group, id="0", mkstream=True)
    entry_id = redis_client.xadd(names.stream, entry.to_fields())
    redis_client.xreadgroup(names.group, "dead-1", {names.stream: ">"})  # a worker takes it and dies
    redis_client.xclaim(names.stream, names.group, "dead-2", 0, [entry_id])  # and the next one
    annotate_calls = []
    worker = Worker(redis_client, cfg, lambda span: annotate_calls.append(span) or [])
    assert worker.run_once() == 1  # delivery 3 > 2
    (dead,) = dead_letters(redis_client, names)
    assert dead["reason"] == "max_deliveries" and "no error recorded" in dead["error"] and dead["deliveries"] == "3"
    assert annotate_calls == [] and annotation(redis_client, names, entry.annotation_id).status == "failed"
    assert pending(redis_client, names) == 0


def test_malformed_entries_are_dead_lettered_and_the_worker_goes_on(redis_client):
    cfg = config()
    names = StreamNames.from_prefix(cfg.stream_prefix)
    bad = [
        ({"v": "1", "kind": "draft", "text": "no id"}, "missing field 'id'"),
        ({"v": "1", "id": "d-essay", "kind": "essay", "text": "x"}, "kind must be one of"),
        ({"v": "1", "id": "d-bytes", "kind": "draft", "text": b"\xff\xfe"}, "not valid UTF-8"),
        ({"v": "9", "id": "d-v9", "kind": "draft", "text": "x"}, "unsupported protocol version"),
        ({"v": "1", "id": "d-off", "kind": "draft", "text": "t", "start": "5", "end": "2"}, "before start"),
    ]
    for fields, _ in bad:
        redis_client.xadd(names.stream, fields)
    good = draft(FEB30)
    redis_client.xadd(names.stream, good.to_fields())
    worker = Worker(redis_client, config(stream_prefix=cfg.stream_prefix, concurrency=2), fc_annotators.impossible_dates)
    with worker_thread(worker) as thread:
        wait_for(lambda: annotation(redis_client, names, good.annotation_id), 5, "the good entry")
        letters = dead_letters(redis_client, names)
        assert [d["reason"] for d in letters] == ["malformed"] * len(bad)
        assert sorted(d["error"] for d in letters) == sorted(
            next(d["error"] for d in letters if reason in d["error"]) for _, reason in bad
        )
        assert "\\xff" in next(d["fields"] for d in letters if "UTF-8" in d["error"])  # raw bytes kept, readable
        later = draft("A later span, still processed.")
        redis_client.xadd(names.stream, later.to_fields())
        wait_for(lambda: annotation(redis_client, names, later.annotation_id), 5, "the later entry")
        assert thread.is_alive()
    # An entry with a usable id gets a "failed" annotation, so its waiter is not left hanging.
    assert annotation(redis_client, names, "d-essay").status == "failed"
    assert "kind must be one of" in annotation(redis_client, names, "d-essay").error
    assert pending(redis_client, names) == 0
    assert worker.counters()["malformed"] == len(bad) and worker.counters()["processed"] == 2


@pytest.mark.parametrize("version", ["7", "6.2"])
def test_pending_entries_trimmed_away_are_acked(version, request):
    """A dead worker's pending entries that MAXLEN trimmed are dropped, on old servers too."""
    server = request.getfixturevalue("redis_server" if version == "7" else "redis62")
    r = redis.Redis.from_url(server.url)
    cfg = config(claim_idle_ms=0)
    names = StreamNames.from_prefix(cfg.stream_prefix)
    r.xgroup_create(names.stream, names.group, id="0", mkstream=True)
    for i in range(3):
        r.xadd(names.stream, draft(f"Span {i} to be trimmed.").to_fields())
    r.xreadgroup(names.group, "dead", {names.stream: ">"})
    r.xtrim(names.stream, maxlen=0, approximate=False)
    survivor = draft(FEB30)
    r.xadd(names.stream, survivor.to_fields())
    worker = Worker(r, cfg, fc_annotators.impossible_dates, name="w")
    for _ in range(4):
        worker.run_once()
    assert pending(r, names) == 0 and worker.counters()["trimmed"] == 3
    assert annotation(r, names, survivor.annotation_id).flagged
    r.close()


def test_failure_then_reclaim_on_redis_62(redis62):
    r = redis.Redis.from_url(redis62.url)
    cfg = config(max_deliveries=2, claim_idle_ms=30)
    names = StreamNames.from_prefix(cfg.stream_prefix)
    r.xadd(names.stream, draft("A poison span on an old server.").to_fields())
    worker = Worker(r, cfg, fc_annotators.poison(config(redis_url=redis62.url, stream_prefix=cfg.stream_prefix)))
    worker.run_once()
    time.sleep(0.05)
    worker.run_once()
    (dead,) = dead_letters(r, names)
    assert dead["reason"] == "max_deliveries" and "poisoned" in dead["error"] and pending(r, names) == 0
    r.close()


def test_slow_annotation_is_not_stolen_while_its_worker_lives(redis_server, redis_client):
    """The heartbeat keeps a long annotation's entry from being reclaimed by another worker."""
    cfg = config(claim_idle_ms=300, concurrency=1)
    names = StreamNames.from_prefix(cfg.stream_prefix)
    entry = draft(FEB30)
    slow = Worker(redis_client, cfg, recording(redis_server.url, cfg.stream_prefix, sleep_s=0.8, tag="slow"), "slow")
    other = Worker(redis_client, cfg, recording(redis_server.url, cfg.stream_prefix, tag="other"), name="other")
    with worker_thread(slow):
        redis_client.xadd(names.stream, entry.to_fields())
        wait_for(lambda: calls(redis_client, cfg.stream_prefix, entry.annotation_id), 5, "the slow worker to start")
        with worker_thread(other):
            wait_for(lambda: annotation(redis_client, names, entry.annotation_id), 5, "the annotation")
    assert calls(redis_client, cfg.stream_prefix, entry.annotation_id) == ["slow"]
    assert other.counters()["reclaimed"] == 0 and pending(redis_client, names) == 0


def test_worker_outlives_a_redis_restart(tmp_path):
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from draftmesh.redis_server import _answers_ping, find_redis_server

    server = EmbeddedRedis().start()
    port, url = server.port, server.url
    r = redis.Redis.from_url(url, socket_timeout=2, retry=Retry(NoBackoff(), 0))
    cfg = config()
    names = StreamNames.from_prefix(cfg.stream_prefix)
    worker = Worker(r, cfg, fc_annotators.impossible_dates)
    proc = None
    try:
        with worker_thread(worker) as thread:
            first = draft(FEB30)
            r.xadd(names.stream, first.to_fields())
            wait_for(lambda: annotation(r, names, first.annotation_id), 5, "the first annotation")
            server.stop()
            wait_for(lambda: worker.counters()["redis_errors"] >= 2, 5, "the worker to notice")
            proc = subprocess.Popen([find_redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                     "--appendonly", "no", "--dir", str(tmp_path)],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
            wait_for(lambda: _answers_ping("127.0.0.1", port), 10, "the new redis-server")
            second = draft("After the restart, on February 31.")
            r.xadd(names.stream, second.to_fields())  # an empty server: the group is made again
            wait_for(lambda: annotation(r, names, second.annotation_id), 10, "an annotation after the restart")
            assert thread.is_alive()
    finally:
        r.close()
        server.stop()
        if proc is not None:
            proc.terminate()
            proc.wait(10)


# -- worker processes: crash recovery, graceful shutdown, CLI -------------------------------------


def start_worker(url: str, prefix: str, name: str, *flags: str, slow_s: float) -> subprocess.Popen:
    env = {**os.environ, "FC_SLOW_S": str(slow_s), "FC_TAG": name,
           "PYTHONPATH": os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)}  # fmt: skip
    return subprocess.Popen(
        [sys.executable, "-m", "draftmesh.factcheck.worker", "--annotator", "fc_annotators:slow", "--redis-url", url,
         "--stream-prefix", prefix, "--name", name, "--block-ms", "50", *flags],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def wait_ready(proc: subprocess.Popen, timeout_s: float = 20.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if select.select([proc.stdout], [], [], 0.1)[0]:
            line = proc.stdout.readline()
            if "ready" in line:
                return line
        if proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError(f"worker not ready (rc {proc.poll()}): {proc.stderr.read()}")


def test_worker_killed_mid_batch_loses_nothing_and_writes_nothing_twice(redis_server, redis_client):
    cfg = config(concurrency=2, claim_idle_ms=300)
    prefix, names = cfg.stream_prefix, StreamNames.from_prefix(cfg.stream_prefix)
    entries = [draft(f"Span {i} of the batch{', on February 30' if i % 2 else ''}.") for i in range(8)]
    with FactCheckClient(redis_server.url, cfg) as client:
        assert client.submit(entries).sent == 8

    def written() -> int:
        return sum(annotation(redis_client, names, e.annotation_id) is not None for e in entries)

    proc = start_worker(redis_server.url, prefix, "A", "--concurrency", "2", slow_s=0.4)
    try:
        wait_ready(proc)
        # A has written some and is inside others (its calls are recorded before the sleep).
        wait_for(lambda: written() >= 2 and total_calls(redis_client, prefix) > written(), 10, "worker A mid-batch")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    proc.stdout.close(), proc.stderr.close()
    rows = redis_client.xpending_range(names.stream, names.group, "-", "+", 100, consumername="A")
    held = {r["message_id"] for r in rows}
    assert held, "worker A died holding nothing: the test did not kill it mid-batch"

    b = Worker(redis_client, cfg, recording(redis_server.url, prefix, sleep_s=0.02, tag="B"), name="B")
    with worker_thread(b):
        wait_for(lambda: written() == len(entries), 10, "every entry annotated")
    assert pending(redis_client, names) == 0
    recovered = 0
    for e in entries:
        a = annotation(redis_client, names, e.annotation_id)
        who = calls(redis_client, prefix, e.annotation_id)
        assert a.status == "done" and a.flagged == ("February 30" in e.text)
        assert who[-1] == a.worker  # the last annotator wrote it ...
        assert who in (["A"], ["B"], ["A", "B"])  # ... and nobody annotated a written span again
        recovered += who == ["A", "B"]  # killed inside annotate, finished by B
    assert 1 <= recovered <= len(held)
    assert b.counters()["reclaimed"] == len(held) and b.counters()["duplicates"] == 0
    assert b.counters()["processed"] + sum(calls(redis_client, prefix, e.annotation_id) == ["A"] for e in entries) == 8


def test_sigterm_finishes_in_flight_entries_and_exits_0(redis_server, redis_client):
    cfg = config()
    prefix, names = cfg.stream_prefix, StreamNames.from_prefix(cfg.stream_prefix)
    entries = [draft(f"Graceful span {i}.") for i in range(6)]
    proc = start_worker(redis_server.url, prefix, "G", "--concurrency", "2", slow_s=0.5)
    try:
        wait_ready(proc)
        # A started worker shows in the group (what `serve`'s launcher waits for) ...
        consumers = lambda: [c["name"] for c in redis_client.xinfo_consumers(names.stream, names.group)]  # noqa: E731
        wait_for(lambda: b"G" in consumers(), 5, "the worker to join the group")
        with FactCheckClient(redis_server.url, cfg) as client:
            assert client.submit(entries).sent == 6
        wait_for(lambda: total_calls(redis_client, prefix) >= 2, 10, "both slots busy")
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = proc.stderr.read()
    proc.stdout.close(), proc.stderr.close()
    assert rc == 0, stderr
    started = [e for e in entries if calls(redis_client, prefix, e.annotation_id)]
    done = [e for e in entries if annotation(redis_client, names, e.annotation_id)]
    assert 2 <= len(started) < 6 and done == started  # every started span was finished and written
    assert pending(redis_client, names) == 0  # ... and acked; nothing fetched was left behind
    assert b"G" not in consumers()  # ... and leaves it when it stops holding nothing
    rest = redis_client.xreadgroup(names.group, "next", {names.stream: ">"}, count=10)
    assert len(rest[0][1]) == 6 - len(done)  # the unread ones are still there for the next worker
    assert "stopped" in stderr


def test_cli_configuration_errors(monkeypatch, capsys, redis_server):
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.delenv("DRAFTMESH_FACTCHECK_REDIS_URL", raising=False)
    assert main(["--annotator", "fc_annotators:feb30"]) == 2
    assert "no Redis" in capsys.readouterr().err
    assert main(["--redis-url", redis_server.url, "--annotator", "no_such_module_xyz:f"]) == 2
    assert "cannot import annotator module" in capsys.readouterr().err
    assert main(["--redis-url", redis_server.url, "--annotator", "fc_annotators"]) == 2
    assert "module:callable" in capsys.readouterr().err
    assert main(["--redis-url", redis_server.url, "--annotator", "fc_annotators:nothing"]) == 2
    assert "no callable 'nothing'" in capsys.readouterr().err
    assert main(["--redis-url", redis_server.url, "--concurrency", "0", "--annotator", "fc_annotators:feb30"]) == 2
    assert "concurrency must be >= 1" in capsys.readouterr().err
