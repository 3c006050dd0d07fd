"""Deterministic annotators for the stream tests (stand-ins for the real checker), and helpers.

Each public factory has the worker CLI's shape, ``(config) -> annotate``, so a subprocess
worker can load it with ``--annotator fc_annotators:<name>`` (the tests put this folder on
PYTHONPATH). The recording ones append who annotated which id to a Redis list, so tests can
tell how often each span was annotated, and by which worker, across processes.

Environment (for subprocess workers): FC_SLOW_S, seconds ``slow`` sleeps per span (0.3);
FC_TAG, the name recorded per call (default: the process id).
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from typing import Callable, Iterator

import redis

from draftmesh.factcheck.protocol import SpanEntry
from draftmesh.io_struct import Finding

_IMPOSSIBLE = re.compile(r"\bFebruary (30|31)\b")


def impossible_dates(entry: SpanEntry) -> list[Finding]:
    """Flag "February 30/31" (a date rule's verdict); nothing else."""
    return [
        Finding("date", m.start(), m.end(), m.group(0), "contradicted", label="DATE", rule="impossible_date",
                evidence="February has at most 29 days")
        for m in _IMPOSSIBLE.finditer(entry.text)
    ]  # fmt: skip


def calls_key(prefix: str, annotation_id: str) -> str:
    return f"{prefix}:test:calls:{annotation_id}"


def calls(client: redis.Redis, prefix: str, annotation_id: str) -> list[str]:
    """Who annotated ``annotation_id``, in call order."""
    return [v.decode() for v in client.lrange(calls_key(prefix, annotation_id), 0, -1)]


def total_calls(client: redis.Redis, prefix: str) -> int:
    return int(client.get(f"{prefix}:test:total") or 0)


def recording(url: str, prefix: str, *, sleep_s: float = 0.0, tag: str | None = None,
              poison: bool = False) -> Callable[[SpanEntry], list[Finding]]:  # fmt: skip
    """An annotator that records each call in Redis (before sleeping ``sleep_s``), raises on
    texts containing "poison" when ``poison``, and flags impossible dates."""
    client = redis.Redis.from_url(url)
    who = tag or os.environ.get("FC_TAG") or str(os.getpid())

    def annotate(entry: SpanEntry) -> list[Finding]:
        pipe = client.pipeline(transaction=False)
        pipe.rpush(calls_key(prefix, entry.annotation_id), who).incr(f"{prefix}:test:total")
        pipe.execute()
        if sleep_s:
            time.sleep(sleep_s)
        if poison and "poison" in entry.text:
            raise RuntimeError(f"poisoned span {entry.text[:20]!r}")
        return impossible_dates(entry)

    return annotate


# -- factories for ``--annotator fc_annotators:<name>`` --------------------------------------


def feb30(config) -> Callable[[SpanEntry], list[Finding]]:
    return impossible_dates


def slow(config) -> Callable[[SpanEntry], list[Finding]]:
    """Recording, sleeping FC_SLOW_S per span: a batch is still in flight when a test kills
    or stops the worker."""
    return recording(config.redis_url, config.stream_prefix, sleep_s=float(os.environ.get("FC_SLOW_S", "0.3")))


def counting(config) -> Callable[[SpanEntry], list[Finding]]:
    return recording(config.redis_url, config.stream_prefix)


def poison(config) -> Callable[[SpanEntry], list[Finding]]:
    return recording(config.redis_url, config.stream_prefix, poison=True)


# -- a worker in a background thread ---------------------------------------------------------


@contextlib.contextmanager
def worker_thread(worker) -> Iterator[threading.Thread]:
    """Run ``worker.run`` in a thread for the ``with`` block; stop it (gracefully) after."""
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop,), daemon=True, name=f"worker-{worker.name}")
    thread.start()
    try:
        yield thread
    finally:
        stop.set()
        thread.join(10)
        assert not thread.is_alive(), "the worker did not stop within 10 s"


def wait_for(predicate: Callable[[], object], timeout_s: float = 10.0, what: str = "condition") -> object:
    """Poll ``predicate`` until it is truthy; fail the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.02)
