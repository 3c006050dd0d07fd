"""`draftmesh bench`: method parsing, the maths, the identical-output check, JSON/plot, and an
end-to-end run on a tiny random-weight model (no real model, nothing downloaded)."""

from __future__ import annotations

import contextlib
import json
import math
from collections import Counter

import pytest
from bench_args import parse, workload_file

from draftmesh.bench.cli import check_target
from draftmesh.bench.engine_report import BenchReport, format_report, report_to_json, write_plot
from draftmesh.bench.fidelity import (
    check_identical,
    edit_distance,
    first_difference,
    measure_fidelity,
    mismatch_message,
    top2_gap,
)
from draftmesh.bench.items import ItemResult, ItemRun, PreparedItem, SourceStats
from draftmesh.bench.loop import execute, item_order
from draftmesh.bench.mesh import MeshError, MeshRunner, make_mesh_runners
from draftmesh.bench.methods import DEFAULT_MESH_METHODS, DEFAULT_METHODS, default_methods, parse_methods
from draftmesh.bench.run import run
from draftmesh.bench.runners import EngineRunner, make_runner
from draftmesh.bench.stats import geometric_mean
from draftmesh.bench.summary import mesh_summary, speedup_ratios, summarize
from draftmesh.bench.workload import WorkItem
from draftmesh.draft import registry
from draftmesh.v1 import generation_pb2_grpc as pb_grpc


@pytest.fixture(scope="module")
def tiny_llama():
    from tiny_models import tiny_target

    return tiny_target("llama")


def fake_run(item_id, method, tokens, seconds, kind="k", steps=None):
    return ItemRun(item_id, kind, method, list(tokens), seconds, steps=steps)


def result(item_id, method, runs, kind="k", lossless=True):
    return ItemResult(item_id, kind, method, lossless=lossless, runs=runs)


# ---------------------------------------------------------------------- methods
def test_parse_methods_puts_plain_first_and_drops_duplicates():
    names = [m.name for m in parse_methods("hf,draftmesh,hf,hf-pld")]
    assert names == ["plain", "hf", "draftmesh", "hf-pld"]
    plain = parse_methods("plain")[0]
    assert plain.family == "engine" and plain.sources == ()
    assert parse_methods("draftmesh")[1].sources is None  # the registry's default set


def test_parse_methods_ablations_come_from_the_registry():
    source = registry.available()[0]
    method = parse_methods(f"draftmesh:{source}")[1]
    assert method.name == f"draftmesh:{source}" and method.sources == (source,)
    expanded = [m.name for m in parse_methods("draftmesh:*")[1:]]
    assert expanded == [f"draftmesh:{s}" for s in registry.DEFAULT_SOURCES]


def test_parse_methods_rejects_unknown_names_clearly():
    with pytest.raises(ValueError, match="unknown draft source 'nope' in method 'draftmesh:nope'") as info:
        parse_methods("plain,draftmesh:nope")
    assert all(s in str(info.value) for s in registry.available())
    with pytest.raises(ValueError, match="unknown method 'speedy'"):
        parse_methods("speedy")
    with pytest.raises(ValueError, match="unknown draft source 'b'"):
        parse_methods("draftmesh:b", available=["a"], defaults=["a"])


# ---------------------------------------------------------------------- maths
def test_geometric_mean():
    assert geometric_mean([2.0, 8.0]) == pytest.approx(4.0)
    assert geometric_mean([1.5]) == pytest.approx(1.5)
    assert geometric_mean([0.5, 2.0, 1.0]) == pytest.approx(1.0)
    assert geometric_mean([]) is None
    with pytest.raises(ValueError):
        geometric_mean([1.0, 0.0])


def test_speedup_is_the_geometric_mean_of_per_item_tokens_per_s_ratios():
    # item a: plain 10 tokens in 1 s (10 tok/s), fast 10 tokens in 0.25 s (40 tok/s): ratio 4
    # item b: plain 100 tokens in 1 s (100 tok/s), fast 100 tokens in 1 s: ratio 1
    results = [
        result("a", "plain", [fake_run("a", "plain", range(10), 1.0)], kind="x"),
        result("a", "fast", [fake_run("a", "fast", range(10), 0.25)], kind="x"),
        result("b", "plain", [fake_run("b", "plain", range(100), 1.0)], kind="y"),
        result("b", "fast", [fake_run("b", "fast", range(100), 1.0)], kind="y"),
    ]
    assert sorted(speedup_ratios(results, "fast")) == pytest.approx([1.0, 4.0])
    summary = summarize(results)
    assert summary["fast"]["all"]["speedup_vs_plain"] == pytest.approx(2.0)  # not (4 + 1) / 2, not 110/1.25 / 55
    assert summary["fast"]["x"]["speedup_vs_plain"] == pytest.approx(4.0)
    assert summary["fast"]["y"]["speedup_vs_plain"] == pytest.approx(1.0)
    assert summary["plain"]["all"]["speedup_vs_plain"] == pytest.approx(1.0)
    # tokens/s of a group is its total tokens over its total (median) time
    assert summary["fast"]["all"]["tokens_per_s"] == pytest.approx(110 / 1.25)


def test_median_time_over_repeats_and_representative_run():
    runs = [fake_run("a", "m", range(6), s, steps=k) for s, k in ((3.0, 1), (1.0, 2), (2.0, 3))]
    r = result("a", "m", runs)
    assert r.seconds == 2.0
    assert r.tokens_per_s == pytest.approx(3.0)
    assert r.representative.steps == 3  # the run whose time is the median
    assert r.mean_accepted_per_step == pytest.approx(2.0)
    even = result("a", "m", runs[:2])
    assert even.seconds == 2.0 and even.representative.seconds == 1.0


