"""The bench's vllm method with the real vLLM (``make vllm-env``; `make test` builds it, so CI runs
this on every clean clone) on the packaged SmolLM2, beside our plain greedy on the same items.

vLLM runs eager here (``--vllm-eager``): compiling its model takes ~1.5 min of a 2-core CI box per
start, and these tests check the runner and the agreement, not vLLM's speed. The bench's figures
use vLLM's default, compiled mode."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftmesh.bench.vllm_runner import VLLMError, find_vllm_python

REPO = Path(__file__).resolve().parents[2]
NEAR_TIE = 0.05
"""Logit gap below which two fp32 implementations may pick different argmaxes (kernels round
differently, ~1e-4 typically): a divergence above it would mean they do not run the same model."""


@pytest.fixture(scope="module")
def vllm_python():
    try:
        return find_vllm_python(root=REPO)
    except VLLMError as exc:
        pytest.skip(f"{exc} (make test builds it)")


@pytest.mark.slow
def test_vllm_decodes_the_packaged_model_like_our_plain(tmp_path, vllm_python, capsys):
    from bench_args import parse

    from draftmesh.bench.run import run

    items = [json.loads(line) for line in (REPO / "bench" / "public.jsonl").read_text().splitlines() if line.strip()]
    workload = tmp_path / "w.jsonl"
    workload.write_text("".join(json.dumps({**it, "max_new_tokens": 24}) + "\n" for it in items[:2]))
    out = tmp_path / "out.json"
    args = parse(["--workload", str(workload), "--methods", "plain,vllm", "--repeats", "1", "--threads", "2",
                  "--json", str(out), "--no-progress", "--no-cost-curve", "--vllm-python", str(vllm_python),
                  "--vllm-eager"])
    code = run(args)
    printed = capsys.readouterr()
    assert code == 0, printed.err[-3000:]
    data = json.loads(out.read_text())
    rows = data["other_engines"]["agreement"]
    assert len(rows) == 2
    vllm = {r["id"]: r for r in data["items"] if r["method"] == "vllm"}
    for row in rows:
        assert vllm[row["id"]]["new_tokens"] > 0 and vllm[row["id"]]["tokens_per_s"] > 0
        if row["identical_to_plain"] is False:  # allowed only at a near-tie of our own logits
            assert row["plain_top2_gap"] is not None and row["plain_top2_gap"] < NEAR_TIE, row
    print({r["id"]: (r["identical_to_plain"], r["first_difference"], r["plain_top2_gap"]) for r in rows})
    engines = data["startup"]["engines"]
    assert engines["vllm"]["engine"].startswith("vllm 0.") and engines["vllm"]["engine"].endswith("(eager)")
    assert engines["plain"]["engine"] == "draftmesh (plain)"
    for s in engines.values():
        assert s["ready_s"] > 0 and s["first_result_s"] > s["ready_s"] and s["rss_mb"] > 100, s
    assert "vllm vs plain greedy:" in printed.out and "cold start and memory" in printed.out


@pytest.mark.slow
def test_vllm_in_the_concurrency_bench_keeps_c_requests_in_flight(tmp_path, vllm_python, capsys):
    """``--concurrency --methods plain-serial,vllm``: vLLM's closed loop runs beside ours, every item
    answered at every C, its outputs compared with plain-serial (agreement shown, not required)."""
    from bench_args import parse

    from draftmesh.bench.run import run

    out = tmp_path / "c.json"
    args = parse(["--workload", str(REPO / "bench" / "public.jsonl"), "--limit", "3", "--max-new-tokens", "12",
                  "--concurrency", "1,3", "--methods", "plain-serial,vllm", "--prefill-probe-tokens", "0", "--repeats", "1",
                  "--threads", "2", "--json", str(out), "--no-progress", "--vllm-python", str(vllm_python),
                  "--vllm-eager"])
    code = run(args)
    printed = capsys.readouterr()
    assert code == 0, printed.err[-3000:]
    rows = {(r["method"], r["concurrency"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {("plain-serial", 1), ("vllm", 1), ("plain-serial", 3), ("vllm", 3)}
    for c in (1, 3):
        v = rows[("vllm", c)]
        assert v["outputs"] == 3 and v["tokens_per_s"] > 0 and 0 < v["ttft_p50_s"] <= v["latency_p50_s"], v
        assert v["mean_rows"] is None  # vLLM's batch statistics are not ours to report
    print({c: (rows[("vllm", c)]["identical_to_plain_serial"], rows[("vllm", c)]["tokens_per_s"]) for c in (1, 3)})
    assert " vllm " in printed.out and "vllm ran eager" in printed.out
    assert json.loads(out.read_text())["meta"]["vllm_eager"] is True
