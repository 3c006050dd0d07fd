"""`draftmesh bench --target mesh --api openai`: the same workload through the mesh's two faces, gRPC
(``MeshRunner``, streaming ``Generate``) and HTTP (``OpenAIRunner``, the real ``openai`` client,
streaming), in one run on one mesh, and what the HTTP face costs against gRPC.

Why passes, and why they alternate: every request leaves its answer in the mesh's answer store and its
statistics in the builder, so a face that ran an item after the other would be drafted the answer whole.
Each (face, method) pass therefore starts from a reset mesh and runs the whole workload; the faces take
turns pass by pass, in ABBA order over the repeats (gRPC, HTTP, HTTP, gRPC, ...), so that a drift of
the machine's load hits both alike.

Reported per mesh method: each face's aggregate completion tokens/s (its tokens over the sum of its
per-item median times), the HTTP/gRPC ratio (target: within 5%), time to first token, and how many
items gave the same text on both faces in every pass (greedy decoding: they must).
"""

from __future__ import annotations

import math
import statistics
import sys
from typing import Any, Callable, Sequence

from draftmesh.bench.items import ItemRun, PreparedItem
from draftmesh.bench.report import fmt, table

FACES = ("grpc", "http")
TARGET_RATIO_TOLERANCE = 0.05
"""The issue's target: the HTTP face within 5% of the gRPC face's tokens/s."""


def pass_order(repeats: int) -> list[str]:
    """The faces' passes over the repeats, ABBA: gRPC, HTTP, then HTTP, gRPC, ..."""
    order: list[str] = []
    for r in range(repeats):
        order += list(FACES) if r % 2 == 0 else list(reversed(FACES))
    return order


def tokens(run: ItemRun) -> int:
    return run.completion_tokens if run.completion_tokens is not None else run.new_tokens


def run_faces(runners: dict[str, dict[str, Any]], items: Sequence[PreparedItem], repeats: int, *,
              reset: Callable[[], None] | None = None, warmup_tokens: int = 8,
              say: Callable[[str], None] | None = None) -> dict[tuple[str, str, str], list[ItemRun]]:
    """``runners[method][face]``: a runner (``.run(item) -> ItemRun``) per mesh method and face.
    Returns the runs per (method, face, item id), in pass order. ``reset`` before every pass."""
    say = say or (lambda msg: print(msg, file=sys.stderr))
    if items:  # warm-up: the first request of each face and method pays for connections and compilation
        first = items[0]
        short = PreparedItem(first.item, first.prompt_ids, min(warmup_tokens, first.max_new_tokens))
        for by_face in runners.values():
            for face in FACES:
                by_face[face].run(short)
    runs: dict[tuple[str, str, str], list[ItemRun]] = {}
    for n, face in enumerate(pass_order(repeats), 1):
        for method, by_face in runners.items():
            if reset is not None:
                reset()
            say(f"draftmesh bench: pass {n}/{2 * repeats}: {method} through the {face} face")
            for item in items:
                runs.setdefault((method, face, item.id), []).append(by_face[face].run(item))
    return runs


def summarize_faces(runs: dict[tuple[str, str, str], list[ItemRun]], items: Sequence[PreparedItem]) -> dict[str, Any]:
    """Per method: each face's tokens/s and first-token time, the HTTP/gRPC ratio, identical items."""
    methods = list(dict.fromkeys(m for m, _, _ in runs))
    out: dict[str, Any] = {}
    for method in methods:
        faces: dict[str, Any] = {}
        for face in FACES:
            per_item = [runs[(method, face, it.id)] for it in items]
            n_tokens = sum(tokens(r[0]) for r in per_item)
            seconds = sum(statistics.median(x.seconds for x in r) for r in per_item)
            firsts = [statistics.median(x.first_token_s for x in r if x.first_token_s is not None)
                      for r in per_item if any(x.first_token_s is not None for x in r)]
            faces[face] = {
                "tokens": n_tokens,
                "seconds": round(seconds, 4),
                "tokens_per_s": round(n_tokens / seconds, 3) if seconds > 0 else None,
                "first_token_ms": round(1e3 * statistics.median(firsts), 2) if firsts else None,
            }
        identical, mismatched, item_ratios = 0, [], []
        for it in items:
            g, h = runs[(method, "grpc", it.id)], runs[(method, "http", it.id)]
            texts = {x.text for x in g + h}
            counts = {tokens(x) for x in g + h}
            if len(texts) == 1 and len(counts) == 1:
                identical += 1
            else:
                mismatched.append({"item": it.id, "grpc": g[0].text, "http": h[0].text,
                                   "grpc_tokens": tokens(g[0]), "http_tokens": tokens(h[0])})
            g_s, h_s = statistics.median(x.seconds for x in g), statistics.median(x.seconds for x in h)
            if g_s > 0 and h_s > 0 and tokens(g[0]) and tokens(h[0]):
                item_ratios.append((tokens(h[0]) / h_s) / (tokens(g[0]) / g_s))
        g_tps, h_tps = faces["grpc"]["tokens_per_s"], faces["http"]["tokens_per_s"]
        ratio = h_tps / g_tps if g_tps and h_tps else None
        out[method] = {
            "faces": faces,
            "http_over_grpc": round(ratio, 4) if ratio is not None else None,
            "http_over_grpc_item_geomean": (round(math.exp(statistics.fmean(math.log(r) for r in item_ratios)), 4)
                                            if item_ratios else None),
            "within_target": ratio is not None and abs(ratio - 1) <= TARGET_RATIO_TOLERANCE,
            "items": len(items),
            "identical": identical,
            "mismatches": mismatched,
        }
    return out


