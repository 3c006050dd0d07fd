"""Prometheus metrics through Ray's metrics export.

Each Serve replica records into ``ray.util.metrics`` instruments; every Ray node's metrics
agent serves them, with Ray's and Serve's own, in Prometheus text format on the node's
metrics export port (``serve.metrics_port`` for the local cluster ``draftmesh serve``
starts, 8080 on KubeRay pods), so replicas on many nodes need no port each. Ray prefixes the
names with ``ray_`` and adds ``_total``/``_bucket``/... suffixes.

Instruments are made through a small backend so the recording logic is testable without
Ray (``MemoryMetrics``).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any, Mapping, Protocol, Sequence

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKENS_PER_STEP_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32)
TREE_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)  # Ray wants positive boundaries; 0 falls in the first
BATCH_ROWS_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)

Tags = Mapping[str, str] | None


class Counter(Protocol):
    def inc(self, value: float = 1.0, tags: Tags = None) -> None: ...


class Histogram(Protocol):
    def observe(self, value: float, tags: Tags = None) -> None: ...


class Gauge(Protocol):
    def set(self, value: float, tags: Tags = None) -> None: ...


class MetricsBackend(Protocol):
    def counter(self, name: str, description: str, tag_keys: Sequence[str] = ()) -> Counter: ...

    def histogram(self, name: str, description: str, boundaries: Sequence[float], tag_keys: Sequence[str] = ()) -> Histogram: ...

    def gauge(self, name: str, description: str, tag_keys: Sequence[str] = ()) -> Gauge: ...


class RayMetrics:
    """Instruments exported by the Ray node's metrics agent (inside a Ray worker)."""

    def counter(self, name: str, description: str, tag_keys: Sequence[str] = ()) -> Counter:
        from ray.util.metrics import Counter as RayCounter

        return RayCounter(name, description=description, tag_keys=tuple(tag_keys))

    def histogram(self, name: str, description: str, boundaries: Sequence[float], tag_keys: Sequence[str] = ()) -> Histogram:
        from ray.util.metrics import Histogram as RayHistogram

        return RayHistogram(name, description=description, boundaries=list(boundaries), tag_keys=tuple(tag_keys))

    def gauge(self, name: str, description: str, tag_keys: Sequence[str] = ()) -> Gauge:
        from ray.util.metrics import Gauge as RayGauge

        return RayGauge(name, description=description, tag_keys=tuple(tag_keys))


class _Memory:
    def __init__(self, owner: "MemoryMetrics", name: str, tag_keys: Sequence[str]) -> None:
        self.owner, self.name, self.tag_keys = owner, name, tuple(tag_keys)

    def _key(self, tags: Tags) -> tuple[str, tuple[tuple[str, str], ...]]:
        tags = dict(tags or {})
        if set(tags) != set(self.tag_keys):
            raise ValueError(f"{self.name}: tags {sorted(tags)} but declared {sorted(self.tag_keys)}")
        if not all(isinstance(v, str) for v in tags.values()):
            raise ValueError(f"{self.name}: tag values must be strings, got {tags}")
        return self.name, tuple(sorted(tags.items()))

    def inc(self, value: float = 1.0, tags: Tags = None) -> None:
        if value <= 0:
            raise ValueError(f"{self.name}: a counter step must be > 0, got {value}")
        with self.owner.lock:
            self.owner.values[self._key(tags)] += value

    def observe(self, value: float, tags: Tags = None) -> None:
        with self.owner.lock:
            self.owner.observations[self._key(tags)].append(value)

    def set(self, value: float, tags: Tags = None) -> None:
        with self.owner.lock:
            self.owner.values[self._key(tags)] = value


class MemoryMetrics:
    """Keeps what was recorded, for tests of the recording logic; refuses what Ray refuses
    (undeclared or missing tag keys, a counter step <= 0, boundaries <= 0)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.values: dict[Any, float] = defaultdict(float)
        self.observations: dict[Any, list[float]] = defaultdict(list)

    def counter(self, name: str, description: str, tag_keys: Sequence[str] = ()) -> Counter:
        return _Memory(self, name, tag_keys)

    def histogram(self, name: str, description: str, boundaries: Sequence[float], tag_keys: Sequence[str] = ()) -> Histogram:
        if not boundaries or any(b <= 0 for b in boundaries) or list(boundaries) != sorted(boundaries):
            raise ValueError(f"{name}: boundaries must be positive and ascending, got {list(boundaries)}")
        return _Memory(self, name, tag_keys)

    def gauge(self, name: str, description: str, tag_keys: Sequence[str] = ()) -> Gauge:
        return _Memory(self, name, tag_keys)

    def value(self, name: str, **tags: str) -> float:
        return self.values.get((name, tuple(sorted(tags.items()))), 0.0)

    def observed(self, name: str, **tags: str) -> list[float]:
        return list(self.observations.get((name, tuple(sorted(tags.items()))), []))
