"""Aggregates of a run's ``ItemResult`` list (pure functions): per method and kind, and each mesh
method against its in-process counterpart."""

from __future__ import annotations

import statistics
from typing import Any, Iterable, Sequence

from draftmesh.bench.items import ItemResult, ItemRun, SourceStats
from draftmesh.bench.methods import MESH_PAIRS, PLAIN
from draftmesh.bench.stats import geometric_mean, mean, median_ms, rounded

ALL_KINDS = "all"


def speedup_ratios(
    results: Sequence[ItemResult], method: str, kind: str | None = None, reference: str = PLAIN
) -> list[float]:
    """Per-item tokens/s of ``method`` over ``reference``'s (default plain; items with no tokens
    or time are skipped)."""
    plain = {r.item_id: r for r in results if r.method == reference}
    ratios = []
    for r in results:
        if r.method != method or (kind not in (None, ALL_KINDS) and r.kind != kind):
            continue
        ref = plain.get(r.item_id)
        if ref is None:
            continue
        a, b = r.tokens_per_s, ref.tokens_per_s
        if a > 0 and b > 0:
            ratios.append(a / b)
    return ratios


def kinds_in_order(results: Iterable[ItemResult]) -> list[str]:
    kinds: list[str] = []
    for r in results:
        if r.kind not in kinds:
            kinds.append(r.kind)
    return kinds


def methods_in_order(results: Iterable[ItemResult]) -> list[str]:
    methods: list[str] = []
    for r in results:
        if r.method not in methods:
            methods.append(r.method)
    return methods


def summarize_group(results: Sequence[ItemResult], method: str, kind: str) -> dict[str, Any]:
    group = [r for r in results if r.method == method and (kind == ALL_KINDS or r.kind == kind)]
    tokens = sum(r.new_tokens for r in group)
    seconds = sum(r.seconds for r in group)
    reps = [r.representative for r in group]
    with_steps = [run for run in reps if run.steps is not None]
    steps = sum(run.steps for run in with_steps)
    sources: dict[str, SourceStats] = {}
    for run in reps:
        for name, st in run.sources.items():
            sources.setdefault(name, SourceStats()).add(st)
    speed = geometric_mean(speedup_ratios(results, method, kind))
    return {
        "items": len(group),
        "new_tokens": tokens,
        "seconds": rounded(seconds, 6),
        "tokens_per_s": rounded(tokens / seconds if seconds > 0 else 0.0),
        "speedup_vs_plain": rounded(speed),
        "mean_accepted_per_step": rounded(sum(r.new_tokens for r in with_steps) / steps) if steps else None,
        "steps": steps if with_steps else None,
        "draft_ms_per_step": rounded(1e3 * sum(run.draft_s or 0.0 for run in with_steps) / steps) if steps else None,
        "verify_ms_per_step": rounded(1e3 * sum(run.verify_s or 0.0 for run in with_steps) / steps) if steps else None,
        "identical": sum(1 for r in group if r.identical_to_plain is True),
        "mismatches": sum(1 for r in group if r.identical_to_plain is False),
        "identical_share": rounded(mean([float(r.same_as_plain) for r in group if r.same_as_plain is not None])),
        "mean_norm_edit_distance": rounded(mean([r.edit_distance for r in group if r.edit_distance is not None])),
        "lenient_tokens": sum(r.representative.lenient_tokens or 0 for r in group) if group else 0,
        "first_token_ms": rounded(median_ms([first_token_s(r) for r in group])),
        "lossless": all(r.lossless for r in group),
        "other_engine": any(r.other_engine for r in group),
        "acceptance_by_source": {
            name: {
                "proposals": st.proposals,
                "proposed_tokens": st.proposed_tokens,
                "accepted_tokens": st.accepted_tokens,
                "acceptance": rounded(st.acceptance),
            }
            for name, st in sources.items()
        },
    }


