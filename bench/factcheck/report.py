"""What `draftmesh factcheck-bench` prints: its header and tables (on the shared ``bench.report``)."""

from __future__ import annotations

from typing import Any

from draftmesh.bench.factcheck.spans import WINDOW_WORDS
from draftmesh.bench.report import fmt, table


def format_report(report: dict[str, Any]) -> str:
    m = report["machine"]
    worker_env = report.get("worker_env") or {}
    lines = [
        f"command: {report['command']}",
        f"date {report['date']}  cpu {m['cpu']} ({m['usable_cpus']} usable of {m['logical_cpus']} logical; "
        f"load {m.get('load_avg_1m', '?')} at start)  python {m['python']}  redis-server {m.get('redis_server', '?')}",
        f"worker env {worker_env.get('executable', '?')}: python {worker_env.get('python', '?')}, spacy "
        f"{worker_env.get('spacy')}, flair {worker_env.get('flair')}, torch {worker_env.get('torch')}",
    ]
    ann = report.get("annotation")
    if ann:
        spans = ann["spans"]
        parts = [f"{k} {v['count']} (mean {v['chars_mean']:.0f} chars)" for k, v in spans["latency"].items()]
        lines.append(f"spans from {spans['source']}: latency set {', '.join(parts)}; throughput set "
                     f"{spans['throughput_count']} drafts (2 windows of {WINDOW_WORDS[0]}-{WINDOW_WORDS[1]} words : 1 "
                     f"sentence), submitted at once")  # fmt: skip
        lines += ["", "Annotation latency, one span at a time to an idle worker (ms; e2e = XADD to annotation read, "
                      "annotate = worker's Annotation.latency_ms)"]  # fmt: skip
        rows = []
        for backend, res in ann["backends"].items():
            if res.get("status") == "skipped":
                continue
            for i, (category, lat) in enumerate(res.get("latency", {}).items()):
                rows.append([backend if i == 0 else "", category, str(lat["n"]), fmt(lat["chars_mean"], ".0f"),
                             fmt(lat["e2e_ms"]["p50"], ".2f"), fmt(lat["e2e_ms"]["p95"], ".2f"),
                             fmt(lat["worker_ms"]["p50"], ".2f"), fmt(lat["worker_ms"]["p95"], ".2f"),
                             str(lat["flagged"])])  # fmt: skip
        lines += table(["backend", "spans", "n", "chars", "e2e p50", "e2e p95", "annotate p50", "annotate p95",
                         "flagged"], rows, [False, False, True, True, True, True, True, True, True])  # fmt: skip
        lines += ["", "Throughput, 1 worker (concurrency "
                  f"{ann['concurrency']}), all spans submitted at once"]
        rows = []
        for backend, res in ann["backends"].items():
            tp = res.get("throughput")
            if not tp:
                continue
            rows.append([backend, str(tp["annotated"]), fmt(tp["seconds"], ".2f"), fmt(tp["spans_per_s"], ".1f"),
                         fmt(tp["annotate_only_spans_per_s"], ".1f"), fmt(tp["worker_ms"]["p50"], ".2f"),
                         fmt(tp["worker_cpu_ms_per_span"], ".2f"), fmt(res.get("startup_s"), ".1f"),
                         fmt(res.get("worker_rss_mib"), ".0f")])  # fmt: skip
        lines += table(["backend", "spans", "seconds", "spans/s", "annotate-only spans/s", "annotate p50 ms",
                         "worker CPU ms/span", "start-up s", "RSS MiB"], rows, [False] + [True] * 8)  # fmt: skip
        for backend, res in ann["backends"].items():
            if res.get("status") == "skipped":
                lines.append(f"{backend}: skipped: {res['reason']}")
            elif res.get("status") != "ok":
                lines.append(f"{backend}: {res.get('status')}: {res.get('error')}")
            if res.get("flair_trained"):
                t = res["flair_trained"]
                lines.append(f"{backend}: the small tagger flair_train makes (one-hot words + character LSTM), trained "
                             f"for this run ({t['epochs']} epochs, held-out micro-F1 {t['micro_f1']}); a hub tagger "
                             "with contextual embeddings is much slower")  # fmt: skip
            elif backend == "flair" and res.get("model"):
                lines.append(f"{backend}: tagger {res['model']}")
    gen = report.get("generation")
    if gen:
        meta = gen["meta"]
        lines += ["", f"Generation with and without the fact-check link ({meta['model']}, {meta['threads']} threads, "
                      f"{len(meta['items'])} items: {', '.join(i['id'] for i in meta['items'])}; max_new_tokens "
                      f"{meta['items'][0]['max_new_tokens'] if meta['items'] else '-'}; {meta['repeats']} repeats; "
                      f"worker: {gen['worker_backend']} on the same CPUs)"]  # fmt: skip
        rows = []
        for policy, s in gen["policies"].items():
            per_rep = s["ratio_per_repeat"]
            spread = f"{min(per_rep):.3f}-{max(per_rep):.3f}" if per_rep else "-"
            rows.append([policy, str(s["items"]), fmt(s["tokens_per_s_off"]), fmt(s["tokens_per_s_on"]),
                         fmt(s["ratio_on_off"], ".3f"), spread, f"{s['link_calls']}/{s['steps_on']}",
                         f"{fmt(s['link_ms_per_step']['p50'], '.2f')}/{fmt(s['link_ms_per_step']['p95'], '.2f')}",
                         fmt(None if s["link_share_of_generation"] is None
                            else 100 * s["link_share_of_generation"], ".2f"),
                         fmt(None if s["worker_cpu_share_of_generation"] is None
                            else 100 * s["worker_cpu_share_of_generation"], ".2f"),
                         str(s["flagged_steps"]), f"{s['lenient_tokens_off']}/{s['lenient_tokens_on']}",
                         f"{s['identical_outputs']}/{s['items']}"])  # fmt: skip
        lines += table(["policy", "items", "tok/s off", "tok/s on", "ratio on/off", "per-repeat", "link calls/steps",
                         "link ms p50/p95", "link % time", "worker CPU % time", "flagged steps", "lenient off/on",
                         "same output"], rows, [False] + [True] * 12)  # fmt: skip
        lines.append("ratio on/off = geometric mean over items of per-item median tokens/s (on / off); per-repeat = "
                     "pooled ratio of each pass (noise gauge); link calls: steps with a draft tree (lossy only); "
                     "% time: of the 'on' generations' wall time")  # fmt: skip
        rows = []
        for policy, s in gen["policies"].items():
            o = s["annotate_output_ms"]
            status = ", ".join(f"{k} {v}" for k, v in sorted(s["annotate_output_status"].items()))
            rows.append([policy, str(o["n"]), fmt(o["p50"], ".1f"), fmt(o["p95"], ".1f"), fmt(o["max"], ".1f"),
                         str(s["drafts_submitted"]), status])  # fmt: skip
        lines += ["", f"annotate_output after the result (send the output, wait up to {meta['output_wait_s']} s "
                      "for its annotation; outside the tok/s above)"]  # fmt: skip
        lines += table(["policy", "requests", "p50 ms", "p95 ms", "max ms", "drafts sent", "status"], rows,
                        [False, True, True, True, True, True, False])  # fmt: skip
    for msg in report.get("notes", []):
        lines.append(f"note: {msg}")
    return "\n".join(lines)