def faces_report(runs: dict[tuple[str, str, str], list[ItemRun]], items: Sequence[PreparedItem], repeats: int,
                 mesh: dict[str, Any] | None) -> dict[str, Any]:
    """The JSON of a faces run (``meta`` is added by the caller)."""
    return {
        "mode": "faces",
        "target": "mesh",
        "api": "openai",
        "repeats": repeats,
        "passes": pass_order(repeats),
        "target_ratio": f"HTTP tokens/s within {TARGET_RATIO_TOLERANCE:.0%} of gRPC",
        "summary": summarize_faces(runs, items),
        "mesh": mesh,
        "items": [
            {"item": item_id, "method": method, "face": face,
             "runs": [{"seconds": round(r.seconds, 4), "tokens": tokens(r), "steps": r.steps,
                       "first_token_ms": round(1e3 * r.first_token_s, 2) if r.first_token_s is not None else None,
                       "cached_prompt_tokens": r.cached_prompt_tokens} for r in rs]}
            for (method, face, item_id), rs in runs.items()
        ],
    }


def format_faces(report: dict[str, Any]) -> str:
    rows = []
    for method, s in report["summary"].items():
        g, h = s["faces"]["grpc"], s["faces"]["http"]
        rows.append([method, fmt(g["tokens_per_s"]), fmt(h["tokens_per_s"]), fmt(s["http_over_grpc"], ".3f"),
                     fmt(g["first_token_ms"], ".0f"), fmt(h["first_token_ms"], ".0f"),
                     f"{s['identical']}/{s['items']}", "yes" if s["within_target"] else "no"])
    head = ["method", "gRPC tok/s", "HTTP tok/s", "HTTP/gRPC", "gRPC TTFT ms", "HTTP TTFT ms", "identical", "within 5%"]
    lines = [f"mesh faces: gRPC (Generate) vs HTTP (openai client), passes {' '.join(report['passes'])}", ""]
    lines += table(head, rows, [False] + [True] * 7)
    for method, s in report["summary"].items():
        for bad in s["mismatches"]:
            lines.append(f"MISMATCH {method} item {bad['item']}: gRPC {bad['grpc_tokens']} tokens {bad['grpc']!r}, "
                         f"HTTP {bad['http_tokens']} tokens {bad['http']!r}")
    return "\n".join(lines)


def plot_faces(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(report["summary"])
    fig, ax = plt.subplots(figsize=(max(4, 2.5 * len(methods)), 4))
    width = 0.38
    top = max([report["summary"][m]["faces"][f]["tokens_per_s"] or 0 for m in methods for f in FACES] or [1])
    for i, face in enumerate(FACES):
        values = [report["summary"][m]["faces"][face]["tokens_per_s"] or 0 for m in methods]
        bars = ax.bar([x + (i - 0.5) * width for x in range(len(methods))], values, width,
                      label="gRPC (Generate)" if face == "grpc" else "HTTP (openai client)")
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
    for x, m in enumerate(methods):
        ratio = report["summary"][m]["http_over_grpc"]
        if ratio is not None:
            ax.annotate(f"HTTP/gRPC {ratio:.3f}", (x, 0), xytext=(0, -28), textcoords="offset points",
                        ha="center", fontsize=8)
    ax.set_xticks(range(len(methods)), methods)
    ax.set_ylabel("completion tokens/s")
    ax.set_title("the mesh's two faces, same workload")
    ax.set_ylim(0, 1.35 * top)  # room for the legend above the bars
    ax.legend(loc="upper center", ncol=2, fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