def test_summary_acceptance_and_step_times():
    run = ItemRun(
        "a", "k", "draftmesh", list(range(12)), 1.0, steps=4, draft_s=0.004, verify_s=0.2,
        sources={"s1": SourceStats(proposals=5, proposed_tokens=20, accepted_tokens=8)},
    )
    results = [
        result("a", "plain", [fake_run("a", "plain", range(12), 2.0, steps=12)]),
        result("a", "draftmesh", [run]),
    ]
    s = summarize(results)["draftmesh"]["all"]
    assert s["mean_accepted_per_step"] == pytest.approx(3.0)
    assert s["draft_ms_per_step"] == pytest.approx(1.0)
    assert s["verify_ms_per_step"] == pytest.approx(50.0)
    assert s["acceptance_by_source"]["s1"] == {
        "proposals": 5, "proposed_tokens": 20, "accepted_tokens": 8, "acceptance": 0.4
    }


# ---------------------------------------------------------------------- identical-output check
def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 9, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
    assert first_difference([], [5]) == 0


def test_a_different_output_is_flagged_never_passed():
    plain = result("a", "plain", [fake_run("a", "plain", [5, 6, 7, 8], 1.0)] * 2)
    same = result("a", "draftmesh", [fake_run("a", "draftmesh", [5, 6, 7, 8], 0.5)] * 2)
    differs = result("a", "hf", [fake_run("a", "hf", [5, 6, 9, 8], 0.5)] * 2)
    # right in the first repeat, wrong in the second: still a mismatch
    late = result("a", "hf-pld", [fake_run("a", "hf-pld", [5, 6, 7, 8], 0.5), fake_run("a", "hf-pld", [5, 6, 7], 0.5)])
    lossy = result("a", "lossy", [fake_run("a", "lossy", [1], 0.1)], lossless=False)
    bad = check_identical([plain, same, differs, late, lossy])
    assert {r.method for r in bad} == {"hf", "hf-pld"}
    assert plain.identical_to_plain is None and lossy.identical_to_plain is None
    assert same.identical_to_plain is True
    assert differs.identical_to_plain is False and differs.first_difference == 2 and differs.mismatch_repeat == 0
    assert late.identical_to_plain is False and late.first_difference == 3 and late.mismatch_repeat == 1
    assert late.stable is False and same.stable is True
    msg = mismatch_message(differs, plain.runs[0].token_ids)
    assert "MISMATCH" in msg and "'a'" in msg and "'hf'" in msg and "token 2" in msg
    assert "plain has 7" in msg and "hf has 9" in msg


class CorruptingRunner:
    """Wraps a runner and changes one output token (a deliberately broken lossless method)."""

    lossless = True

    def __init__(self, inner, name="draftmesh", at=3):
        self.inner, self.name, self.at = inner, name, at

    def reset(self):
        self.inner.reset()

    def run(self, item):
        out = self.inner.run(item)
        out.method = self.name
        if len(out.token_ids) > self.at:
            out.token_ids[self.at] = (out.token_ids[self.at] + 1) % 60 + 2
        return out


def prepared(target, n=3, max_new_tokens=8):
    items = []
    for i in range(n):
        ids = tuple(2 + (i * 7 + j * 3) % 50 for j in range(12))
        items.append(PreparedItem(WorkItem(f"i{i}", "k", max_new_tokens), ids, max_new_tokens))
    return items


def test_execute_warns_loudly_about_a_mismatch(tiny_llama):
    plain = EngineRunner("plain", tiny_llama, [])
    broken = CorruptingRunner(EngineRunner("x", tiny_llama, []))
    warnings = []
    results = execute(
        [plain, broken], prepared(tiny_llama), repeats=2, progress=False, warn=warnings.append,
        tokenizer=tiny_llama.tokenizer,
    )
    bad = [r for r in results if r.method == "draftmesh"]
    assert all(r.identical_to_plain is False and r.first_difference == 3 for r in bad)
    assert len(warnings) == 3  # once per (item, method), not once per repeat
    assert all("OUTPUT MISMATCH" in w and "'draftmesh'" in w and "token 3" in w for w in warnings)
    assert {w.split("item ")[1].split()[0] for w in warnings} == {"'i0'", "'i1'", "'i2'"}


def test_execute_interleaves_item_by_item_and_resets_each_repeat():
    log = []

    class Recorder:
        lossless = True

        def __init__(self, name):
            self.name = name

        def reset(self):
            log.append(("reset", self.name))

        def run(self, item):
            log.append((item.id, self.name))
            return ItemRun(item.id, item.kind, self.name, [1, 2], 0.01)

    runners = [Recorder("plain"), Recorder("a"), Recorder("b")]
    items = [PreparedItem(WorkItem(f"i{i}", "k", 4), (1, 2), 4) for i in range(2)]
    results = execute(runners, items, repeats=2, progress=False)
    runs = [e for e in log if e[0] != "reset"]
    warm, timed = runs[:3], runs[3:]
    assert [n for _, n in warm] == ["plain", "a", "b"]
    assert [i for i, _ in timed] == ["i0"] * 3 + ["i1"] * 3 + ["i0"] * 3 + ["i1"] * 3
    assert [n for _, n in timed[:6]] == ["plain", "a", "b", "a", "b", "plain"]  # order rotates
    resets = [k for k, e in enumerate(log) if e[0] == "reset"]
    assert len(resets) == 3 * 3  # warm-up + each repeat, every runner
    assert all(len(r.runs) == 2 for r in results)


def test_top2_gap_matches_a_manual_forward(tiny_llama):
    import torch

    prompt, prefix = [3, 4, 5, 6], [7, 8]
    gap = top2_gap(tiny_llama, prompt, prefix)
    with torch.no_grad():
        logits = tiny_llama.model(input_ids=torch.tensor([prompt + prefix])).logits[0, -1]
    top = torch.sort(logits, descending=True).values
    assert gap == pytest.approx(float(top[0] - top[1]))
    assert gap >= 0


# ---------------------------------------------------------------------- JSON / table / plot
ITEM_KEYS = {
    "id": str, "kind": str, "method": str, "new_tokens": int, "seconds": float, "tokens_per_s": float,
}


