"""What `draftmesh bench` prints and writes: its tables, its JSON and its plot (on ``report``'s
shared table and formatting)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftmesh.bench.items import ItemResult
from draftmesh.bench.methods import DRAFTMESH_TRACED, MESH_METHODS, PLAIN
from draftmesh.bench.report import fmt, table
from draftmesh.bench.stats import rounded
from draftmesh.bench.summary import (
    ALL_KINDS,
    first_token_s,
    kinds_in_order,
    mesh_summary,
    methods_in_order,
    summarize,
)


@dataclass
class BenchReport:
    model: str
    threads: int
    repeats: int
    results: list[ItemResult]
    skipped: dict[str, str] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    mesh: dict[str, Any] | None = None
    """With mesh methods: how the mesh ran (address, started_by_bench, started_s, memory,
    mesh_state_reset, ...); ``report_to_json`` adds the pairs of ``mesh_summary``."""


def _per_step_ms(seconds: float | None, steps: int | None) -> float | None:
    return rounded(1e3 * seconds / steps) if steps and seconds is not None else None


def item_record(r: ItemResult) -> dict[str, Any]:
    rep = r.representative
    return {
        "id": r.item_id,
        "kind": r.kind,
        "method": r.method,
        "new_tokens": r.new_tokens,
        "seconds": round(r.seconds, 6),
        "tokens_per_s": round(r.tokens_per_s, 4),
        "mean_accepted_per_step": rounded(r.mean_accepted_per_step),
        "identical_to_plain": r.identical_to_plain,
        "first_difference": r.first_difference,
        "mismatch_top2_gap": rounded(r.mismatch_top2_gap, 6),
        "lossless": r.lossless,
        "other_engine": r.other_engine,
        "same_as_plain": r.same_as_plain,
        "norm_edit_distance": rounded(r.edit_distance),
        "lenient_tokens": rep.lenient_tokens,
        "first_token_ms": rounded(None if first_token_s(r) is None else 1e3 * first_token_s(r)),
        "stable_across_repeats": r.stable,
        "seconds_by_repeat": [round(run.seconds, 6) for run in r.runs],
        "prompt_tokens": rep.prompt_tokens,
        **({"cached_prompt_tokens": rep.cached_prompt_tokens} if rep.cached_prompt_tokens is not None else {}),
        "steps": rep.steps,
        "draft_ms_per_step": _per_step_ms(rep.draft_s, rep.steps),
        "verify_ms_per_step": _per_step_ms(rep.verify_s, rep.steps),
        "sources": {
            n: {"proposals": s.proposals, "proposed_tokens": s.proposed_tokens, "accepted_tokens": s.accepted_tokens}
            for n, s in rep.sources.items()
        },
        "text": rep.text,
    }


def report_to_json(report: BenchReport) -> dict[str, Any]:
    out: dict[str, Any] = {
        "model": report.model,
        "threads": report.threads,
        "repeats": report.repeats,
    }
    out.update(report.meta)
    out["methods"] = methods_in_order(report.results)
    out["skipped"] = dict(report.skipped)
    out["summary"] = summarize(report.results)
    out["items"] = [item_record(r) for r in report.results]
    out["mismatches"] = [
        {
            "id": r.item_id,
            "method": r.method,
            "first_difference": r.first_difference,
            "repeat": r.mismatch_repeat,
            "mismatch_top2_gap": rounded(r.mismatch_top2_gap, 6),
        }
        for r in report.results
        if r.identical_to_plain is False and not r.other_engine
    ]
    others = [r for r in report.results if r.other_engine]
    if others:
        out["other_engines"] = {
            "agreement": [
                {"id": r.item_id, "method": r.method, "identical_to_plain": r.identical_to_plain,
                 "first_difference": r.first_difference, "repeat": r.mismatch_repeat,
                 "plain_top2_gap": rounded(r.mismatch_top2_gap, 6)}
                for r in others
            ],
        }
    if any(m in MESH_METHODS for m in out["methods"]):
        out["mesh"] = {**(report.mesh or {}), "pairs": mesh_summary(report.results)}
    return out


def format_report(report: BenchReport) -> str:
    """The terminal tables: speed per kind and method, then acceptance per source."""
    summary = summarize(report.results)
    methods = list(summary)
    kinds = [ALL_KINDS, *kinds_in_order(report.results)]
    lines = [
        f"model {report.model}  threads {report.threads}  repeats {report.repeats}  "
        f"(median time per item; speedup = geometric mean of per-item tokens/s ratios vs plain)",
        "",
    ]
    header = ["kind", "method", "items", "tok/s", "speedup", "tok/step", "draft ms/step", "verify ms/step", "identical"]
    rows = []
    for kind in kinds:
        for m in methods:
            s = summary[m][kind]
            if m == PLAIN:
                ident = "ref"
            elif s["identical"] + s["mismatches"] == 0:
                ident = "-"
            else:
                ident = f"{s['identical']}/{s['identical'] + s['mismatches']}"
                if s["other_engine"]:
                    ident += " agree"
                elif s["mismatches"]:
                    ident += " !!"
            rows.append([
                kind if m == methods[0] else "",
                m,
                str(s["items"]),
                fmt(s["tokens_per_s"], ".1f"),
                fmt(s["speedup_vs_plain"], ".2f") + ("x" if s["speedup_vs_plain"] is not None else ""),
                fmt(s["mean_accepted_per_step"], ".2f"),
                fmt(s["draft_ms_per_step"], ".2f"),
                fmt(s["verify_ms_per_step"], ".2f"),
                ident,
            ])
    lines += table(header, rows, [False, False, True, True, True, True, True, True, True])
    for name, why in report.skipped.items():
        lines.append(f"{name}: skipped ({why})")

    src_rows = []
    for m in methods:
        names = list(summary[m][ALL_KINDS]["acceptance_by_source"])
        for n in names:
            cells = [m, n]
            for kind in kinds:
                st = summary[m][kind]["acceptance_by_source"].get(n)
                if st and not st["proposed_tokens"] and not st["proposals"] and st["accepted_tokens"]:
                    cells.append(f"{st['accepted_tokens']}/?")  # the mesh reports no proposals
                elif not st or not st["proposed_tokens"]:
                    cells.append("-")
                else:
                    cells.append(f"{st['accepted_tokens']}/{st['proposed_tokens']} {100 * st['acceptance']:.0f}%")
            src_rows.append(cells)
    if src_rows:
        lines += ["", "acceptance per source: accepted / proposed drafted tokens"]
        lines += table(["method", "source", *kinds], src_rows, [False, False, *[True] * len(kinds)])

    lossy = [m for m in methods if not summary[m][ALL_KINDS]["lossless"]]
    if lossy:
        lines += ["", "lossy policies: speed gained vs fidelity lost (against plain greedy)"]
        fid_rows = []
        for m in lossy:
            s = summary[m][ALL_KINDS]
            fid_rows.append([
                m,
                fmt(s["speedup_vs_plain"], ".2f") + "x",
                fmt(s["mean_accepted_per_step"], ".2f"),
                fmt(None if s["identical_share"] is None else 100 * s["identical_share"], ".0f") + "%",
                fmt(s["mean_norm_edit_distance"], ".3f"),
                str(s["lenient_tokens"]),
            ])
        lines += table(
            ["method", "speedup", "tok/step", "identical outputs", "mean norm. edit distance", "lenient tokens"],
            fid_rows,
            [False, True, True, True, True, True],
        )

    if any(m in MESH_METHODS for m in methods):
        lines += ["", *format_mesh(report)]
    if DRAFTMESH_TRACED in methods:
        spans, noop = report.meta.get("traced_spans_exported"), report.meta.get("untraced_step_span_cost_us")
        lines += ["", f"{DRAFTMESH_TRACED}: draftmesh with tracing on, {spans} spans exported over OTLP/gRPC to an "
                      "in-process receiver; draftmesh: tracing off (no collector configured), where the spans of "
                      f"one step (3 sources) cost {noop} us with the no-op tracer"]

    others = [r for r in report.results if r.other_engine]
    if others:
        lines += ["", *format_other_engines(report, others)]
    bad = [r for r in report.results if r.identical_to_plain is False and not r.other_engine]
    if bad:
        lines += ["", f"!!! {len(bad)} OUTPUT MISMATCH(ES) WITH PLAIN (lossless methods must match token for token):"]
        for r in bad:
            gap = f", plain top-2 logit gap {r.mismatch_top2_gap:.3g}" if r.mismatch_top2_gap is not None else ""
            lines.append(
                f"!!!   item {r.item_id!r} method {r.method!r}: first difference at token {r.first_difference}{gap}"
            )
    unstable = [r for r in report.results if not r.stable]
    if unstable:
        which = ", ".join(f"{r.item_id}/{r.method}" for r in unstable)
        lines += ["", f"note: output changed between repeats for: {which}"]
    return "\n".join(lines)


def format_other_engines(report: BenchReport, others: list[ItemResult]) -> list[str]:
    """Other engines (vLLM) against our plain greedy: agreement per method, where each differing
    item first differs and our top-2 logit gap there; then every engine's cold start and memory."""
    lines = []
    for m in dict.fromkeys(r.method for r in others):
        rows = [r for r in others if r.method == m]
        agree = sum(1 for r in rows if r.identical_to_plain)
        lines.append(f"{m} vs plain greedy: {agree}/{len(rows)} items token for token identical "
                     "(another implementation: near-ties may break either way)")
        for r in rows:
            if r.identical_to_plain is False:
                gap = f"{r.mismatch_top2_gap:.3g}" if r.mismatch_top2_gap is not None else "?"
                lines.append(f"  {r.item_id}: first difference at token {r.first_difference}, plain top-2 logit gap {gap}")
    startup = report.meta.get("startup") or {}
    if startup:
        lines += ["", "cold start and memory (a fresh process: spawn to engine ready, plus a first "
                      f"{startup.get('first_request_tokens', '?')}-token request; memory then, the process and its children)"]
        rows = []
        for name, s in (startup.get("engines") or {}).items():
            rows.append([name, s.get("engine", ""), fmt(s.get("ready_s"), ".1f"), fmt(s.get("first_result_s"), ".1f"),
                         fmt(None if s.get("rss_mb") is None else s["rss_mb"] / 1024, ".2f"),
                         fmt(None if s.get("pss_mb") is None else s["pss_mb"] / 1024, ".2f"), str(s.get("processes", "-"))])
        lines += table(["method", "engine", "ready s", "first request s", "RSS GiB", "PSS GiB", "processes"], rows,
                       [False, False, True, True, True, True, True])
    return lines


