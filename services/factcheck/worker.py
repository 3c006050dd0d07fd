"""The fact-check worker: reads spans from the stream, annotates them, writes the results.

Delivery is at-least-once (a consumer group; entries stay pending until acked) and the
effect exactly-once per annotation id: an id whose annotation exists is not annotated
again, and the annotation is written with SET NX in the same MULTI as the XACK, so a
redelivered or duplicated entry never writes twice.

Each round (``run_once``, or the loop of ``run``):

1. heartbeat: entries still being annotated get their idle time reset (XCLAIM JUSTID), so
   a slow but alive worker does not lose them to the reclaimer;
2. reclaim: entries idle longer than ``claim_idle_ms`` (their worker died, or annotate
   raised) are taken over with XAUTOCLAIM; one delivered more than ``max_deliveries``
   times goes to the dead-letter stream with its last error, and a "failed" annotation is
   written so that nobody waits for it in vain;
3. read: XREADGROUP ``>``, at most as many entries as there are free slots, so a stopping
   worker never holds fetched-but-unstarted entries;
4. per entry: malformed -> dead letter with the reason, acked at once; annotation already
   there -> counted as duplicate, acked; else annotate; an exception is recorded in the
   ``errors`` hash and the entry is left pending for a retry (or dead-lettered if this was
   its last allowed delivery).

Shutdown (SIGTERM/SIGINT in the CLI, ``stop_event`` in ``run``) stops reading, lets the
in-flight entries finish and acks them, and removes the consumer from the group when it
holds nothing pending.

Bounds: one annotation may take ``annotate_timeout_s``; past it the entry is failed like an
annotate that raised (retried after ``claim_idle_ms``, dead-lettered after ``max_deliveries``)
and leaves the heartbeat, while the call itself is abandoned on its daemon thread (a thread
cannot be killed). An abandoned call keeps its slot while it runs, so at most
``concurrency`` annotate calls ever run at once; a worker whose slots are all hung stops
(``run`` returns, the CLI exits 3) so that its supervisor starts a fresh one. A "failed"
annotation of a content-keyed id lives ``failed_ttl_s``, so the same text is checked again soon.
"""

from __future__ import annotations

import argparse
import contextvars
import importlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import redis

from draftmesh import tracing
from draftmesh.config import FactCheckConfig, add_config_arguments, config_from_args
from draftmesh.factcheck.protocol import Annotation, MalformedEntry, SpanEntry, StreamNames, as_str, failed_ttl
from draftmesh.io_struct import Finding
from draftmesh.tracing import SpanKind

log = logging.getLogger(__name__)
_tracer = tracing.tracer("draftmesh.factcheck")

Annotate = Callable[[SpanEntry], "list[Finding]"]
DEFAULT_ANNOTATOR = "draftmesh.factcheck.checker:build_annotator"
MAX_ERROR_CHARS = 2000
EXIT_STUCK = 3
"""The CLI's exit status when the worker stopped because its annotations hang."""


class AnnotateTimeout(TimeoutError):
    """``annotate`` did not return within ``annotate_timeout_s``."""


@dataclass(frozen=True)
class _Item:
    """One delivered stream entry: its id, raw fields (None if trimmed away) and delivery count."""

    entry_id: str
    fields: dict[Any, Any] | None
    deliveries: int


def _printable_fields(fields: dict[Any, Any] | None) -> str:
    """The raw entry for the dead letter, whatever bytes it held."""
    if not fields:
        return "{}"
    def show(v: Any) -> str:
        return v.decode("utf-8", "backslashreplace") if isinstance(v, bytes) else str(v)
    return json.dumps({show(k): show(v)[:MAX_ERROR_CHARS] for k, v in fields.items()}, ensure_ascii=False)