def check_json_shape(data, methods, kinds):
    assert isinstance(data["model"], str)
    assert isinstance(data["threads"], int) and isinstance(data["repeats"], int)
    assert set(data["summary"]) == set(methods)
    for method, by_kind in data["summary"].items():
        assert set(by_kind) == {"all", *kinds}
        for entry in by_kind.values():
            assert isinstance(entry["tokens_per_s"], float)
            assert isinstance(entry["speedup_vs_plain"], float)
            mas = entry["mean_accepted_per_step"]
            assert mas is None or isinstance(mas, float)
            if method.startswith("hf"):
                assert mas is None
    assert isinstance(data["items"], list) and data["items"]
    for rec in data["items"]:
        for key, typ in ITEM_KEYS.items():
            assert isinstance(rec[key], typ), (key, rec[key])
        assert rec["mean_accepted_per_step"] is None or isinstance(rec["mean_accepted_per_step"], float)
        assert rec["identical_to_plain"] is None or isinstance(rec["identical_to_plain"], bool)
        if rec["method"] == "plain":
            assert rec["identical_to_plain"] is None
        if rec["method"].startswith("hf"):
            assert rec["mean_accepted_per_step"] is None


def test_report_json_table_and_plot_are_pure_functions_of_the_runs(tmp_path):
    results = [
        result("a", "plain", [fake_run("a", "plain", [1, 2, 3, 4], 1.0, kind="g", steps=4)], kind="g"),
        result("a", "hf", [fake_run("a", "hf", [1, 2, 3, 4], 0.8, kind="g")], kind="g"),
        result("a", "draftmesh", [ItemRun("a", "g", "draftmesh", [1, 2, 9], 0.5, steps=2, draft_s=0.001,
                                          verify_s=0.4, sources={"s": SourceStats(2, 6, 3)})], kind="g"),
    ]
    check_identical(results)
    results[2].mismatch_top2_gap = 0.0123
    report = BenchReport("m", 2, 1, results, skipped={"hf-assist": "no --assistant given"})
    data = json.loads(json.dumps(report_to_json(report)))
    check_json_shape(data, ["plain", "hf", "draftmesh"], ["g"])
    assert data["mismatches"] == [
        {"id": "a", "method": "draftmesh", "first_difference": 2, "repeat": 0, "mismatch_top2_gap": 0.0123}
    ]
    assert data["skipped"] == {"hf-assist": "no --assistant given"}
    text = format_report(report)
    assert "hf-assist: skipped" in text
    assert "!!!" in text and "first difference at token 2" in text
    assert "3/6 50%" in text  # acceptance: accepted / proposed tokens
    png = tmp_path / "p.png"
    write_plot(report, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------- end to end on a tiny model
def test_run_end_to_end_on_a_tiny_model(tmp_path, tiny_llama, capsys):
    out_json, out_png = tmp_path / "out.json", tmp_path / "out.png"
    args = parse([
        "--workload", str(workload_file(tmp_path)), "--methods", "plain,hf,hf-pld,hf-assist,draftmesh",
        "--repeats", "2", "--threads", "1", "--json", str(out_json), "--plot", str(out_png), "--no-progress",
    ])
    args.model = tiny_llama
    assert run(args) == 0
    printed = capsys.readouterr().out
    for method in ("plain", "hf", "hf-pld", "draftmesh"):
        assert method in printed
    assert "hf-assist: skipped (no --assistant given)" in printed
    data = json.loads(out_json.read_text())
    check_json_shape(data, ["plain", "hf", "hf-pld", "draftmesh"], ["grounded", "open"])
    assert data["model"] == "tiny-llama" and data["threads"] == 1 and data["repeats"] == 2
    assert len(data["items"]) == 4 * 4
    assert all(r["identical_to_plain"] is True for r in data["items"] if r["method"] != "plain")
    assert all(len(r["seconds_by_repeat"]) == 2 for r in data["items"])
    assert data["summary"]["plain"]["all"]["speedup_vs_plain"] == pytest.approx(1.0)
    assert data["summary"]["plain"]["all"]["mean_accepted_per_step"] == pytest.approx(1.0)
    assert data["skipped"] == {"hf-assist": "no --assistant given"}
    assert data["machine"]["logical_cpus"] >= 1 and data["date"] and data["command"]
    assert data["cost_curve"]["1"] == 1.0
    assert data["summary"]["draftmesh"]["all"]["acceptance_by_source"]  # one entry per source in use
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_hf_assist_runs_with_an_injected_assistant(tmp_path, tiny_llama):
    from tiny_models import tiny_target

    out_json = tmp_path / "out.json"
    args = parse([
        "--workload", str(workload_file(tmp_path, n=2)), "--methods", "hf-assist", "--repeats", "1",
        "--threads", "1", "--json", str(out_json), "--no-progress", "--no-cost-curve",
    ])
    args.model, args.assistant = tiny_llama, tiny_target("llama", seed=1)
    assert run(args) == 0
    data = json.loads(out_json.read_text())
    assert data["methods"] == ["plain", "hf-assist"] and data["skipped"] == {}
    assert all(r["identical_to_plain"] is True for r in data["items"] if r["method"] == "hf-assist")


def test_run_exits_1_and_records_a_mismatch(tmp_path, tiny_llama, monkeypatch, capsys):
    import draftmesh.bench.run as bench_run

    def corrupting(method, target, **kwargs):
        runner = make_runner(method, target, **kwargs)
        return CorruptingRunner(runner, name=method.name, at=2) if method.name == "draftmesh" else runner

    monkeypatch.setattr(bench_run, "make_runner", corrupting)
    out_json = tmp_path / "out.json"
    args = parse([
        "--workload", str(workload_file(tmp_path, n=2)), "--methods", "plain,draftmesh", "--repeats", "1",
        "--threads", "1", "--json", str(out_json), "--no-progress", "--no-cost-curve",
    ])
    args.model = tiny_llama
    assert run(args) == 1
    captured = capsys.readouterr()
    assert "OUTPUT MISMATCH: item 'item-0' method 'draftmesh' differs from plain at token 2" in captured.err
    assert "!!! 2 OUTPUT MISMATCH(ES)" in captured.out
    data = json.loads(out_json.read_text())
    bad = [r for r in data["items"] if r["method"] == "draftmesh"]
    assert all(r["identical_to_plain"] is False and r["first_difference"] == 2 for r in bad)
    assert all(isinstance(r["mismatch_top2_gap"], float) and r["mismatch_top2_gap"] >= 0 for r in bad)


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--methods", "plain,draftmesh:no_such_source"], "unknown draft source 'no_such_source'"),
        (["--methods", "plain,turbo"], "unknown method 'turbo'"),
    ],
)
def test_run_rejects_bad_methods(tmp_path, tiny_llama, capsys, argv, needle):
    args = parse(["--workload", str(workload_file(tmp_path, n=1)), *argv])
    args.model = tiny_llama
    assert run(args) == 2
    assert needle in capsys.readouterr().err