def format_mesh(report: BenchReport) -> list[str]:
    """The "mesh vs in-process" table (one row per mesh method and its in-process counterpart)."""
    info = report.mesh or {}
    pairs = mesh_summary(report.results)
    head = "mesh vs in-process"
    facts = []
    if info.get("started_by_bench"):
        if info.get("started_s") is not None:
            facts.append(f"mesh started in {info['started_s']:.1f}s")
        mem = info.get("memory") or {}
        if mem.get("rss_mb") is not None:
            pss = f", PSS {mem['pss_mb'] / 1024:.2f} GiB" if mem.get("pss_mb") is not None else ""
            facts.append(f"mesh memory RSS {mem['rss_mb'] / 1024:.2f} GiB{pss} in {mem['processes']} processes")
    elif info.get("address"):
        facts.append(f"mesh at {info['address']}")
    if info.get("mesh_state_reset") is False:
        facts.append("mesh state NOT reset between passes")
    lines = [head + (f" ({'; '.join(facts)})" if facts else "")]
    header = ["mesh method", "vs", "items", "tok/s ratio", "first token ms mesh/local",
              "overhead ms/step", "compute ms/step mesh/local", "tok/step mesh/local"]
    rows = []
    for mesh, p in pairs.items():
        ratio = p["tokens_per_s_ratio"]
        rows.append([
            mesh,
            p["reference"],
            str(p["items"]),
            fmt(ratio, ".2f") + ("x" if ratio is not None else ""),
            f"{fmt(p['first_token_ms']['mesh'], '.1f')} / {fmt(p['first_token_ms']['local'], '.1f')}",
            fmt(p["overhead_ms_per_step"], ".2f"),
            f"{fmt(p['compute_ms_per_step']['mesh'], '.2f')} / {fmt(p['compute_ms_per_step']['local'], '.2f')}",
            f"{fmt(p['mean_accepted_per_step']['mesh'], '.2f')} / {fmt(p['mean_accepted_per_step']['local'], '.2f')}",
        ])
    lines += table(header, rows, [False, False, True, True, True, True, True, True])
    return lines


