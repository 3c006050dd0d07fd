"""`draftmesh bench`: method parsing, the maths, the identical-output check, JSON/plot, and an
end-to-end run on a tiny random-weight model (no real model, nothing downloaded)."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from draftmesh import bench
from draftmesh.bench import (
    ItemResult,
    ItemRun,
    PreparedItem,
    SourceStats,
    check_identical,
    first_difference,
    geometric_mean,
    parse_methods,
    speedup_ratios,
    summarize,
)
from draftmesh.draft import registry
from draftmesh.workload import WorkItem


@pytest.fixture(scope="module")
def tiny_llama():
    from tiny_models import tiny_target

    return tiny_target("llama")


def workload_file(tmp_path, n: int = 4, max_new_tokens: int = 10):
    rows = []
    for i in range(n):
        words = " ".join(f"w{2 + (i + j) % 8}" for j in range(6))
        rows.append(
            {
                "id": f"item-{i}",
                "kind": "grounded" if i % 2 == 0 else "open",
                "prompt": f"{words} {words}",
                "max_new_tokens": max_new_tokens,
                **({"session": "s"} if i < 2 else {}),
                **({"corpus": [words]} if i == 3 else {}),
            }
        )
    path = tmp_path / "w.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def parse(argv):
    parser = argparse.ArgumentParser(prog="draftmesh bench")
    bench.add_arguments(parser)
    return parser.parse_args(argv)


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
    msg = bench.mismatch_message(differs, plain.runs[0].token_ids)
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
    plain = bench.EngineRunner("plain", tiny_llama, [])
    broken = CorruptingRunner(bench.EngineRunner("x", tiny_llama, []))
    warnings = []
    results = bench.execute(
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
    results = bench.execute(runners, items, repeats=2, progress=False)
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
    gap = bench.top2_gap(tiny_llama, prompt, prefix)
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
    report = bench.BenchReport("m", 2, 1, results, skipped={"hf-assist": "no --assistant given"})
    data = json.loads(json.dumps(bench.report_to_json(report)))
    check_json_shape(data, ["plain", "hf", "draftmesh"], ["g"])
    assert data["mismatches"] == [
        {"id": "a", "method": "draftmesh", "first_difference": 2, "repeat": 0, "mismatch_top2_gap": 0.0123}
    ]
    assert data["skipped"] == {"hf-assist": "no --assistant given"}
    text = bench.format_report(report)
    assert "hf-assist: skipped" in text
    assert "!!!" in text and "first difference at token 2" in text
    assert "3/6 50%" in text  # acceptance: accepted / proposed tokens
    png = tmp_path / "p.png"
    bench.write_plot(report, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------- end to end on a tiny model
def test_run_end_to_end_on_a_tiny_model(tmp_path, tiny_llama, capsys):
    out_json, out_png = tmp_path / "out.json", tmp_path / "out.png"
    args = parse([
        "--workload", str(workload_file(tmp_path)), "--methods", "plain,hf,hf-pld,hf-assist,draftmesh",
        "--repeats", "2", "--threads", "1", "--json", str(out_json), "--plot", str(out_png), "--no-progress",
    ])
    args.model = tiny_llama
    assert bench.run(args) == 0
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
    assert bench.run(args) == 0
    data = json.loads(out_json.read_text())
    assert data["methods"] == ["plain", "hf-assist"] and data["skipped"] == {}
    assert all(r["identical_to_plain"] is True for r in data["items"] if r["method"] == "hf-assist")


def test_run_exits_1_and_records_a_mismatch(tmp_path, tiny_llama, monkeypatch, capsys):
    real = bench.make_runner

    def make_runner(method, target, **kwargs):
        runner = real(method, target, **kwargs)
        return CorruptingRunner(runner, name=method.name, at=2) if method.name == "draftmesh" else runner

    monkeypatch.setattr(bench, "make_runner", make_runner)
    out_json = tmp_path / "out.json"
    args = parse([
        "--workload", str(workload_file(tmp_path, n=2)), "--methods", "plain,draftmesh", "--repeats", "1",
        "--threads", "1", "--json", str(out_json), "--no-progress", "--no-cost-curve",
    ])
    args.model = tiny_llama
    assert bench.run(args) == 1
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
    assert bench.run(args) == 2
    assert needle in capsys.readouterr().err


def test_run_reports_a_bad_workload_with_line_numbers(tmp_path, tiny_llama, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": "a", "kind": "open", "prompt": "w3", "max_new_tokens": 4}\n{"id": "a"}\n')
    args = parse(["--workload", str(path)])
    args.model = tiny_llama
    assert bench.run(args) == 2
    err = capsys.readouterr().err
    assert "line 2: missing 'kind'" in err and "line 2: duplicate id 'a' (first on line 1)" in err


def test_run_reports_items_that_do_not_fit_the_model(tmp_path, tiny_llama, capsys):
    path = tmp_path / "long.jsonl"
    long_prompt = " ".join(["w3"] * 250)  # the tiny model's context is 256 tokens
    path.write_text(json.dumps({"id": "long", "kind": "open", "prompt": long_prompt, "max_new_tokens": 10}) + "\n")
    args = parse(["--workload", str(path), "--no-progress"])
    args.model = tiny_llama
    assert bench.run(args) == 2
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
    assert bench.run(args) == 0
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
    runner = bench.EngineRunner("draftmesh:fake", tiny_llama, ["fake"])
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
    plain = bench.EngineRunner("plain", tiny_llama, [])
    fake = bench.EngineRunner("draftmesh:fake", tiny_llama, ["fake"])
    items = prepared(tiny_llama, n=2, max_new_tokens=4)
    bench.execute([plain, fake], items, repeats=2, progress=False)
    # one source for the warm-up, then one per repeat, each seeing only its own pass
    assert [s.finished for s in FakeSource.instances] == [["i0"], ["i0", "i1"], ["i0", "i1"]]


def test_policy_methods_parse_and_are_marked_lossy():
    from draftmesh.bench import parse_methods

    methods = {m.name: m for m in parse_methods("draftmesh+typical,draftmesh:history+block,draftmesh", available=["history"], defaults=["history"])}
    assert methods["draftmesh+typical"].policy == "typical" and not methods["draftmesh+typical"].lossless
    assert methods["draftmesh:history+block"].sources == ("history",)
    assert methods["draftmesh"].lossless
    with pytest.raises(ValueError, match="unknown acceptance policy 'yolo'"):
        parse_methods("draftmesh+yolo", available=["history"], defaults=["history"])
    with pytest.raises(ValueError, match="draftmesh methods only"):
        parse_methods("hf+typical", available=["history"], defaults=["history"])


def test_edit_distance_and_fidelity():
    from draftmesh.bench import ItemResult, ItemRun, edit_distance, measure_fidelity

    assert edit_distance([1, 2, 3], [1, 2, 3]) == 0
    assert edit_distance([1, 2, 3], [1, 3]) == 1
    assert edit_distance([], [4, 5]) == 2
    plain = ItemResult("a", "k", "plain", runs=[ItemRun("a", "k", "plain", [1, 2, 3, 4], 1.0)])
    lossy = ItemResult("a", "k", "draftmesh+typical", lossless=False,
                       runs=[ItemRun("a", "k", "draftmesh+typical", [1, 2, 9, 4], 0.5)])
    measure_fidelity([plain, lossy])
    assert lossy.same_as_plain is False and lossy.edit_distance == pytest.approx(0.25)
    assert plain.same_as_plain is None