def test_run_reports_a_bad_workload_with_line_numbers(tmp_path, tiny_llama, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": "a", "kind": "open", "prompt": "w3", "max_new_tokens": 4}\n{"id": "a"}\n')
    args = parse(["--workload", str(path)])
    args.model = tiny_llama
    assert run(args) == 2
    err = capsys.readouterr().err
    assert "line 2: missing 'kind'" in err and "line 2: duplicate id 'a' (first on line 1)" in err


def test_run_reports_items_that_do_not_fit_the_model(tmp_path, tiny_llama, capsys):
    path = tmp_path / "long.jsonl"
    long_prompt = " ".join(["w3"] * 250)  # the tiny model's context is 256 tokens
    path.write_text(json.dumps({"id": "long", "kind": "open", "prompt": long_prompt, "max_new_tokens": 10}) + "\n")
    args = parse(["--workload", str(path), "--no-progress"])
    args.model = tiny_llama
    assert run(args) == 2
    err = capsys.readouterr().err
    assert "item 'long' (line 1): prompt 250 + max_new_tokens 10 tokens exceeds the model context of 256" in err


def test_limit_and_max_new_tokens_override(tmp_path, tiny_llama):
    out_json = tmp_path / "out.json"
    args = parse([
        "--workload", str(workload_file(tmp_path, n=4, max_new_tokens=10)), "--methods", "plain", "--limit", "2",
        "--max-new-tokens", "3", "--repeats", "1", "--threads", "1", "--json", str(out_json), "--no-progress",
        "--no-cost-curve",
    ])
    args.model = tiny_llama
    assert run(args) == 0
    data = json.loads(out_json.read_text())
    assert [r["id"] for r in data["items"]] == ["item-0", "item-1"]
    assert all(r["new_tokens"] <= 3 for r in data["items"])
    assert math.isclose(data["summary"]["plain"]["all"]["speedup_vs_plain"], 1.0)


# ---------------------------------------------------------------------- engine runner bookkeeping
class FakeSource:
    """Proposes the same token and text drafts every step; remembers finished requests."""

    name = "fake"
    instances: list["FakeSource"] = []

    def __init__(self):
        self.finished: list[str] = []
        FakeSource.instances.append(self)

    def propose(self, ctx):
        from draftmesh.draft.base import Proposal

        return [Proposal(self.name, token_ids=(3, 4, 5)), Proposal(self.name, text="w6 w7")]

    def finish(self, ctx, output_ids, output_text):
        self.finished.append(ctx.request_id)


@pytest.fixture
def fake_source(monkeypatch):
    FakeSource.instances = []
    monkeypatch.setitem(registry.FACTORIES, "fake", lambda *args, **kwargs: FakeSource())
    return FakeSource


def test_engine_runner_counts_proposed_tokens_per_source(tiny_llama, fake_source):
    runner = EngineRunner("draftmesh:fake", tiny_llama, ["fake"])
    item = prepared(tiny_llama, n=1, max_new_tokens=6)[0]
    run = runner.run(item)
    stats = run.sources["fake"]
    drafting_steps = stats.proposals // 2
    assert drafting_steps >= 1
    # 3 tokens from the token proposal, 2 from the text one ("w6 w7") on every drafting step
    assert stats.proposed_tokens == 5 * drafting_steps
    assert 0 <= stats.accepted_tokens <= stats.proposed_tokens
    assert run.steps >= 1 and run.draft_s >= 0 and run.verify_s > 0


def test_each_repeat_starts_from_fresh_sources(tiny_llama, fake_source):
    plain = EngineRunner("plain", tiny_llama, [])
    fake = EngineRunner("draftmesh:fake", tiny_llama, ["fake"])
    items = prepared(tiny_llama, n=2, max_new_tokens=4)
    execute([plain, fake], items, repeats=2, progress=False)
    # one source for the warm-up, then one per repeat, each seeing only its own pass
    assert [s.finished for s in FakeSource.instances] == [["i0"], ["i0", "i1"], ["i0", "i1"]]


def test_policy_methods_parse_and_are_marked_lossy():

    methods = {m.name: m for m in parse_methods("draftmesh+typical,draftmesh:history+block,draftmesh", available=["history"], defaults=["history"])}
    assert methods["draftmesh+typical"].policy == "typical" and not methods["draftmesh+typical"].lossless
    assert methods["draftmesh:history+block"].sources == ("history",)
    assert methods["draftmesh"].lossless
    with pytest.raises(ValueError, match="unknown acceptance policy 'yolo'"):
        parse_methods("draftmesh+yolo", available=["history"], defaults=["history"])
    with pytest.raises(ValueError, match="draftmesh methods only"):
        parse_methods("hf+typical", available=["history"], defaults=["history"])


def test_edit_distance_and_fidelity():

    assert edit_distance([1, 2, 3], [1, 2, 3]) == 0
    assert edit_distance([1, 2, 3], [1, 3]) == 1
    assert edit_distance([], [4, 5]) == 2
    plain = ItemResult("a", "k", "plain", runs=[ItemRun("a", "k", "plain", [1, 2, 3, 4], 1.0)])
    lossy = ItemResult("a", "k", "draftmesh+typical", lossless=False,
                       runs=[ItemRun("a", "k", "draftmesh+typical", [1, 2, 9, 4], 0.5)])
    measure_fidelity([plain, lossy])
    assert lossy.same_as_plain is False and lossy.edit_distance == pytest.approx(0.25)
    assert plain.same_as_plain is None


# ---------------------------------------------------------------------- --target mesh (no Ray here)
def test_parse_mesh_methods():
    methods = parse_methods("mesh:draftmesh,mesh:plain", available=["history"], defaults=["history"])
    assert [m.name for m in methods] == ["plain", "mesh:draftmesh", "mesh:plain"]
    mesh = {m.name: m for m in methods}
    assert mesh["mesh:plain"].family == "mesh" and mesh["mesh:plain"].sources == ()
    assert mesh["mesh:draftmesh"].family == "mesh" and mesh["mesh:draftmesh"].sources is None
    assert all(m.lossless for m in methods)
    with pytest.raises(ValueError, match="unknown method 'mesh:nope'") as info:
        parse_methods("mesh:nope", available=["history"], defaults=["history"])
    assert "mesh:plain" in str(info.value) and "mesh:draftmesh" in str(info.value)
    with pytest.raises(ValueError, match="draftmesh methods only"):
        parse_methods("mesh:draftmesh+typical", available=["history"], defaults=["history"])
    with pytest.raises(ValueError, match="use make_mesh_runners"):
        make_runner(mesh["mesh:plain"], None)


def test_default_methods_follow_the_target():
    args = parse(["--workload", "w.jsonl", "--target", "mesh"])
    assert args.target == "mesh" and args.methods is None and args.addr is None
    text = default_methods(args.target, args.methods)
    assert text == DEFAULT_MESH_METHODS
    assert [m.name for m in parse_methods(text)] == ["plain", "draftmesh", "mesh:plain", "mesh:draftmesh"]
    local = parse(["--workload", "w.jsonl"])
    assert local.target == "local" and default_methods(local.target, local.methods) == DEFAULT_METHODS
    assert default_methods("mesh", "plain,mesh:plain") == "plain,mesh:plain"  # an explicit list wins
    with pytest.raises(SystemExit):
        parse(["--workload", "w.jsonl", "--target", "cloud"])


def test_check_target_rejects_flags_that_do_not_fit():
    local = parse_methods("plain,draftmesh")
    mesh = parse_methods("plain,mesh:plain")
    check_target("local", local)
    check_target("mesh", mesh, addr="h:1", tls_ca="ca.pem")
    with pytest.raises(ValueError, match="mesh:plain run through the mesh: add --target mesh"):
        check_target("local", mesh)
    with pytest.raises(ValueError, match="--addr and --tls-ca need --target mesh"):
        check_target("local", local, addr="h:1")
    with pytest.raises(ValueError, match="needs a mesh method"):
        check_target("mesh", local)
    with pytest.raises(ValueError, match="--tls-ca applies to a mesh given with --addr"):
        check_target("mesh", mesh, tls_ca="ca.pem")


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--methods", "plain,mesh:plain"], "add --target mesh"),
        (["--target", "mesh"], "must be a model spec"),  # a mesh is started for --model: a TorchTarget cannot be
        (["--target", "mesh", "--addr", "h:1", "--tls-ca", "/nonexistent/ca.pem"], "--tls-ca: cannot read"),
        (["--target", "mesh", "--addr", "127.0.0.1:{closed}"], "answered UNAVAILABLE"),  # nothing listens
    ],
)
def test_run_rejects_bad_mesh_setups(tmp_path, tiny_llama, capsys, argv, needle):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    argv = [a.format(closed=closed) for a in argv]
    args = parse(["--workload", str(workload_file(tmp_path)), "--no-progress", *argv])
    args.model = tiny_llama
    assert run(args) == 2
    assert needle in capsys.readouterr().err


