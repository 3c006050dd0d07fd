"""`draftmesh bench --concurrency`: the closed-loop load test end to end on a tiny model."""

from __future__ import annotations

import json

from bench_args import parse, workload_file
from tiny_models import tiny_target

from draftmesh.bench.run import run


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
    assert rows[("plain-serial", 3)]["mean_rows"] == 1.0  # one at a time, by construction
    assert rows[("plain", 3)]["mean_rows"] > 1.5  # batched: several requests per forward
    assert data["prefill_probe"]["ttft_alone_s"] > 0 and data["kv_bytes_per_token"] > 0
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
