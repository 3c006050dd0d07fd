"""The numbers every bench reports, defined once: percentiles, a distribution's summary, the
geometric mean of ratios, medians in milliseconds, rounding for JSON."""

from __future__ import annotations

import math
import statistics
from typing import Any, Iterable, Sequence


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile with linear interpolation (numpy's default); None for no values."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(values: Sequence[float], digits: int = 3) -> dict[str, Any]:
    """n, p50, p95, mean, min, max (None when there are no values)."""
    values = list(values)
    if not values:
        return {"n": 0, "p50": None, "p95": None, "mean": None, "min": None, "max": None}

    def r(x: float) -> float:
        return round(float(x), digits)

    return {"n": len(values), "p50": r(percentile(values, 50)), "p95": r(percentile(values, 95)),
            "mean": r(statistics.fmean(values)), "min": r(min(values)), "max": r(max(values))}  # fmt: skip


def geometric_mean(values: Iterable[float]) -> float | None:
    """Geometric mean of positive values (ratios); None when there are none.

    A ratio <= 0 or not finite is a bug upstream (a method with no tokens or no time must be
    left out by the caller), so it raises instead of being skipped silently."""
    vals = [float(v) for v in values]
    if not vals:
        return None
    if any(v <= 0 or not math.isfinite(v) for v in vals):
        raise ValueError(f"geometric mean needs positive finite values, got {vals}")
    return math.exp(sum(math.log(v) for v in vals) / len(vals))


def mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def median_ms(seconds: Iterable[float | None]) -> float | None:
    """Median in milliseconds of the values that are not None; None when all are."""
    vals = [1e3 * v for v in seconds if v is not None]
    return statistics.median(vals) if vals else None


def rounded(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(float(x), digits)