def test_item_order_runs_mesh_plain_after_mesh_draftmesh():
    class R:
        def __init__(self, name, run_after=None):
            self.name, self.run_after = name, run_after

    runners = [R("plain"), R("draftmesh"), R("mesh:plain", run_after="mesh:draftmesh"), R("mesh:draftmesh")]
    orders = [[r.name for r in item_order(runners, shift)] for shift in range(8)]
    for order in orders:
        assert sorted(order) == sorted(r.name for r in runners)
        assert order.index("mesh:draftmesh") < order.index("mesh:plain")
    assert len({tuple(o) for o in orders}) > 1


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6])
def test_item_order_puts_every_method_after_every_other_equally_often(n):
    """Over a cycle of the design every method runs in every position, and right after every
    other method, equally often: a plain rotation (the old order) always ran the same method right
    after vLLM's, so whatever vLLM left behind was charged to that one method on every item."""

    class R:
        def __init__(self, name):
            self.name = name

    runners = [R("plain")] + [R(f"m{i}") for i in range(1, n)]
    cycle = n if n % 2 == 0 else 2 * n
    orders = [[r.name for r in item_order(runners, shift)] for shift in range(cycle)]
    positions = Counter((name, order.index(name)) for order in orders for name in order)
    follows = Counter((order[i], order[i + 1]) for order in orders for i in range(n - 1))
    assert len(positions) == n * n and len(set(positions.values())) == 1
    assert len(follows) == n * (n - 1) and len(set(follows.values())) == 1
    assert [[r.name for r in item_order(runners, shift + cycle)] for shift in range(cycle)] == orders