def default_worker_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class Worker:
    """A consumer of the span stream (``concurrency`` spans annotated at once, in threads).

    ``redis_client``: a ``redis.Redis`` whose socket timeout (if any) exceeds ``block_ms``.
    ``annotate``: SpanEntry -> list of Finding; it may raise (the entry is retried)."""

    def __init__(
        self, redis_client: redis.Redis, config: FactCheckConfig, annotate: Annotate, name: str | None = None
    ) -> None:
        self.redis, self.config, self.annotate = redis_client, config, annotate
        self.name = name or default_worker_name()
        self.names = StreamNames.from_prefix(config.stream_prefix)
        self.concurrency = config.concurrency
        self._lock = threading.Condition()
        self._inflight: set[str] = set()
        self._group_ready = False
        self._claim_cursor = "0-0"
        self._next_claim = 0.0
        self._last_heartbeat = time.monotonic()
        self._abandoned: list[threading.Thread] = []
        self.stuck = False
        """Set when ``run`` stopped because ``concurrency`` abandoned annotate calls still run."""
        self._counters = dict.fromkeys(
            ("processed", "duplicates", "failed", "dead_lettered", "malformed", "reclaimed", "trimmed",
             "redis_errors", "timeouts"), 0
        )

    # -- bookkeeping ----------------------------------------------------------------------

    def counters(self) -> dict[str, int]:
        """processed (annotations written), duplicates (id already annotated: not rewritten),
        failed (annotate raised), dead_lettered (of which malformed), reclaimed (taken over
        from an idle consumer), trimmed (pending entries the stream had dropped), redis_errors,
        timeouts (annotate calls abandoned after ``annotate_timeout_s``)."""
        with self._lock:
            return dict(self._counters)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n

    def ensure_group(self) -> None:
        """Create the consumer group (and the stream) if missing, reading from the start, and
        join it: XREADGROUP on an empty stream does not create the consumer, and launchers
        wait for a worker to show in XINFO CONSUMERS."""
        if self._group_ready:
            return
        try:
            self.redis.xgroup_create(self.names.stream, self.names.group, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self.redis.xgroup_createconsumer(self.names.stream, self.names.group, self.name)
        self._group_ready = True

    # -- fetching -----------------------------------------------------------------------------

    def _heartbeat(self) -> None:
        interval = self.config.claim_idle_ms / 3000
        with self._lock:
            ids = list(self._inflight)
        if not ids or not interval or time.monotonic() - self._last_heartbeat < interval:
            return
        self.redis.xclaim(self.names.stream, self.names.group, self.name, 0, ids, justid=True)
        self._last_heartbeat = time.monotonic()

    def _claim(self, count: int) -> list[_Item]:
        """Take over up to ``count`` entries idle for ``claim_idle_ms``, with their delivery counts."""
        if time.monotonic() < self._next_claim:
            return []
        reply = self.redis.xautoclaim(
            self.names.stream, self.names.group, self.name, self.config.claim_idle_ms,
            start_id=self._claim_cursor, count=count,
        )  # fmt: skip
        cursor, claimed = as_str(reply[0]), reply[1]
        deleted = [as_str(i) for i in reply[2]] if len(reply) > 2 else []  # Redis 7 drops them from the PEL
        self._claim_cursor = cursor
        if deleted:
            self._count("trimmed", len(deleted))
            self.redis.hdel(self.names.errors, *deleted)
        if any(entry_id is None for entry_id, _ in claimed):
            self._ack_trimmed()  # Redis 6.2: a trimmed entry comes back as nil, id unknown
        items = [(as_str(i), f) for i, f in claimed if i is not None]
        with self._lock:
            items = [(i, f) for i, f in items if i not in self._inflight]  # our own, still running
        if not items:
            if cursor == "0-0":  # a full scan found nothing to take over: pause the scans a little
                self._next_claim = time.monotonic() + min(1.0, self.config.claim_idle_ms / 2000)
            return []
        pipe = self.redis.pipeline(transaction=False)
        for entry_id, _ in items:
            pipe.xpending_range(self.names.stream, self.names.group, entry_id, entry_id, 1)
        counts = []
        for rows in pipe.execute():
            counts.append(int(rows[0]["times_delivered"]) if rows else 1)
        self._count("reclaimed", len(items))
        self._next_claim = 0.0  # there may be more: look again next round
        return [_Item(i, f, n) for (i, f), n in zip(items, counts, strict=True)]

    def _ack_trimmed(self) -> None:
        """Ack our pending entries that no longer exist in the stream (trimmed by MAXLEN)."""
        rows = self.redis.xpending_range(self.names.stream, self.names.group, "-", "+", 1000, consumername=self.name)
        ids = [as_str(r["message_id"]) for r in rows]
        with self._lock:
            ids = [i for i in ids if i not in self._inflight]
        if not ids:
            return
        pipe = self.redis.pipeline(transaction=False)
        for entry_id in ids:
            pipe.xrange(self.names.stream, entry_id, entry_id, count=1)
        gone = [i for i, found in zip(ids, pipe.execute(), strict=True) if not found]
        if gone:
            pipe = self.redis.pipeline(transaction=True)
            pipe.xack(self.names.stream, self.names.group, *gone).hdel(self.names.errors, *gone)
            pipe.execute()
            self._count("trimmed", len(gone))

    def _read(self, count: int, block_ms: int | None) -> list[_Item]:
        reply = self.redis.xreadgroup(
            self.names.group, self.name, {self.names.stream: ">"}, count=count, block=block_ms or None
        )
        if not reply:
            return []
        if isinstance(reply, dict):  # RESP3
            entries = next(iter(reply.values()))[0] if reply else []
        else:
            entries = reply[0][1]
        return [_Item(as_str(i), f, 1) for i, f in entries]

    def fetch(self, count: int, block_ms: int | None = None) -> list[_Item]:
        """Reclaimed entries first, else up to ``count`` new ones (waiting up to ``block_ms``)."""
        self.ensure_group()
        self._heartbeat()
        items = self._claim(count)
        if not items:
            items = self._read(count, block_ms)
        return items

    # -- one entry ------------------------------------------------------------------------

    def _notify(self, pipe: redis.client.Pipeline, annotation_id: str) -> None:
        done = self.names.done_key(annotation_id)
        pipe.lpush(done, b"1").ltrim(done, 0, 0).expire(done, self.config.annotation_ttl_s)

    def _ack(self, pipe: redis.client.Pipeline, entry_id: str) -> None:
        pipe.xack(self.names.stream, self.names.group, entry_id).hdel(self.names.errors, entry_id)

    def _dead_letter(
        self, item: _Item, reason: str, error: str, annotation_id: str = "", traceparent: str = ""
    ) -> None:
        """Move an entry to the dead-letter stream, ack it, and write a "failed" annotation
        (if the id is known and none exists) so that waiters get an answer."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.xadd(self.names.dead_letter, {
            "entry_id": item.entry_id, "reason": reason, "error": error[:MAX_ERROR_CHARS],
            "deliveries": str(item.deliveries), "worker": self.name, "annotation_id": annotation_id,
            "fields": _printable_fields(item.fields), "time": f"{time.time():.3f}",
        }, maxlen=self.config.maxlen, approximate=True)  # fmt: skip
        if annotation_id:
            error = f"{reason}: {error}"[:MAX_ERROR_CHARS]
            failed = Annotation(annotation_id, "failed", (), self.name, 0.0, error, traceparent)
            key = self.names.annotation_key(annotation_id)
            ttl = failed_ttl(annotation_id, self.config.failed_ttl_s, self.config.annotation_ttl_s)
            pipe.set(key, failed.to_json(), nx=True, ex=ttl)
            self._notify(pipe, annotation_id)
        self._ack(pipe, item.entry_id)
        pipe.execute()
        self._count("dead_lettered")
        log.warning("dead-lettered entry %s (%s): %s", item.entry_id, reason, error[:200])

    def _last_error(self, entry_id: str) -> str:
        raw = self.redis.hget(self.names.errors, entry_id)
        if raw is None:
            return "no error recorded (the worker holding it stopped or died)"
        try:
            return str(json.loads(raw)["error"])
        except (ValueError, KeyError, TypeError):
            return as_str(raw)

    def handle(self, item: _Item) -> None:
        """Annotate one delivered entry and settle it (ack, retry later, or dead letter)."""
        if item.fields is None:  # trimmed away while pending (should not reach here)
            pipe = self.redis.pipeline(transaction=True)
            self._ack(pipe, item.entry_id)
            pipe.execute()
            self._count("trimmed")
            return
        try:
            entry = SpanEntry.from_fields(item.fields)
        except MalformedEntry as exc:
            self._count("malformed")
            self._dead_letter(item, "malformed", exc.reason, exc.annotation_id)
            return
        if item.deliveries > self.config.max_deliveries:
            self._dead_letter(
                item, "max_deliveries", self._last_error(item.entry_id), entry.annotation_id, entry.traceparent
            )
            return
        key = self.names.annotation_key(entry.annotation_id)
        if self.redis.exists(key):
            self._settle_duplicate(item, entry)
            return
        # A child of the producer's span: the request's trace shows its fact-check.
        with _tracer.start_as_current_span(
            "factcheck.annotate", context=tracing.extract({"traceparent": entry.traceparent}),
            kind=SpanKind.CONSUMER, attributes={
                "messaging.system": "redis", "messaging.destination.name": self.names.stream,
                "messaging.message.id": item.entry_id, "draftmesh.factcheck.annotation_id": entry.annotation_id,
                "draftmesh.factcheck.kind": entry.kind, "draftmesh.factcheck.delivery": item.deliveries,
                "draftmesh.request_id": entry.request_id,
            },
        ) as span:
            self._annotate_entry(item, entry, key, span)

    def _annotate_entry(self, item: _Item, entry: SpanEntry, key: str, span: tracing.Span) -> None:
        t0 = time.perf_counter()
        try:
            findings = self._call_annotate(entry)
            if not isinstance(findings, (list, tuple)) or not all(isinstance(f, Finding) for f in findings):
                raise TypeError(f"annotate returned {type(findings).__name__}, not a list of Finding")
        except Exception as exc:  # noqa: BLE001 - any annotator failure is the entry's, not ours
            tracing.record_error(span, exc)
            self._failed(item, entry, exc)
            return
        if span.is_recording():
            span.set_attributes({"draftmesh.factcheck.findings": len(findings),
                                 "draftmesh.factcheck.flagged": sum(f.flagged for f in findings),
                                 "draftmesh.factcheck.verdicts": sorted({f.verdict for f in findings})})
        latency_ms = (time.perf_counter() - t0) * 1000
        annotation = Annotation(
            entry.annotation_id, "done", tuple(findings), self.name, latency_ms, traceparent=entry.traceparent
        )
        pipe = self.redis.pipeline(transaction=True)
        pipe.set(key, annotation.to_json(), nx=True, ex=self.config.annotation_ttl_s)
        self._notify(pipe, entry.annotation_id)
        self._ack(pipe, item.entry_id)
        written = pipe.execute()[0]
        self._count("processed" if written else "duplicates")

    def _call_annotate(self, entry: SpanEntry) -> Any:
        """``annotate(entry)`` on its own daemon thread, waited for ``annotate_timeout_s``; past it
        the thread is abandoned (counted, bounded by ``run``) and AnnotateTimeout raised."""
        timeout = self.config.annotate_timeout_s
        box: dict[str, Any] = {}
        done = threading.Event()

        def call() -> None:
            try:
                box["result"] = self.annotate(entry)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                box["error"] = exc
            finally:
                done.set()

        ctx = contextvars.copy_context()  # the current span, for the annotator's own spans
        thread = threading.Thread(target=ctx.run, args=(call,), daemon=True, name=f"annotate-{entry.annotation_id}")
        thread.start()
        if not done.wait(timeout):
            with self._lock:
                self._abandoned.append(thread)
                self._counters["timeouts"] += 1
            raise AnnotateTimeout(f"annotate did not return within {timeout:g}s (factcheck.annotate_timeout_s)")
        if "error" in box:
            raise box["error"]
        return box["result"]

    def hung(self) -> int:
        """Abandoned annotate calls still running."""
        with self._lock:
            self._abandoned = [t for t in self._abandoned if t.is_alive()]
            return len(self._abandoned)

    def _settle_duplicate(self, item: _Item, entry: SpanEntry) -> None:
        pipe = self.redis.pipeline(transaction=True)
        self._notify(pipe, entry.annotation_id)
        self._ack(pipe, item.entry_id)
        pipe.execute()
        self._count("duplicates")

    def _failed(self, item: _Item, entry: SpanEntry, exc: Exception) -> None:
        error = f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
        self._count("failed")
        if item.deliveries >= self.config.max_deliveries:
            self._dead_letter(item, "max_deliveries", error, entry.annotation_id, entry.traceparent)
            return
        log.info("annotate failed on entry %s (delivery %d of %d): %s",
                 item.entry_id, item.deliveries, self.config.max_deliveries, error)  # fmt: skip
        record = json.dumps({"error": error, "worker": self.name, "delivery": item.deliveries})
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(self.names.errors, item.entry_id, record).expire(self.names.errors, self.config.annotation_ttl_s)
        pipe.execute()  # left pending: reclaimed after claim_idle_ms

    # -- loops ------------------------------------------------------------------------------

    def run_once(self, block_ms: int | None = None) -> int:
        """One round in the calling thread: fetch up to ``concurrency`` entries and handle
        them one after the other; returns how many were fetched."""
        items = self.fetch(self.concurrency, block_ms)
        for item in items:
            self.handle(item)
        return len(items)

    def _run_item(self, item: _Item) -> None:
        try:
            self.handle(item)
        except redis.RedisError as exc:  # the entry stays pending; reclaimed later
            self._count("redis_errors")
            log.warning("Redis error settling entry %s: %s: %s", item.entry_id, type(exc).__name__, exc)
        except Exception:  # noqa: BLE001 - keep the worker alive; the entry is retried
            log.exception("unexpected error handling entry %s", item.entry_id)
        finally:
            with self._lock:
                self._inflight.discard(item.entry_id)
                self._lock.notify_all()

    def run(self, stop_event: threading.Event, on_ready: Callable[[], None] | None = None) -> None:
        """Consume until ``stop_event`` is set, then finish (and ack) the in-flight entries.

        Redis failures are logged and retried with a capped back-off, so the worker outlives
        a Redis restart. ``on_ready`` is called once the group exists."""
        backoff = 0.0
        ready_called = False
        with ThreadPoolExecutor(self.concurrency, thread_name_prefix=f"factcheck-{self.name}") as pool:
            while not stop_event.is_set():
                hung = self.hung()  # abandoned calls keep their slots: at most `concurrency` run at once
                if hung >= self.concurrency:
                    self.stuck = True
                    log.error("fact-check worker %s: %d annotate calls hang past annotate_timeout_s=%gs; stopping so "
                              "that a fresh worker takes over", self.name, hung, self.config.annotate_timeout_s)
                    break
                with self._lock:
                    free = max(0, self.concurrency - len(self._inflight) - hung)
                    if not free:  # woken when an entry is settled, or in time for the heartbeat
                        self._lock.wait(min(0.1, self.config.claim_idle_ms / 3000) or 0.1)
                try:
                    if not free:
                        self._heartbeat()  # all slots busy: keep their entries ours
                        continue
                    if stop_event.is_set():
                        break
                    self.ensure_group()
                    if not ready_called:
                        ready_called = True
                        if on_ready is not None:
                            on_ready()
                    items = self.fetch(free, self.config.block_ms)
                except Exception as exc:  # noqa: BLE001 - a worker outlives Redis restarts and surprises
                    if isinstance(exc, redis.RedisError):
                        self._count("redis_errors")
                    if isinstance(exc, redis.ResponseError):  # e.g. NOGROUP: the stream was deleted
                        self._group_ready = False
                    backoff = min(5.0, backoff * 2) if backoff else 0.2
                    log.warning("fact-check worker %s: %s: %s; retrying in %.1fs", self.name, type(exc).__name__,
                                exc, backoff, exc_info=not isinstance(exc, redis.RedisError))  # fmt: skip
                    stop_event.wait(backoff)
                    continue
                backoff = 0.0
                with self._lock:
                    self._inflight.update(item.entry_id for item in items)
                for item in items:
                    pool.submit(self._run_item, item)
        self._leave_group()

    def _leave_group(self) -> None:
        """Delete this consumer if it holds no pending entries (dead consumers pile up otherwise)."""
        try:
            if not self.redis.xpending_range(self.names.stream, self.names.group, "-", "+", 1, consumername=self.name):
                self.redis.xgroup_delconsumer(self.names.stream, self.names.group, self.name)
        except redis.RedisError as exc:
            log.debug("could not remove consumer %s: %s", self.name, exc)


# -- CLI ------------------------------------------------------------------------------------


def load_annotator(spec: str, config: FactCheckConfig) -> Annotate:
    """``module:callable``: a factory ``(config) -> annotate``."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--annotator must be module:callable, got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import annotator module {module_name!r}: {exc}") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"{module_name} has no callable {attr!r}")
    try:
        annotate = factory(config)
    except (ImportError, OSError) as exc:  # a missing NER package or model, a dump file not found
        raise ValueError(f"cannot build the annotator {spec}: {type(exc).__name__}: {exc}") from exc
    if not callable(annotate):
        raise ValueError(f"{spec}(config) returned {type(annotate).__name__}, not a callable")
    return annotate


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="draftmesh factcheck-worker",
        description="Annotate fact-check spans from the Redis stream until SIGTERM/SIGINT.",
    )
    add_config_arguments(parser, FactCheckConfig)
    parser.add_argument("--annotator", default=DEFAULT_ANNOTATOR, help="module:callable, a factory (config) -> annotate")
    parser.add_argument("--name", default=None, help="consumer name (default: host-pid; must be unique per worker)")
    parser.add_argument("--ready-file", default=None,
                        help="a file written once the worker is ready, removed when it stops (container health checks)")
    parser.add_argument("-v", "--verbose", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one worker process; exit 0 after a graceful stop, 2 on a configuration error."""
    args = build_parser().parse_args(argv)
    level = logging.INFO if args.verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args, FactCheckConfig)
        url = config.redis_url
        if not url:
            raise ValueError("no Redis: pass --redis-url, or set DRAFTMESH_FACTCHECK_REDIS_URL or REDIS_URL")
        tracing.setup_tracing("factcheck")
        annotate = load_annotator(args.annotator, config)
    except ValueError as exc:
        print(f"draftmesh factcheck-worker: error: {exc}", file=sys.stderr)
        return 2
    client = redis.Redis.from_url(
        url, socket_timeout=config.block_ms / 1000 + 5.0, socket_connect_timeout=5.0, health_check_interval=30
    )
    worker = Worker(client, config, annotate, args.name)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}

    def ready() -> None:
        print(f"factcheck worker {worker.name} ready: stream {worker.names.stream}, group {worker.names.group}, "
              f"concurrency {config.concurrency}", flush=True)  # fmt: skip
        if args.ready_file:
            Path(args.ready_file).write_text(f"{worker.name}\n")

    try:
        worker.run(stop, on_ready=ready)
    finally:
        if args.ready_file:
            Path(args.ready_file).unlink(missing_ok=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        client.close()
    print(f"factcheck worker {worker.name} stopped: {worker.counters()}", file=sys.stderr, flush=True)
    return EXIT_STUCK if worker.stuck else 0


if __name__ == "__main__":
    sys.exit(main())
