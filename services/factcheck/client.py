"""``FactCheckClient``: how the verifier and the router talk to the fact-check workers.

The verifier calls it from its decode loop, so nothing here may raise into that loop or
block it for long:

- every call is at most one or two short round trips (``submit`` is one pipeline, ``ready``
  one MGET; the lag reading is cached for ``lag_cache_s``);
- a client built from a URL has short socket timeouts and no redis-py retries;
- after a Redis error a circuit breaker answers "unavailable" at once for ``breaker_s``
  (doubling up to ``breaker_max_s`` while the failures go on), instead of paying a timeout
  every decode step; the first call after the pause tries Redis again;
- back-pressure: when the workers' lag (entries not yet read by the group) reaches
  ``max_lag``, spans are skipped and counted rather than piling up in Redis.

Only ``check_text`` and ``fetch`` (the on-demand ``FactCheck`` RPC) raise:
``FactCheckUnavailable`` when Redis cannot be reached (the RPC answers UNAVAILABLE),
``FactCheckBusy`` when the workers are too far behind or ``max_waiters`` calls already wait
(RESOURCE_EXHAUSTED), ``FactCheckNotFound`` for an id no span was ever queued for (NOT_FOUND).
Their waits are capped at ``max_wait_ms``, whatever the caller asks.

Every span is queued with a ``queued:<id>`` marker naming its stream entry (XADD and SET in
one script), so a waiter whose entry MAXLEN trimmed before any worker held it gets a "failed"
(lost) annotation instead of waiting for one that will never come.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Iterable

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from draftmesh import tracing
from draftmesh.config import FactCheckConfig
from draftmesh.factcheck.protocol import (
    Annotation,
    SpanEntry,
    StreamNames,
    as_str,
    failed_ttl,
    lost_annotation,
    producible_annotation_id,
)
from draftmesh.tracing import SpanKind

log = logging.getLogger(__name__)
_tracer = tracing.tracer("draftmesh.factcheck")


class FactCheckUnavailable(RuntimeError):
    """Redis (hence the fact-check service) cannot be reached right now."""


class FactCheckBusy(FactCheckUnavailable):
    """The workers are ``max_lag`` or more entries behind, or ``max_waiters`` calls wait already; try again later."""


class FactCheckNotFound(LookupError):
    """No span was ever queued for this annotation id (or its records expired): nothing to wait for."""


# XADD the span and SET its queued marker to the new entry id, in one round trip and atomically.
_ENQUEUE = """
local id = redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*', unpack(ARGV, 3))
redis.call('SET', KEYS[2], id, 'EX', ARGV[2])
return id
"""


@dataclass
class SubmitReport:
    """What one ``submit`` did with its entries (each entry is counted exactly once)."""

    sent: int = 0
    skipped_backpressure: int = 0
    skipped_known: int = 0
    """Already submitted within ``known_ttl_s`` (or twice in this batch)."""
    unavailable: int = 0
    """Not sent because Redis failed or the breaker is open."""


def group_backlog(client: redis.Redis, names: StreamNames, groups: list, max_count: int) -> tuple[int, int] | None:
    """(lag, pending) of the workers' group from an XINFO GROUPS reply; None: no group yet.

    The lag is Redis 7's ``lag`` field; where it is missing (6.2, or not computable after
    deletions) the entries after the last-delivered id are counted, at most ``max_count``."""
    group = next((g for g in groups if as_str(g.get("name", b"")) == names.group), None)
    if group is None:
        return None
    lag = group.get("lag")
    if lag is None:
        last = as_str(group["last-delivered-id"])
        lag = len(client.xrange(names.stream, f"({last}", "+", count=max_count))
    return int(lag), int(group["pending"])


class FactCheckClient:
    """Producer and reader of the fact-check stream (thread-safe).

    ``redis_or_url``: a URL (the client then owns two connection pools: one with
    ``socket_timeout_s`` for the decode-loop calls, one for the blocking waits), or a
    ``redis.Redis`` (used as given: its own timeouts and retries apply, so pass one with
    short timeouts to keep the no-blocking promise)."""

    def __init__(
        self,
        redis_or_url: str | redis.Redis,
        config: FactCheckConfig | None = None,
        *,
        socket_timeout_s: float = 0.25,
        connect_timeout_s: float = 0.25,
        breaker_s: float = 1.0,
        breaker_max_s: float = 5.0,
        lag_cache_s: float = 0.1,
        known_size: int = 8192,
        known_ttl_s: float = 60.0,
        wait_slice_s: float = 1.0,
    ) -> None:
        self.config = config or FactCheckConfig()
        self.names = StreamNames.from_prefix(self.config.stream_prefix)
        self.breaker_s, self.breaker_max_s = breaker_s, breaker_max_s
        self.lag_cache_s = lag_cache_s
        self.known_size, self.known_ttl_s = known_size, known_ttl_s
        self._owned: list[redis.Redis] = []
        if isinstance(redis_or_url, str):
            common = dict(socket_connect_timeout=connect_timeout_s, retry=Retry(NoBackoff(), 0), health_check_interval=0)
            self.redis = redis.Redis.from_url(redis_or_url, socket_timeout=socket_timeout_s, **common)
            # BLPOP holds its connection for a whole slice: its own pool, a timeout above the slice.
            self._waiter = redis.Redis.from_url(redis_or_url, socket_timeout=wait_slice_s + 1.0, **common)
            self._owned = [self.redis, self._waiter]
            self.wait_slice_s = wait_slice_s
        else:
            self.redis = self._waiter = redis_or_url
            timeout = redis_or_url.connection_pool.connection_kwargs.get("socket_timeout")
            self.wait_slice_s = min(wait_slice_s, timeout / 2) if timeout else wait_slice_s
        self._enqueue = self.redis.register_script(_ENQUEUE)
        self._lock = threading.Lock()
        self._waiting = 0
        self._known: OrderedDict[str, float] = OrderedDict()
        self._lag: int | None = None
        self._lag_at = float("-inf")
        self._down_until = float("-inf")
        self._backoff = 0.0
        self._available = True
        self._counters = dict.fromkeys(
            ("sent", "skipped_backpressure", "skipped_known", "unavailable", "errors", "wait_timeouts", "lost",
             "busy_waiters", "not_found"), 0
        )

    # -- breaker --------------------------------------------------------------------------

    @property
    def available(self) -> bool:
        """False after a Redis failure, until a call succeeds again."""
        return self._available

    def _allowed(self) -> bool:
        return time.monotonic() >= self._down_until

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n

    def _failed(self, exc: Exception, what: str) -> None:
        with self._lock:
            self._counters["errors"] += 1
            self._backoff = min(self.breaker_max_s, self._backoff * 2) if self._backoff else self.breaker_s
            self._down_until = time.monotonic() + self._backoff
            was_available, self._available = self._available, False
        level = logging.WARNING if was_available else logging.DEBUG
        log.log(level, "fact-check Redis unavailable (%s: %s: %s); pausing %.1fs",
                what, type(exc).__name__, exc, self._backoff)  # fmt: skip

    def _succeeded(self) -> None:
        if not self._available or self._backoff:
            with self._lock:
                if not self._available:
                    log.info("fact-check Redis available again")
                self._available, self._backoff = True, 0.0

    # -- lag --------------------------------------------------------------------------------

    def lag(self, *, refresh: bool = False) -> int:
        """Entries the workers have not read yet (cached ``lag_cache_s``); raises RedisError.

        Redis 7 reports the group's ``lag``; older servers (or when Redis cannot compute it,
        after deletions) are answered by counting, at most ``max_lag + 1``, the entries after
        the group's last-delivered id. No group yet (no worker ever ran): the stream length."""
        now = time.monotonic()
        with self._lock:
            if not refresh and self._lag is not None and now - self._lag_at < self.lag_cache_s:
                return self._lag
        pipe = self.redis.pipeline(transaction=False)
        pipe.xinfo_groups(self.names.stream)
        pipe.xlen(self.names.stream)
        groups, length = pipe.execute(raise_on_error=False)
        if isinstance(length, Exception):
            raise length
        lag = int(length)
        if not isinstance(groups, Exception):  # an error here means "no such key": lag = 0
            backlog = group_backlog(self.redis, self.names, groups, self.config.max_lag + 1)
            if backlog is not None:
                lag = backlog[0]
        with self._lock:
            self._lag, self._lag_at = lag, time.monotonic()
        return lag

    # -- producing ----------------------------------------------------------------------------

    def submit(self, entries: Iterable[SpanEntry]) -> SubmitReport:
        """Queue spans for annotation in one pipeline; never raises, never blocks long.

        Skips ids submitted within ``known_ttl_s`` (the same draft proposed again) and, under
        back-pressure, whatever would take the lag past ``max_lag``."""
        report = SubmitReport()
        now = time.monotonic()
        fresh: list[SpanEntry] = []
        with self._lock:
            seen = set()
            for entry in entries:
                sent_at = self._known.get(entry.annotation_id)
                if entry.annotation_id in seen or (sent_at is not None and now - sent_at < self.known_ttl_s):
                    report.skipped_known += 1
                else:
                    seen.add(entry.annotation_id)
                    fresh.append(entry)
            self._counters["skipped_known"] += report.skipped_known
        if not fresh:
            return report
        if not self._allowed():
            report.unavailable = len(fresh)
            self._count("unavailable", len(fresh))
            return report
        try:
            budget = max(0, self.config.max_lag - self.lag())
            send, report.skipped_backpressure = fresh[:budget], len(fresh) - min(budget, len(fresh))
            if send:
                self._xadd(send)
        except redis.RedisError as exc:
            self._failed(exc, "submit")
            report.unavailable, report.skipped_backpressure = len(fresh), 0
            self._count("unavailable", len(fresh))
            return report
        self._succeeded()
        report.sent = len(send)
        with self._lock:
            self._counters["sent"] += report.sent
            self._counters["skipped_backpressure"] += report.skipped_backpressure
            if self._lag is not None:
                self._lag += report.sent  # the cached reading stays an upper bound
            for entry in send:
                self._known[entry.annotation_id] = now
                self._known.move_to_end(entry.annotation_id)
            while len(self._known) > self.known_size:
                self._known.popitem(last=False)
        return report

    def _xadd(self, entries: list[SpanEntry]) -> None:
        """One pipeline of XADDs, in a producer span whose context each entry carries (unless
        it names its own), so the worker's span joins the producing request's trace."""
        with _tracer.start_as_current_span("factcheck.submit", kind=SpanKind.PRODUCER, attributes={
            "messaging.system": "redis", "messaging.destination.name": self.names.stream,
            "messaging.batch.message_count": len(entries),
        }):
            parent = tracing.traceparent()
            pipe = self.redis.pipeline(transaction=False)
            for entry in entries:
                if parent and not entry.traceparent:
                    entry = replace(entry, traceparent=parent)
                self._queue(entry, pipe)
            pipe.execute()

    def _queue(self, entry: SpanEntry, client: redis.Redis | redis.client.Pipeline) -> None:
        """XADD ``entry`` (MAXLEN ~ maxlen) and mark its id queued, naming the entry (one script)."""
        flat = [part for item in entry.to_fields().items() for part in item]
        self._enqueue(keys=[self.names.stream, self.names.queued_key(entry.annotation_id)],
                      args=[self.config.maxlen, self.config.annotation_ttl_s, *flat], client=client)  # fmt: skip

    def forget(self, annotation_ids: Iterable[str]) -> None:
        """Drop ids from the recently-submitted set, so the next submit sends them again."""
        with self._lock:
            for annotation_id in annotation_ids:
                self._known.pop(annotation_id, None)

    # -- reading --------------------------------------------------------------------------

    def _parse(self, annotation_id: str, raw: bytes | str | None) -> Annotation | None:
        if raw is None:
            return None
        try:
            return Annotation.from_json(raw)
        except ValueError as exc:
            self._count("errors")
            log.warning("unreadable annotation %s: %s", annotation_id, exc)
            return None

    def ready(self, annotation_ids: Iterable[str]) -> dict[str, Annotation]:
        """The annotations already written, in one MGET; never waits, never raises.

        Absent ids are not done yet (or were skipped); when Redis fails the answer is {}
        and ``available`` turns False, so the caller marks them unavailable."""
        ids = list(dict.fromkeys(annotation_ids))
        if not ids:
            return {}
        if not self._allowed():
            self._count("unavailable", len(ids))
            return {}
        try:
            values = self.redis.mget([self.names.annotation_key(i) for i in ids])
        except redis.RedisError as exc:
            self._failed(exc, "ready")
            self._count("unavailable", len(ids))
            return {}
        self._succeeded()
        found = {}
        for annotation_id, raw in zip(ids, values, strict=True):
            annotation = self._parse(annotation_id, raw)
            if annotation is not None:
                found[annotation_id] = annotation
        return found

    def wait(self, annotation_id: str, timeout_s: float) -> Annotation | None:
        """The annotation, waiting up to ``timeout_s`` for a worker to write it; None when it
        did not come in time or Redis is unavailable (``available`` tells which)."""
        try:
            return self._wait(annotation_id, timeout_s)
        except FactCheckUnavailable:
            return None

    def _queue_state(self, annotation_id: str) -> str:
        """"unknown" (never queued, or expired), "queued" (its entry is in the stream, or a worker
        holds it) or "lost" (trimmed away before a worker held it). Raises RedisError."""
        raw = self._waiter.get(self.names.queued_key(annotation_id))
        if raw is None:
            return "unknown"
        entry_id = as_str(raw)
        pipe = self._waiter.pipeline(transaction=False)
        pipe.xrange(self.names.stream, entry_id, entry_id, count=1)
        pipe.xpending_range(self.names.stream, self.names.group, entry_id, entry_id, 1)
        present, held = pipe.execute(raise_on_error=False)
        if isinstance(present, Exception):
            raise present
        if present or (held and not isinstance(held, Exception)):  # no group yet: nobody holds it
            return "queued"
        return "lost"

    def _settle_lost(self, annotation_id: str) -> Annotation:
        """Write (SET NX) and return the "failed" annotation of a lost span, waking other waiters;
        an annotation a worker wrote meanwhile wins."""
        key, done = self.names.annotation_key(annotation_id), self.names.done_key(annotation_id)
        lost = lost_annotation(annotation_id)
        ttl = failed_ttl(annotation_id, self.config.failed_ttl_s, self.config.annotation_ttl_s)
        pipe = self._waiter.pipeline(transaction=True)
        pipe.set(key, lost.to_json(), nx=True, ex=ttl).get(key)
        pipe.lpush(done, b"1").ltrim(done, 0, 0).expire(done, self.config.annotation_ttl_s)
        stored = pipe.execute()[1]
        self._count("lost")
        return self._parse(annotation_id, stored) or lost

    def _wait(self, annotation_id: str, timeout_s: float, *, must_exist: bool = False) -> Annotation | None:
        """The annotation, waiting up to ``timeout_s``; a lost span's entry ends the wait with a
        "failed" annotation. ``must_exist``: an id never queued raises ``FactCheckNotFound``."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        key, done = self.names.annotation_key(annotation_id), self.names.done_key(annotation_id)
        if not self._allowed():
            self._count("unavailable")
            raise FactCheckUnavailable("fact-check Redis unavailable (backing off after a failure)")
        try:
            annotation = self._parse(annotation_id, self.redis.get(key))
            if annotation is None and must_exist and self._queue_state(annotation_id) == "unknown":
                self._count("not_found")
                raise FactCheckNotFound(f"no fact-check of {annotation_id!r} was queued, or its records expired")
            while annotation is None:
                remaining = deadline - time.monotonic()
                if remaining < 0.001:  # BLPOP 0 would block forever
                    break
                if self._queue_state(annotation_id) == "lost":
                    annotation = self._parse(annotation_id, self._waiter.get(key)) or self._settle_lost(annotation_id)
                    break
                # The worker pushes one token to ``done`` after writing ``key``; the list outlives
                # the push, so a wake-up is never lost, and each waiter puts the token back for the next.
                if self._waiter.blpop([done], timeout=min(self.wait_slice_s, remaining)) is None:
                    continue
                annotation = self._parse(annotation_id, self._waiter.get(key))
                if annotation is not None:
                    pipe = self._waiter.pipeline(transaction=True)
                    pipe.lpush(done, b"1").ltrim(done, 0, 0).expire(done, self.config.annotation_ttl_s)
                    pipe.execute()
            if annotation is None:
                annotation = self._parse(annotation_id, self.redis.get(key))
        except redis.RedisError as exc:
            self._failed(exc, "wait")
            self._count("unavailable")
            raise FactCheckUnavailable(f"fact-check Redis unavailable: {type(exc).__name__}: {exc}") from exc
        self._succeeded()
        if annotation is None:
            self._count("wait_timeouts")
        return annotation

    def check_text(
        self, text: str, timeout_s: float = 5.0, *, request_id: str = "", traceparent: str = ""
    ) -> Annotation | None:
        """Check ``text`` on demand: the cached annotation if any, else enqueue and wait up
        to ``timeout_s``; None on timeout. Raises ``FactCheckUnavailable`` / ``FactCheckBusy``
        (and ValueError for a text no worker would take: blank or too long)."""
        entry = SpanEntry.for_text("query", text, request_id=request_id, traceparent=traceparent)
        if not self._allowed():
            self._count("unavailable")
            raise FactCheckUnavailable("fact-check Redis unavailable (backing off after a failure)")
        deadline = time.monotonic() + max(0.0, timeout_s)
        try:
            cached = self._parse(entry.annotation_id, self.redis.get(self.names.annotation_key(entry.annotation_id)))
            if cached is not None:
                self._succeeded()
                return cached
            lag = self.lag()
            if lag >= self.config.max_lag:
                self._count("skipped_backpressure")
                raise FactCheckBusy(f"fact-check workers are {lag} entries behind (max_lag {self.config.max_lag})")
            self._queue(entry, self.redis)
        except redis.RedisError as exc:
            self._failed(exc, "check_text")
            self._count("unavailable")
            raise FactCheckUnavailable(f"fact-check Redis unavailable: {type(exc).__name__}: {exc}") from exc
        self._succeeded()
        self._count("sent")
        with self._waiter_slot(deadline - time.monotonic()):
            return self._wait(entry.annotation_id, self._capped(deadline - time.monotonic()))

    def fetch(self, annotation_id: str, timeout_s: float) -> Annotation | None:
        """An earlier output's (or text's) annotation by id, waiting up to ``timeout_s`` (capped
        at ``max_wait_ms``; 0: one read) while its span is queued; None when it did not come in
        time. Raises ``FactCheckNotFound`` for an id no producer can make or none queued,
        ``FactCheckBusy`` when ``max_waiters`` calls wait already, ``FactCheckUnavailable``."""
        if not producible_annotation_id(annotation_id):
            self._count("not_found")
            raise FactCheckNotFound(f"{annotation_id!r} is not an annotation id (<d|o|q>- and 32 hex digits)")
        with self._waiter_slot(timeout_s):
            return self._wait(annotation_id, self._capped(timeout_s), must_exist=True)

    def _capped(self, timeout_s: float) -> float:
        return max(0.0, min(timeout_s, self.config.max_wait_ms / 1000))

    @contextlib.contextmanager
    def _waiter_slot(self, timeout_s: float):
        """One of ``max_waiters`` slots for a call that may wait (``timeout_s`` > 0), else FactCheckBusy."""
        if timeout_s <= 0:
            yield
            return
        with self._lock:
            if self._waiting >= self.config.max_waiters:
                self._counters["busy_waiters"] += 1
                raise FactCheckBusy(f"{self._waiting} fact-check calls are waiting already "
                                    f"(factcheck.max_waiters {self.config.max_waiters})")  # fmt: skip
            self._waiting += 1
        try:
            yield
        finally:
            with self._lock:
                self._waiting -= 1

    # -- bookkeeping ----------------------------------------------------------------------

    def stats(self) -> dict[str, int | bool | None]:
        """Counters since start (entries/ids for submit and ready), the last lag reading and
        ``available``: for logs and, later, Prometheus."""
        with self._lock:
            return {**self._counters, "lag": self._lag, "available": self._available}

    def close(self) -> None:
        """Close the pools this client created (a client passed in is left to its owner)."""
        for client in self._owned:
            client.close()
        self._owned = []

    def __enter__(self) -> FactCheckClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