def first_token_s(r: ItemResult) -> float | None:
    """Median over the repeats of the time to the first token (None where no run has one)."""
    vals = [run.first_token_s for run in r.runs if run.first_token_s is not None]
    return statistics.median(vals) if vals else None


def _compute_s_per_step(run: ItemRun) -> float | None:
    if not run.steps or run.draft_s is None or run.verify_s is None:
        return None
    return (run.draft_s + run.verify_s) / run.steps


def mesh_summary(
    results: Sequence[ItemResult], pairs: Sequence[tuple[str, str]] = MESH_PAIRS
) -> dict[str, dict[str, Any]]:
    """Each mesh method against its in-process counterpart, over the items both ran.

    - ``tokens_per_s_ratio``: geometric mean over items of (mesh tokens/s / in-process
      tokens/s), each from the median time, as ``speedup_vs_plain``;
    - ``first_token_ms``: median over items of each side's median time to the first token;
    - ``overhead_ms_per_step``: median over items of (mesh seconds - in-process seconds) /
      mesh steps: what serving adds per target forward (gRPC, the proxy, the router,
      streaming each step; Redis for the answer store);
    - ``compute_ms_per_step``: median over items of (draft + verify time) / steps of each
      side's representative run, as measured where the decoder runs; the difference to
      ``overhead_ms_per_step`` is outside the decode loop.
    Pairs whose mesh method did not run are left out.
    """
    by_key = {(r.item_id, r.method): r for r in results}
    out: dict[str, dict[str, Any]] = {}
    for mesh, local in pairs:
        if not any(r.method == mesh for r in results):
            continue
        items = [r.item_id for r in results if r.method == mesh and (r.item_id, local) in by_key]
        m_res = [by_key[(i, mesh)] for i in items]
        l_res = [by_key[(i, local)] for i in items]
        ratios = speedup_ratios(results, mesh, reference=local)
        overhead = []
        for m, lo in zip(m_res, l_res):
            steps = m.representative.steps
            if steps:
                overhead.append(1e3 * (m.seconds - lo.seconds) / steps)
        out[mesh] = {
            "reference": local,
            "items": len(items),
            "tokens_per_s": {"mesh": rounded(_group_tps(m_res)), "local": rounded(_group_tps(l_res))},
            "tokens_per_s_ratio": rounded(geometric_mean(ratios)),
            "first_token_ms": {
                "mesh": rounded(median_ms(first_token_s(r) for r in m_res)),
                "local": rounded(median_ms(first_token_s(r) for r in l_res)),
            },
            "overhead_ms_per_step": rounded(statistics.median(overhead) if overhead else None),
            "compute_ms_per_step": {
                "mesh": rounded(median_ms(_compute_s_per_step(r.representative) for r in m_res)),
                "local": rounded(median_ms(_compute_s_per_step(r.representative) for r in l_res)),
            },
            "mean_accepted_per_step": {
                "mesh": rounded(_tokens_per_step(m_res)), "local": rounded(_tokens_per_step(l_res)),
            },
            "identical": sum(1 for r in m_res if r.identical_to_plain is True),
            "mismatches": sum(1 for r in m_res if r.identical_to_plain is False),
        }
    return out


def _group_tps(group: Sequence[ItemResult]) -> float | None:
    seconds = sum(r.seconds for r in group)
    return sum(r.new_tokens for r in group) / seconds if group and seconds > 0 else None


def _tokens_per_step(group: Sequence[ItemResult]) -> float | None:
    reps = [r.representative for r in group if r.representative.steps]
    steps = sum(run.steps for run in reps)
    return sum(run.new_tokens for run in reps) / steps if steps else None


def summarize(results: Sequence[ItemResult]) -> dict[str, dict[str, dict[str, Any]]]:
    """{method: {"all" | kind: {tokens_per_s, speedup_vs_plain, mean_accepted_per_step, ...}}}."""
    kinds = [ALL_KINDS, *kinds_in_order(results)]
    return {m: {k: summarize_group(results, m, k) for k in kinds} for m in methods_in_order(results)}
