"""`draftmesh bench --concurrency`: the closed-loop load test end to end on a tiny model."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import pytest
from bench_args import parse, workload_file
from tiny_models import tiny_target

from draftmesh.bench.concurrency import mesh_ratios, run_pass, same_run_ratio_lines, same_run_ratios
from draftmesh.bench.run import run

ROOT = Path(__file__).resolve().parents[2]


def test_concurrency_run_reports_every_level_and_method(tmp_path, capsys):
    target = tiny_target("llama", vocab_size=64, dtype=__import__("torch").float32)
    out_json, out_png = tmp_path / "c.json", tmp_path / "c.png"
    args = parse(["--workload", str(workload_file(tmp_path, n=6, max_new_tokens=12)), "--concurrency", "1,3",
                  "--repeats", "1", "--threads", "1", "--json", str(out_json), "--plot", str(out_png),
                  "--prefill-probe-tokens", "120", "--no-progress"])
    args.model = target
    assert run(args) == 0  # every output identical to batch-1 plain (exit 1 otherwise)
    printed = capsys.readouterr().out
    assert "Concurrency (closed loop" in printed and "Prefill probe" in printed
    data = json.loads(out_json.read_text())
    rows = {(r["method"], r["concurrency"]): r for r in data["rows"]}
    assert set(rows) == {(m, c) for m in ("plain-serial", "plain", "draftmesh") for c in (1, 3)}
    for r in rows.values():
        assert r["outputs"] == 6 and r["identical_to_plain_serial"] == 6 and r["tokens_per_s"] > 0
    for r in rows.values():  # a step's time holds its forward's; the steps, part of the pass's time
        assert r["step_ms"] >= r["forward_ms"] > 0
        assert 0 < r["busy_share"] <= 1
    assert "step ms" in printed and "fwd ms" in printed
    assert rows[("plain-serial", 3)]["mean_rows"] == 1.0  # one at a time, by construction
    assert rows[("plain", 3)]["mean_rows"] > 1.5  # batched: several requests per forward
    assert data["prefill_probe"]["ttft_alone_s"] > 0 and data["kv_bytes_per_token"] > 0
    gain = data["same_run_ratios"]["draftmesh / plain"]  # speculation's gain, each C, from this run's passes
    for c in (1, 3):
        assert gain[str(c)]["ratio"] == pytest.approx(
            rows[("draftmesh", c)]["tokens_per_s"] / rows[("plain", c)]["tokens_per_s"], rel=1e-2)
    assert "draftmesh / plain (same run): " in printed
    for r in rows.values():  # 6 items outnumber C: a window while C were in flight
        assert r["steady_tokens_per_s"] > 0
    steady = data["steady_same_run_ratios"]["draftmesh / plain"]
    assert set(steady) == {"1", "3"} and "draftmesh / plain (same run, C in flight): " in printed
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_concurrency_usage_errors_are_clean(tmp_path, capsys):
    """--target mesh needs no --methods with --concurrency (the mesh methods come with it); a mesh
    that does not answer, or an unknown method, is an exit 2 naming it, not a traceback."""
    from draftmesh.net import free_port

    target = tiny_target("llama", vocab_size=64, dtype=__import__("torch").float32)
    common = ["--workload", str(workload_file(tmp_path, n=2, max_new_tokens=4)), "--concurrency", "1",
              "--repeats", "1", "--threads", "1", "--prefill-probe-tokens", "0", "--no-progress"]
    dead = f"127.0.0.1:{free_port()}"
    args = parse([*common, "--target", "mesh", "--addr", dead, "--api-key", "k"])
    args.model = target
    assert run(args) == 2
    err = capsys.readouterr().err
    assert f"the mesh at {dead} answered UNAVAILABLE" in err and "Traceback" not in err
    args = parse([*common, "--methods", "plain,nope"])
    args.model = target
    assert run(args) == 2
    assert "unknown nope" in capsys.readouterr().err
    args = parse([*common, "--methods", "draftmesh-oracle,plain"])  # nothing for the oracle to read yet
    args.model = target
    assert run(args) == 2
    assert "draftmesh-oracle reads each item's plain greedy output" in capsys.readouterr().err
    args = parse([*common, "--kinds", "grounded,rag"])
    args.model = target
    assert run(args) == 2
    assert "--kinds: no item of kind rag in the workload; its kinds: grounded, open" in capsys.readouterr().err


def test_concurrency_kinds_runs_only_those_items(tmp_path, capsys):
    target = tiny_target("llama", vocab_size=64, dtype=__import__("torch").float32)
    out_json = tmp_path / "c.json"
    args = parse(["--workload", str(workload_file(tmp_path, n=5, max_new_tokens=6)), "--concurrency", "2",
                  "--kinds", "grounded", "--methods", "plain-serial,plain", "--repeats", "1", "--threads", "1",
                  "--json", str(out_json), "--prefill-probe-tokens", "0", "--no-progress"])
    args.model = target
    assert run(args) == 0
    assert "3 items" in capsys.readouterr().out  # items 0, 2 and 4 of the file are grounded
    data = json.loads(out_json.read_text())
    assert data["meta"]["workload"]["items"] == 3
    assert all(r["outputs"] == 3 == r["identical_to_plain_serial"] for r in data["rows"])


def test_mesh_ratios_pair_each_mesh_method_with_its_in_process_twin():
    rows = [{"method": m, "concurrency": c, "tokens_per_s": v} for m, c, v in [
        ("plain-serial", 1, 30.0), ("draftmesh", 1, 40.0), ("mesh:draftmesh", 1, 36.0), ("mesh:plain", 1, 25.0),
        ("draftmesh", 8, 100.0), ("mesh:draftmesh", 8, 95.0), ("mesh:plain", 8, 70.0)]]
    # mesh:plain has no in-process plain here: no ratio for it rather than one against another method
    assert mesh_ratios(rows) == {"mesh:draftmesh": {1: 0.9, 8: 0.95}}
    assert same_run_ratio_lines(rows) == ["", "mesh:draftmesh / draftmesh (same run): 0.90x at C=1, 0.95x at C=8"]
    assert same_run_ratio_lines(rows[:2]) == []


def test_same_run_ratios_pair_the_passes_of_each_repeat():
    """The box drifts between repeats: each repeat's draftmesh pass is set against that repeat's plain
    pass, and the median of those ratios is the figure (here 1.15x, where the ratio of the medians, 104
    over 100 tok/s, reads 1.04x)."""
    rows = [{"method": m, "concurrency": 2, "tokens_per_s": statistics.median(runs), "tokens_per_s_runs": runs}
            for m, runs in (("plain", [100.0, 80.0, 120.0]), ("draftmesh", [104.0, 96.0, 138.0]))]
    got = same_run_ratios(rows)[("draftmesh", "plain")][2]
    assert got["runs"] == pytest.approx([1.04, 1.2, 1.15])
    assert got["ratio"] == pytest.approx(1.15)
    assert same_run_ratio_lines(rows) == [
        "", "draftmesh / plain (same run, median of the repeats' paired ratios): 1.15x at C=2 (1.04, 1.20, 1.15)"]


@pytest.mark.slow
def test_concurrency_through_the_mesh(mesh, tmp_path, capsys):
    """--target mesh: plain and draftmesh through the gRPC face of the session's mesh, plain-serial
    in-process as the reference; every output identical to it."""
    from served_mesh import API_KEY

    out_json = tmp_path / "c.json"
    args = parse(["--workload", str(ROOT / "bench" / "public.jsonl"), "--target", "mesh", "--addr", mesh.address,
                  "--api-key", API_KEY, "--concurrency", "1,2", "--limit", "2", "--max-new-tokens", "12",
                  "--methods", "plain-serial,draftmesh",
                  "--repeats", "1", "--threads", "2", "--json", str(out_json), "--prefill-probe-tokens", "0",
                  "--no-progress"])
    code = run(args)
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "through the mesh's gRPC face" in printed
    data = json.loads(out_json.read_text())
    # the in-process draftmesh named in --methods runs in the same run, beside its mesh twin
    assert data["target"] == "mesh"
    assert data["methods"] == ["plain-serial", "draftmesh", "mesh:plain", "mesh:draftmesh"]
    assert set(data["mesh_vs_local"]) == {"mesh:draftmesh"}
    assert set(data["mesh_vs_local"]["mesh:draftmesh"]) == {"1", "2"}
    assert "mesh:draftmesh / draftmesh (same run): " in printed
    rows = {(r["method"], r["concurrency"]): r for r in data["rows"]}
    assert set(rows) == {(m, c) for m in data["methods"] for c in (1, 2)}
    for r in rows.values():
        assert r["outputs"] == 2 and r["identical_to_plain_serial"] == 2 and r["tokens_per_s"] > 0
        assert r["latency_p95_s"] >= r["latency_p50_s"] > 0 and r["ttft_p50_s"] > 0
    # a mesh the bench did not start: its batch counters are not visible, and say so (None), not 0
    assert rows[("mesh:plain", 2)]["mean_rows"] is None and rows[("plain-serial", 2)]["mean_rows"] == 1.0
    assert rows[("mesh:plain", 2)]["step_ms"] is None and rows[("draftmesh", 2)]["step_ms"] > 0
    assert rows[("mesh:plain", 2)]["busy_share"] is None


@pytest.mark.parametrize("deadline_ms, want", [(0, None), (250, 0.25)])
def test_the_config_files_source_deadline_reaches_every_decoder_the_bench_builds(tmp_path, monkeypatch, deadline_ms, want):
    """``sources.deadline_ms`` from ``--config`` (0: the sources called inline) holds for the concurrency
    passes' decoders and the single-stream runners' alike; the bench built them with the default
    100 ms whatever the config said."""
    import draftmesh.bench.concurrency as concurrency
    import draftmesh.bench.runners as runners

    built = []
    for module in (concurrency, runners):
        real = module.build_decoder

        def recording(*args, _real=real, **kwargs):
            decoder = _real(*args, **kwargs)
            built.append(decoder.caller.deadline_s)
            return decoder

        monkeypatch.setattr(module, "build_decoder", recording)
    config = tmp_path / "bench.yaml"
    config.write_text(f"sources:\n  deadline_ms: {deadline_ms}\n")
    target = tiny_target("llama", vocab_size=64, dtype=__import__("torch").float32)
    workload = str(workload_file(tmp_path, n=2, max_new_tokens=4))
    for extra in (["--concurrency", "2", "--prefill-probe-tokens", "0"], ["--methods", "plain,draftmesh"]):
        args = parse(["--workload", workload, "--config", str(config), "--repeats", "1", "--threads", "1",
                      "--no-cost-curve", "--no-progress", *extra])
        args.model = target
        assert run(args) == 0
    assert len(built) >= 4 and set(built) == {want}


def test_without_plain_serial_outputs_are_not_compared_rather_than_shown_as_none_identical(tmp_path, capsys):
    """`--methods plain,draftmesh` runs no reference: the report said 0/N identical, which reads as every
    output wrong. Now the JSON holds null and the "same" column "-", and the run still exits 0."""
    target = tiny_target("llama", vocab_size=64, dtype=__import__("torch").float32)
    out_json = tmp_path / "c.json"
    args = parse(["--workload", str(workload_file(tmp_path, n=3, max_new_tokens=6)), "--concurrency", "2",
                  "--methods", "plain,draftmesh", "--repeats", "1", "--threads", "1", "--json", str(out_json),
                  "--prefill-probe-tokens", "0", "--no-cost-curve", "--no-progress"])
    args.model = target
    assert run(args) == 0
    rows = json.loads(out_json.read_text())["rows"]
    assert {r["method"] for r in rows} == {"plain", "draftmesh"}
    assert all(r["identical_to_plain_serial"] is None and r["outputs"] == 3 for r in rows)
    table = [line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("2 ")]
    assert len(table) == 2 and all(line.rstrip().endswith("-/3") for line in table), table


def test_the_oracle_runs_beside_draftmesh_and_reports_its_ratio_to_plain(tmp_path, capsys):
    """``draftmesh-oracle`` after plain-serial: its outputs are plain greedy's, and the report sets it
    against batched plain as it does draftmesh."""
    target = tiny_target("llama", vocab_size=64, dtype=__import__("torch").float32)
    out_json = tmp_path / "c.json"
    args = parse(["--workload", str(workload_file(tmp_path, n=3, max_new_tokens=8)), "--concurrency", "1,2",
                  "--methods", "plain-serial,plain,draftmesh,draftmesh-oracle", "--repeats", "1", "--threads", "1",
                  "--json", str(out_json), "--prefill-probe-tokens", "0", "--no-cost-curve", "--no-progress"])
    args.model = target
    assert run(args) == 0
    data = json.loads(out_json.read_text())
    oracle = [r for r in data["rows"] if r["method"] == "draftmesh-oracle"]
    assert len(oracle) == 2 and all(r["identical_to_plain_serial"] == r["outputs"] == 3 for r in oracle)
    assert set(data["same_run_ratios"]["draftmesh-oracle / plain"]) == {"1", "2"}
    assert "draftmesh-oracle / plain (same run): " in capsys.readouterr().out


class _Steps:
    """A load whose every request emits 4 tokens in one step."""

    def warm(self, item):
        pass

    def batch_stats(self):
        return None

    def stream(self, item):
        yield "step", 4
        yield "result", (0, 1, 2, 3)


class _ScriptedLoad(_Steps):
    """A load whose requests emit in a set order: ``a`` emits 5 tokens, then waits for ``c`` to end
    and emits its last 7 a while later; ``b`` emits 2 once ``a`` has, then ends, so its client
    starts ``c``, the last item, which emits 3 and ends: that client then finds no item left."""

    def __init__(self):
        import threading

        self.a_emitted, self.c_done = threading.Event(), threading.Event()

    def stream(self, item):
        if item.id == "a":
            yield "step", 5
            self.a_emitted.set()
            assert self.c_done.wait(10)
            time.sleep(0.5)  # c's client finds the queue empty in microseconds: well before this
            yield "step", 7
            yield "result", tuple(range(12))
        elif item.id == "b":
            assert self.a_emitted.wait(10)
            yield "step", 2
            yield "result", (0, 1)
        else:
            yield "step", 3
            yield "result", (0, 1, 2)
            self.c_done.set()


def test_the_steady_window_ends_when_fewer_than_c_are_in_flight():
    from types import SimpleNamespace as NS

    items = [NS(id=i) for i in "abc"]
    res = run_pass(_ScriptedLoad(), "x", items, 2)
    assert res.tokens == 17 and res.steady_tokens == 10  # all but a's last 7, emitted after c's client left
    assert 0 < res.steady_seconds < res.seconds
    assert res.steady_tokens_per_s == pytest.approx(10 / res.steady_seconds)
    alone = run_pass(_Steps(), "x", items, 1)  # one client: C=1 in flight until the end
    assert alone.steady_tokens == alone.tokens == 12
    assert run_pass(_Steps(), "x", items, 4).steady_tokens_per_s is None  # never four in flight
