"""Annotation latency (one span at a time to an idle worker) and throughput (all at once) of one
NER backend, on one fresh worker."""

from __future__ import annotations

import statistics
import time
from typing import Any, Sequence

from draftmesh.bench.factcheck.spans import CATEGORIES, Span
from draftmesh.bench.factcheck.workers import (
    PROG,
    RunningWorker,
    _new_prefix,
    _stream_config,
)
from draftmesh.bench.report import progress
from draftmesh.bench.stats import distribution
from draftmesh.config import FactCheckConfig
from draftmesh.factcheck.client import FactCheckClient


def _annotation_client(redis_url: str, config: FactCheckConfig):
    # Generous timeouts: a latency sample, not the breaker, on a busy machine.
    return FactCheckClient(redis_url, config, socket_timeout_s=10.0, connect_timeout_s=10.0, known_ttl_s=0.0)


def bench_backend(backend: str, model: str | None, *, redis_url: str, python: str, latency_spans: Sequence[Span],
                  throughput_spans: Sequence[Span], warmup_spans: Sequence[Span], concurrency: int,
                  timeout_s: float, ready_timeout_s: float) -> dict[str, Any]:
    """Latency (one span at a time) then throughput (all at once) on one fresh worker."""
    capacity = len(latency_spans) + len(throughput_spans) + len(warmup_spans)
    config = _stream_config(redis_url, _new_prefix(backend), backend, model, concurrency, capacity)
    result: dict[str, Any] = {"status": "ok", "model": model, "worker_python": python,
                              "stream_prefix": config.stream_prefix, "concurrency": concurrency}  # fmt: skip
    progress(PROG, f"[{backend}] starting a worker ({python})")
    worker = RunningWorker(config, python, ready_timeout_s)
    client = _annotation_client(redis_url, config)
    try:
        result["startup_s"] = round(worker.startup_s, 3)
        for span in warmup_spans:
            entry = span.entry()
            client.submit([entry])
            if client.wait(entry.annotation_id, timeout_s) is None:
                raise RuntimeError(f"warm-up span not annotated within {timeout_s:.0f} s")

        progress(PROG, f"[{backend}] latency: {len(latency_spans)} spans, one at a time")
        samples: list[dict[str, Any]] = []
        timeouts = 0
        for span in latency_spans:
            time.sleep(0.02)  # let the worker get back to its blocking read: it is idle
            entry = span.entry()
            t0 = time.perf_counter()
            client.submit([entry])
            annotation = client.wait(entry.annotation_id, timeout_s)
            e2e_ms = (time.perf_counter() - t0) * 1000
            if annotation is None:
                timeouts += 1
                if not worker.alive():
                    raise RuntimeError("the worker died during the latency run")
                continue
            samples.append({"category": span.category, "chars": len(span.text), "e2e_ms": e2e_ms,
                            "worker_ms": annotation.latency_ms, "status": annotation.status,
                            "flagged": annotation.flagged, "findings": len(annotation.findings)})  # fmt: skip
        latency: dict[str, Any] = {}
        for category in ("all", *CATEGORIES):
            rows = [s for s in samples if category == "all" or s["category"] == category]
            if not rows:
                continue
            latency[category] = {
                "n": len(rows),
                "chars_mean": round(statistics.fmean(s["chars"] for s in rows), 1),
                "e2e_ms": distribution([s["e2e_ms"] for s in rows]),
                "worker_ms": distribution([s["worker_ms"] for s in rows]),
                "overhead_ms": distribution([s["e2e_ms"] - s["worker_ms"] for s in rows]),
                "flagged": sum(s["flagged"] for s in rows),
                "failed": sum(s["status"] != "done" for s in rows),
            }
        result["latency"] = latency
        result["latency_timeouts"] = timeouts

        progress(PROG, f"[{backend}] throughput: {len(throughput_spans)} spans submitted at once to 1 worker")
        entries = [s.entry() for s in throughput_spans]
        cpu0 = worker.cpu_s()
        t0 = time.perf_counter()
        report = client.submit(entries)
        deadline = time.monotonic() + timeout_s + 2.0 * len(entries)
        annotations = []
        for entry in entries:
            annotation = client.wait(entry.annotation_id, max(0.0, deadline - time.monotonic()))
            if annotation is not None:
                annotations.append(annotation)
        seconds = time.perf_counter() - t0
        cpu1 = worker.cpu_s()
        done = len(annotations)
        cpu_ms = 1000 * (cpu1 - cpu0) / done if done and cpu0 is not None and cpu1 is not None else None
        worker_ms = [a.latency_ms for a in annotations]
        result["throughput"] = {
            "spans": len(entries),
            "sent": report.sent,
            "annotated": done,
            "failed": sum(a.status != "done" for a in annotations),
            "seconds": round(seconds, 4),
            "spans_per_s": round(done / seconds, 3) if seconds > 0 and done else None,
            "annotate_only_spans_per_s": round(done / (sum(worker_ms) / 1000), 3) if sum(worker_ms) > 0 else None,
            "worker_ms": distribution(worker_ms),
            "worker_cpu_ms_per_span": None if cpu_ms is None else round(cpu_ms, 3),
        }  # fmt: skip
        result["worker_rss_mib"] = worker.rss_mib()
        if done < len(entries):
            result["status"] = "incomplete"
            result["error"] = f"{len(entries) - done} of {len(entries)} throughput spans not annotated in time"
        if timeouts:
            result["status"] = "incomplete"
            result["error"] = f"{timeouts} latency spans not annotated within {timeout_s:.0f} s"
        result["client"] = client.stats()
    finally:
        client.close()
        worker.stop()
    return result