def write_plot(report: BenchReport, path: str | Path) -> None:
    """A PNG: speedup vs plain per kind and method; acceptance rate per source and method."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    summary = summarize(report.results)
    methods = [m for m in summary if m != PLAIN]
    kinds = [ALL_KINDS, *kinds_in_order(report.results)]
    fig = Figure(figsize=(max(8.0, 1.4 * len(kinds) + 4), 8.5))
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.subplots(2, 1)
    width = 0.8 / max(1, len(methods))
    for j, m in enumerate(methods):
        vals = [summary[m][k]["speedup_vs_plain"] or 0.0 for k in kinds]
        xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(kinds))]
        ax1.bar(xs, vals, width, label=m)
    ax1.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax1.set_xticks(range(len(kinds)), kinds)
    ax1.set_ylabel("speedup vs plain (geo. mean)")
    top = max([summary[m][k]["speedup_vs_plain"] or 0.0 for m in methods for k in kinds] + [1.0])
    ax1.set_ylim(0, top * 1.3)  # room for the legend above the bars
    threads = f"{report.threads} thread{'s' if report.threads != 1 else ''}"
    ax1.set_title(f"speedup vs plain: {report.model}, {threads}, median of {report.repeats}")
    if methods:
        ax1.legend(fontsize="small", ncols=min(4, len(methods)), loc="upper left")

    pairs = [
        (m, n, st["acceptance"])
        for m in summary
        for n, st in summary[m][ALL_KINDS]["acceptance_by_source"].items()
        if st["acceptance"] is not None
    ]
    if pairs:
        sources = list(dict.fromkeys(n for _, n, _ in pairs))
        engine = list(dict.fromkeys(m for m, _, _ in pairs))
        width = min(0.35, 0.8 / len(engine))
        for j, m in enumerate(engine):
            got = {n: a for mm, n, a in pairs if mm == m}
            xs = [i + (j - (len(engine) - 1) / 2) * width for i in range(len(sources))]
            ax2.bar(xs, [100 * got.get(n, 0.0) for n in sources], width, label=m)
        ax2.set_xticks(range(len(sources)), sources)
        ax2.set_xlim(-0.6, len(sources) - 0.4)
        ax2.set_ylabel("accepted / proposed tokens (%)")
        ax2.set_ylim(0, min(100.0, max(100 * a for _, _, a in pairs) * 1.3 + 1))
        ax2.set_title("acceptance per source (all items)")
        ax2.legend(fontsize="small", loc="upper left")
    else:
        ax2.set_axis_off()
        ax2.text(0.5, 0.5, "no draft source proposed anything", ha="center", va="center")
    fig.tight_layout()
    fig.savefig(str(path), format="png", dpi=100)