def mesh_pair_results():
    """Two items; per item: in-process and mesh runs of plain and draftmesh (one repeat, except noted)."""

    def run(item, method, n, seconds, steps, first, draft=0.0, verify=0.0):
        return ItemRun(item, "k", method, list(range(n)), seconds, steps=steps, draft_s=draft, verify_s=verify,
                       first_token_s=first)

    return [
        # item a: 20 tokens
        result("a", "plain", [run("a", "plain", 20, 2.0, 20, 0.10, verify=1.8)]),
        result("a", "draftmesh", [run("a", "draftmesh", 20, 1.0, 10, 0.12, draft=0.05, verify=0.85)]),
        result("a", "mesh:plain", [run("a", "mesh:plain", 20, 2.5, 20, 0.20, verify=1.9)]),
        # three repeats: median time 1.2 s, its run has 10 steps; first token median 0.3
        result("a", "mesh:draftmesh", [run("a", "mesh:draftmesh", 20, 1.4, 10, 0.5, draft=0.1, verify=1.0),
                                       run("a", "mesh:draftmesh", 20, 1.2, 10, 0.3, draft=0.05, verify=0.95),
                                       run("a", "mesh:draftmesh", 20, 1.1, 10, 0.2, draft=0.05, verify=0.9)]),
        # item b: 10 tokens
        result("b", "plain", [run("b", "plain", 10, 1.0, 10, 0.30, verify=0.9)]),
        result("b", "draftmesh", [run("b", "draftmesh", 10, 1.0, 10, 0.32, verify=0.9)]),
        result("b", "mesh:plain", [run("b", "mesh:plain", 10, 1.0, 10, 0.40, verify=0.9)]),
        result("b", "mesh:draftmesh", [run("b", "mesh:draftmesh", 10, 0.5, 5, 0.1, verify=0.4)]),
    ]


def test_mesh_summary_maths():
    results = mesh_pair_results()
    check_identical(results)
    pairs = mesh_summary(results)
    assert list(pairs) == ["mesh:draftmesh", "mesh:plain"]
    dm, pl = pairs["mesh:draftmesh"], pairs["mesh:plain"]
    assert dm["reference"] == "draftmesh" and pl["reference"] == "plain"
    assert dm["items"] == 2 and dm["identical"] == 2 and dm["mismatches"] == 0
    # tokens/s ratio: geometric mean of per-item ratios of the median times:
    # a: (20/1.2) / (20/1.0) = 1/1.2; b: (10/0.5) / (10/1.0) = 2
    assert dm["tokens_per_s_ratio"] == pytest.approx(math.sqrt(2 / 1.2), abs=1e-4)
    assert pl["tokens_per_s_ratio"] == pytest.approx(math.sqrt((2.0 / 2.5) * 1.0), abs=1e-4)
    # first token: median over items of each item's median over repeats
    assert dm["first_token_ms"]["mesh"] == pytest.approx((300 + 100) / 2)
    assert dm["first_token_ms"]["local"] == pytest.approx((120 + 320) / 2)
    assert pl["first_token_ms"] == {"mesh": pytest.approx(300.0), "local": pytest.approx(200.0)}
    # overhead per step: median over items of (mesh s - local s) / mesh steps, in ms
    # a: (1.2 - 1.0) / 10 = 20 ms; b: (0.5 - 1.0) / 5 = -100 ms
    assert dm["overhead_ms_per_step"] == pytest.approx((20 - 100) / 2)
    # plain a: (2.5 - 2.0) / 20 = 25 ms; b: 0 ms
    assert pl["overhead_ms_per_step"] == pytest.approx(12.5)
    # compute per step (draft + verify of the representative run): a mesh (0.05 + 0.95) / 10 = 100 ms
    assert dm["compute_ms_per_step"]["mesh"] == pytest.approx((100 + 80) / 2)
    assert dm["compute_ms_per_step"]["local"] == pytest.approx((90 + 90) / 2)
    assert dm["mean_accepted_per_step"] == {"mesh": pytest.approx(2.0), "local": pytest.approx(1.5)}
    # only pairs whose mesh method ran
    only_plain = [r for r in results if r.method != "mesh:draftmesh"]
    assert list(mesh_summary(only_plain)) == ["mesh:plain"]
    assert mesh_summary([r for r in results if not r.method.startswith("mesh:")]) == {}


def test_mesh_report_json_and_table(tmp_path):
    results = mesh_pair_results()
    check_identical(results)
    info = {"address": "localhost:1", "started_by_bench": True, "started_s": 12.5, "mesh_state_reset": True,
            "memory": {"rss_mb": 2048.0, "pss_mb": 1024.0, "processes": 12}}
    report = BenchReport("m", 2, 1, results, mesh=info)
    data = json.loads(json.dumps(report_to_json(report)))
    assert data["mesh"]["started_s"] == 12.5 and data["mesh"]["memory"]["rss_mb"] == 2048.0
    assert set(data["mesh"]["pairs"]) == {"mesh:draftmesh", "mesh:plain"}
    recs = {(r["id"], r["method"]): r for r in data["items"]}
    assert recs[("a", "mesh:draftmesh")]["first_token_ms"] == pytest.approx(300.0)
    assert recs[("a", "plain")]["first_token_ms"] == pytest.approx(100.0)
    assert data["summary"]["mesh:draftmesh"]["all"]["first_token_ms"] == pytest.approx(200.0)
    text = format_report(report)
    assert "mesh vs in-process (mesh started in 12.5s; mesh memory RSS 2.00 GiB, PSS 1.00 GiB in 12 processes)" in text
    row = next(line for line in text.splitlines() if line.startswith("mesh:draftmesh  draftmesh"))
    assert "1.29x" in row and "200.0 / 220.0" in row and "-40.00" in row
    # without mesh methods: no "mesh" key, no mesh table
    local = BenchReport("m", 2, 1, [r for r in results if not r.method.startswith("mesh:")])
    assert "mesh" not in report_to_json(local) and "mesh vs in-process" not in format_report(local)
    # a mesh the bench did not start
    info = {"address": "h:9", "started_by_bench": False, "mesh_state_reset": False}
    text = format_report(BenchReport("m", 2, 1, results, mesh=info))
    assert "mesh at h:9; mesh state NOT reset between passes" in text


