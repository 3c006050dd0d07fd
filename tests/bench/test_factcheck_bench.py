"""`draftmesh factcheck-bench`: the latency/throughput part run for real (a spaCy worker
process in this interpreter, a real redis-server) on a tiny size; the report's structure and
its internal consistency are checked, never its speed."""

from __future__ import annotations

import json
import sys

import pytest

from draftmesh.bench.factcheck.cli import EXIT_OK, EXIT_USAGE, build_parser, main
from draftmesh.bench.factcheck.generation import select_items
from draftmesh.bench.factcheck.spans import WINDOW_WORDS, SpanMaker, read_sentences
from draftmesh.bench.report import command_line
from draftmesh.bench.stats import distribution, geometric_mean, percentile
from draftmesh.redis_server import find_redis_server


def test_percentiles_and_summary():
    assert percentile([], 50) is None
    assert percentile([3.0], 95) == 3.0
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile(list(range(101)), 95) == pytest.approx(95.0)
    s = distribution([4.0, 1.0, 2.0, 3.0])
    assert s["n"] == 4 and s["min"] == 1.0 and s["max"] == 4.0 and s["p50"] <= s["p95"] <= s["max"]
    assert distribution([])["p50"] is None
    assert geometric_mean([2.0, 8.0]) == pytest.approx(4.0)


def test_spans_are_distinct_draft_like_and_reproducible():
    sentences = read_sentences()
    maker = SpanMaker(sentences, seed=1)
    drafts = maker.drafts(30)
    outputs = [maker.output(500) for _ in range(2)]
    texts = [s.text for s in drafts + outputs]
    assert len(set(texts)) == len(texts)
    assert [s.category for s in drafts].count("sentence") == 10
    for span in drafts:
        if span.category == "window":
            assert WINDOW_WORDS[0] <= len(span.text.split()) <= WINDOW_WORDS[1]
            assert span.text.startswith(" ") and span.entry().kind == "draft"
    assert all(len(s.text) >= 500 and s.entry().kind == "output" for s in outputs)
    assert [s.text for s in SpanMaker(sentences, seed=1).drafts(30)] == texts[:30]


def test_select_items_takes_one_per_kind_first():
    class Item:
        def __init__(self, id, kind):
            self.id, self.kind = id, kind

    items = [Item("g1", "grounded"), Item("g2", "grounded"), Item("r1", "rag"), Item("o1", "open")]
    assert [i.id for i in select_items(items, 3)] == ["g1", "r1", "o1"]
    assert [i.id for i in select_items(items, 10)] == ["g1", "r1", "o1", "g2"]


def test_arguments():
    parser = build_parser()
    args = parser.parse_args([])
    assert args.backends == ["spacy", "flair"] and args.policy == "typical"
    assert args.threads is None and parser.parse_args(["--threads", "2", "--model", "m"]).threads == 2  # config flags
    assert args.repeats >= 1 and args.items >= 1 and args.output_wait_s > 0
    args = parser.parse_args(["--backends", "flair,spacy,flair", "--spans", "7", "--max-new-tokens", "16"])
    assert args.backends == ["flair", "spacy"] and args.spans == 7 and args.max_new_tokens == 16
    for bad in (["--backends", "bert"], ["--spans", "0"], ["--repeats", "-1"], ["--output-wait-s", "0"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)
    assert main(["--no-annotation", "--no-generation"]) == EXIT_USAGE
    assert main(["--no-annotation", "--policy", "nonsense"]) == EXIT_USAGE


def test_command_line_names_the_bench():
    assert command_line("draftmesh factcheck-bench", ["--spans", "5"]) == "draftmesh factcheck-bench --spans 5"


@pytest.mark.timeout(120)
def test_spacy_latency_and_throughput_report(tmp_path, capsys):
    if find_redis_server() is None:
        pytest.skip("no redis-server binary")
    out = tmp_path / "fc.json"
    argv = ["--backends", "spacy", "--spans", "5", "--outputs", "1", "--output-chars", "400", "--throughput-spans", "6",
            "--warmup", "1", "--no-generation", "--worker-python", sys.executable, "--json", str(out)]
    assert main(argv) == EXIT_OK
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())

    # The header carries the command; the table and the JSON agree on what ran.
    assert printed.startswith("command: draftmesh factcheck-bench --backends spacy")
    assert report["command"] == "draftmesh factcheck-bench " + " ".join(argv)
    assert "Annotation latency" in printed and "Throughput" in printed and "Generation" not in printed
    assert "factcheck worker" not in printed  # the worker's ready line went to stderr
    for key in ("cpu", "logical_cpus", "python", "versions"):
        assert key in report["machine"]
    assert report["worker_env"]["executable"] == sys.executable and report["worker_env"]["spacy"]
    assert report["date"] and "generation" not in report

    ann = report["annotation"]
    assert ann["spans"]["latency"]["window"]["count"] + ann["spans"]["latency"]["sentence"]["count"] == 5
    assert ann["spans"]["latency"]["output"]["count"] == 1
    res = ann["backends"]["spacy"]
    assert list(ann["backends"]) == ["spacy"] and res["status"] == "ok" and res["latency_timeouts"] == 0
    lat = res["latency"]
    assert lat["all"]["n"] == 6 and lat["output"]["n"] == 1
    assert sum(lat[c]["n"] for c in ("window", "sentence", "output")) == lat["all"]["n"]
    for row in lat.values():
        assert row["failed"] == 0
        for name in ("e2e_ms", "worker_ms"):
            s = row[name]
            assert 0 < s["min"] <= s["p50"] <= s["p95"] <= s["max"]
        # the end-to-end time contains the worker's annotate time
        assert row["e2e_ms"]["min"] >= row["worker_ms"]["min"]
        assert row["overhead_ms"]["min"] >= 0
    tp = res["throughput"]
    assert tp["spans"] == tp["sent"] == tp["annotated"] == 6 and tp["failed"] == 0
    assert tp["seconds"] > 0 and tp["spans_per_s"] > 0 and tp["annotate_only_spans_per_s"] > 0
    assert tp["spans_per_s"] == pytest.approx(6 / tp["seconds"], rel=0.02)
    # the worker annotated for part of the time only: end to end cannot beat annotate-only
    assert tp["spans_per_s"] <= tp["annotate_only_spans_per_s"] * 1.001
    assert 0 < tp["worker_ms"]["p50"] <= tp["worker_ms"]["p95"]
    assert res["startup_s"] > 0