# a tiny gRPC Generation server scripted per test
class ScriptedGeneration(pb_grpc.GenerationServicer):
    """Streams: an empty delta (a step that committed nothing visible yet), then one delta per
    token group, then the result; sleeps ``pause`` before every delta."""

    def __init__(self, groups=((5, 6), (7,)), prompt_tokens=12, pause=0.03, abort=None):
        self.groups, self.prompt_tokens, self.pause, self.abort = groups, prompt_tokens, pause, abort
        self.requests = []

    def Generate(self, request, context):
        import time as _time

        import grpc

        from draftmesh.v1 import generation_pb2 as pb

        self.requests.append(request)
        if self.abort:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, self.abort)
        step = 0
        for group in ((), *self.groups):
            _time.sleep(self.pause)
            step += 1
            stats = pb.StepStats(step=step, draft_ms=1.5, verify_ms=10.0, emitted=len(group))
            yield pb.GenerateResponse(delta=pb.GenerateDelta(text="x" * len(group), token_ids=list(group), stats=stats))
        tokens = [t for g in self.groups for t in g]
        yield pb.GenerateResponse(result=pb.GenerateResult(
            text="w5 w6 w7", token_ids=tokens, finish_reason="length", lossless=True, policy="exact",
            usage=pb.Usage(prompt_tokens=self.prompt_tokens, completion_tokens=len(tokens), steps=step,
                           cached_prompt_tokens=4),
            sources=[pb.SourceStats(source="history", nodes=9, accepted_tokens=2, acceptance=0.2)],
        ))

    def Complete(self, request, context):  # pragma: no cover - the bench streams
        raise NotImplementedError


@contextlib.contextmanager
def serve_generation(servicer):
    from concurrent import futures

    import grpc

    from draftmesh.v1 import generation_pb2_grpc as pb_grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_GenerationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(0)


def work_item(**kw):
    base = dict(id="it", kind="k", max_new_tokens=3)
    base.update(kw)
    return PreparedItem(WorkItem(**base), tuple(range(2, 14)), base["max_new_tokens"])


def test_mesh_runner_builds_requests_from_work_items():
    from draftmesh.client import MeshClient

    servicer = ScriptedGeneration(pause=0.0)
    messages = ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"})
    with serve_generation(servicer) as addr, MeshClient(addr) as client:
        dm = MeshRunner("mesh:draftmesh", client, speculate=True, max_nodes=7)
        pl = MeshRunner("mesh:plain", client, speculate=False, session_suffix="#p")
        dm.run(work_item(messages=messages, corpus=("doc one", "doc two"), session="chat-1", max_new_tokens=3))
        pl.run(work_item(prompt="w2 w3 w4", session="chat-1", max_new_tokens=5))
        pl.run(work_item(prompt="w2 w3 w4"))
    r1, r2, r3 = servicer.requests
    assert [(m.role, m.content) for m in r1.messages] == [("system", "Be brief."), ("user", "Hi")] and not r1.prompt
    assert [d.text for d in r1.documents] == ["doc one", "doc two"]
    assert r1.session_id == "chat-1" and r1.max_new_tokens == 3
    assert not r1.speculation.HasField("enabled")  # the mesh's default speculation
    assert r1.speculation.max_nodes == 7
    assert r2.prompt == "w2 w3 w4" and not r2.messages and not r2.documents
    assert r2.speculation.HasField("enabled") and r2.speculation.enabled is False
    assert not r2.speculation.HasField("max_nodes")
    assert r2.session_id == "chat-1#p" and r2.max_new_tokens == 5
    assert r3.session_id == ""


def test_mesh_runner_timing_steps_and_stats():
    from draftmesh.client import MeshClient

    servicer = ScriptedGeneration(groups=((5, 6), (7,)), pause=0.05)
    with serve_generation(servicer) as addr, MeshClient(addr) as client:
        runner = MeshRunner("mesh:draftmesh", client)
        run = runner.run(work_item(prompt="w2"))
    assert run.method == "mesh:draftmesh" and run.item_id == "it"
    assert run.token_ids == [5, 6, 7] and run.text == "w5 w6 w7"
    assert run.steps == 3  # every delta is a step, the empty first one included
    # the first delta carrying tokens is the second one: two pauses in
    assert 0.09 <= run.first_token_s < run.seconds
    assert run.seconds >= 0.14
    assert run.draft_s == pytest.approx(3 * 1.5e-3, rel=1e-3) and run.verify_s == pytest.approx(3 * 0.010, rel=1e-3)
    assert run.prompt_tokens == 12 and run.cached_prompt_tokens == 4 and run.lenient_tokens == 0
    st = run.sources["history"]
    assert (st.proposals, st.proposed_tokens, st.accepted_tokens) == (0, 0, 2)  # no proposals through the API


def test_mesh_runner_checks_the_prompt_tokens_and_reports_rpc_errors():
    from draftmesh.client import MeshClient

    with serve_generation(ScriptedGeneration(prompt_tokens=11, pause=0.0)) as addr, MeshClient(addr) as client:
        runner = MeshRunner("mesh:plain", client, speculate=False)
        with pytest.raises(MeshError, match=r"rendered the raw prompt text to 11 prompt tokens, the bench to 12"):
            runner.run(work_item(prompt="w2"))
        with pytest.raises(MeshError, match="chat messages"):
            runner.run(work_item(messages=({"role": "user", "content": "hi"},)))
    with serve_generation(ScriptedGeneration(abort="prompt: too long")) as addr, MeshClient(addr) as client:
        with pytest.raises(MeshError, match="mesh:plain: item 'it'.*INVALID_ARGUMENT: prompt: too long"):
            MeshRunner("mesh:plain", client, speculate=False).run(work_item(prompt="w2"))


def test_mesh_runner_reset_calls_the_resetter_and_runners_share_one_client():
    calls = []
    methods = parse_methods("mesh:plain,mesh:draftmesh", available=["history"], defaults=["history"])
    client = object()
    runners = make_mesh_runners(methods, client, resetter=lambda: calls.append(1), max_nodes=9)
    assert [r.name for r in runners] == ["mesh:plain", "mesh:draftmesh"]
    pl, dm = runners
    assert pl.client is dm.client is client
    assert pl.speculate is False and dm.speculate is True and dm.max_nodes == 9
    assert pl.run_after == "mesh:draftmesh" and dm.run_after is None
    assert pl.session_suffix and not dm.session_suffix
    for r in runners:
        r.reset()
    assert calls == [1, 1]
    MeshRunner("mesh:plain", client).reset()  # no resetter: nothing to do (a mesh not ours)
    alone = make_mesh_runners(methods[:2], client)
    assert alone[0].run_after is None  # no mesh:draftmesh to wait for


class EngineGeneration(pb_grpc.GenerationServicer):
    """A Generation server that really decodes with a tiny target, as a verifier replica does:
    one decoder shared by every request (like the mesh), rendering prompts with draftmesh.prompts."""

    def __init__(self, target):
        from draftmesh.verify.engine import build_decoder

        self.target = target
        self.decoder = build_decoder(target)
        self.requests = []

    def Generate(self, request, context):
        from draftmesh.io_struct import GenerationRequest, GenerationResult, ServedResult, SpeculationParams
        from draftmesh.prompts import encode_messages, encode_prompt
        from draftmesh.router.responses import result_to_proto, step_to_proto
        from draftmesh.v1 import generation_pb2 as pb

        self.requests.append(request)
        tok = self.target.tokenizer
        if request.messages:
            ids = encode_messages(tok, [{"role": m.role, "content": m.content} for m in request.messages])
        else:
            ids = encode_prompt(tok, request.prompt)
        spec = request.speculation
        req = GenerationRequest(
            tuple(ids), max_new_tokens=request.max_new_tokens, session_id=request.session_id or None,
            documents=tuple(d.text for d in request.documents),
            speculation=SpeculationParams(enabled=spec.enabled if spec.HasField("enabled") else True),
        )
        step = 0
        for event in self.decoder.stream(req):
            if isinstance(event, GenerationResult):
                yield pb.GenerateResponse(result=result_to_proto(ServedResult(event, "fake"), "r"))
            else:
                step += 1
                yield step_to_proto(step, event)

    def Complete(self, request, context):  # pragma: no cover - the bench streams
        raise NotImplementedError


def test_run_target_mesh_with_addr_end_to_end_on_a_tiny_model(tmp_path, tiny_llama, capsys):
    out_json = tmp_path / "out.json"
    servicer = EngineGeneration(tiny_llama)
    with serve_generation(servicer) as addr:
        args = parse([
            "--workload", str(workload_file(tmp_path)), "--target", "mesh", "--addr", addr,
            "--repeats", "2", "--threads", "1", "--json", str(out_json), "--no-progress", "--no-cost-curve",
        ])
        args.model = tiny_llama
        assert run(args) == 0
    captured = capsys.readouterr()
    assert "not started by the bench" in captured.err and "carries over between passes" in captured.err
    assert "mesh vs in-process (mesh at " in captured.out
    data = json.loads(out_json.read_text())
    assert data["target"] == "mesh"
    assert data["methods"] == ["plain", "draftmesh", "mesh:plain", "mesh:draftmesh"]
    check_json_shape(data, data["methods"], ["grounded", "open"])
    # identity: every mesh method token for token equal to in-process plain
    mesh_items = [r for r in data["items"] if r["method"].startswith("mesh:")]
    assert len(mesh_items) == 2 * 4 and all(r["identical_to_plain"] is True for r in mesh_items)
    assert all(r["first_token_ms"] > 0 for r in data["items"])
    mesh = data["mesh"]
    assert mesh["started_by_bench"] is False and mesh["mesh_state_reset"] is False
    assert mesh["address"] == addr and mesh["started_s"] is None and mesh["memory"] is None
    assert set(mesh["pairs"]) == {"mesh:plain", "mesh:draftmesh"}
    assert mesh["pairs"]["mesh:plain"]["mean_accepted_per_step"]["mesh"] == pytest.approx(1.0)
    # warm-up + 2 passes x 4 items, for each of the two mesh methods
    assert len(servicer.requests) == 2 * (1 + 2 * 4)
    plain_reqs = [r for r in servicer.requests if r.speculation.HasField("enabled")]
    assert plain_reqs and all(not r.speculation.enabled for r in plain_reqs)
    assert {r.session_id for r in plain_reqs} - {""} == {"s#mesh-plain"}


def test_the_traced_method_exports_spans_only_during_its_own_runs(tmp_path, tiny_llama, capsys):
    (traced,) = [m for m in parse_methods("draftmesh,draftmesh-traced") if m.traced]
    assert traced.name == "draftmesh-traced" and traced.sources is None and traced.lossless
    args = parse(["--workload", str(workload_file(tmp_path)), "--methods", "draftmesh,draftmesh-traced",
                  "--repeats", "1", "--threads", "1", "--no-progress", "--json", str(tmp_path / "o.json")])
    args.model = tiny_llama
    assert run(args) == 0  # identical outputs: tracing changes nothing
    from draftmesh.bench.tracing import tracing_switch

    switch = tracing_switch()
    exported = switch.exported()
    data = json.loads((tmp_path / "o.json").read_text())
    traced_steps = sum(r["steps"] for r in data["items"] if r["method"] == "draftmesh-traced")
    # warm-up + one repeat: a decode, a prefill and >= 3 spans per step, for each traced run
    assert exported >= 2 * traced_steps * 3 > 0
    assert f"{exported} spans exported" in capsys.readouterr().out
    assert not switch.on
    EngineRunner("draftmesh", tiny_llama, None).run(prepared(tiny_llama, n=1, max_new_tokens=4)[0])
    assert switch.exported() == exported  # an untraced run, with the switch installed: nothing
