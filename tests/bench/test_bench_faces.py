"""`draftmesh bench --target mesh --api openai`: the faces' pass order, the summary's maths, the HTTP
request the bench sends, the flags' checks, and an end-to-end run through both faces of the session's
served mesh (tests/served_mesh.py) with the real ``openai`` client."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from bench_args import parse, workload_file

from draftmesh.bench.cli import EXIT_USAGE
from draftmesh.bench.faces import faces_report, format_faces, pass_order, plot_faces, summarize_faces
from draftmesh.bench.items import ItemRun, PreparedItem
from draftmesh.bench.openai_runner import OpenAIRunner
from draftmesh.bench.run import run
from draftmesh.bench.workload import WorkItem

ROOT = Path(__file__).resolve().parents[2]


def test_faces_alternate_pass_by_pass_abba():
    assert pass_order(1) == ["grpc", "http"]
    assert pass_order(3) == ["grpc", "http", "http", "grpc", "grpc", "http"]


def item(i: str, **kw) -> PreparedItem:
    return PreparedItem(WorkItem(i, "k", 8, **kw), (1, 2, 3), 8)


def fake(face: str, item_id: str, n: int, seconds: float, text: str, first: float = 0.1) -> ItemRun:
    if face == "http":  # the HTTP face reports a count, not ids
        return ItemRun(item_id, "k", "mesh:draftmesh", [], seconds, text=text, first_token_s=first, completion_tokens=n)
    return ItemRun(item_id, "k", "mesh:draftmesh", list(range(n)), seconds, text=text, first_token_s=first)


def test_summary_ratio_identical_and_mismatches():
    items = [item("a", prompt="x"), item("b", prompt="y")]
    m = "mesh:draftmesh"
    runs = {
        (m, "grpc", "a"): [fake("grpc", "a", 20, 1.0, "A"), fake("grpc", "a", 20, 3.0, "A")],  # median 2.0
        (m, "grpc", "b"): [fake("grpc", "b", 10, 1.0, "B")],
        (m, "http", "a"): [fake("http", "a", 20, 2.5, "A", 0.3)],
        (m, "http", "b"): [fake("http", "b", 10, 0.5, "B!", 0.2)],  # a different text: a mismatch
    }
    s = summarize_faces(runs, items)[m]
    assert s["faces"]["grpc"] == {"tokens": 30, "seconds": 3.0, "tokens_per_s": 10.0, "first_token_ms": 100.0}
    assert s["faces"]["http"]["tokens_per_s"] == pytest.approx(10.0) and s["faces"]["http"]["first_token_ms"] == 250.0
    assert s["http_over_grpc"] == pytest.approx(1.0) and s["within_target"] is True
    # per item: a (20/2.5)/(20/2.0) = 0.8, b (10/0.5)/(10/1.0) = 2
    assert s["http_over_grpc_item_geomean"] == pytest.approx(math.sqrt(1.6), abs=1e-4)
    assert s["identical"] == 1 and [x["item"] for x in s["mismatches"]] == ["b"]
    report = faces_report(runs, items, 1, None)
    assert report["passes"] == ["grpc", "http"] and len(report["items"]) == 4
    text = format_faces(report)
    assert "1/2" in text and "MISMATCH mesh:draftmesh item b" in text
    # slower HTTP beyond 5%: not within the target
    runs[(m, "http", "a")] = [fake("http", "a", 20, 4.0, "A")]
    assert summarize_faces(runs, items)[m]["within_target"] is False


def test_plot_is_written(tmp_path):
    items = [item("a", prompt="x")]
    m = "mesh:plain"
    runs = {(m, "grpc", "a"): [fake("grpc", "a", 5, 1.0, "t")], (m, "http", "a"): [fake("http", "a", 5, 1.1, "t")]}
    path = tmp_path / "faces.png"
    plot_faces(faces_report(runs, items, 1, None), str(path))
    assert path.stat().st_size > 1000


def test_the_http_request_is_the_grpc_request():
    runner = OpenAIRunner("mesh:plain", "http://127.0.0.1:1/v1", model="m", speculate=False, session_suffix="#p")
    try:
        endpoint, kw = runner.body(item("a", messages=({"role": "user", "content": "hi"},), corpus=("d0", "d1"),
                                        session="s"))
        assert endpoint == "chat" and kw["messages"] == [{"role": "user", "content": "hi"}]
        assert kw["max_tokens"] == 8 and kw["stream"] is True and kw["stream_options"] == {"include_usage": True}
        assert kw["extra_body"] == {"documents": [{"id": "0", "text": "d0"}, {"id": "1", "text": "d1"}],
                                    "session_id": "s#p", "speculation": {"enabled": False}}
        assert "temperature" not in kw  # greedy: the server's default on both faces
    finally:
        runner.close()
    spec = OpenAIRunner("mesh:draftmesh", "http://127.0.0.1:1/v1", model="m")
    endpoint, kw = spec.body(item("b", prompt="The capital of France is"))
    assert endpoint == "completions" and kw["prompt"] == "The capital of France is" and kw["extra_body"] is None
    spec.close()


@pytest.mark.parametrize("extra, message", [
    (["--api", "openai"], "--api openai compares the faces of a mesh: add --target mesh"),
    (["--target", "mesh", "--http-addr", "h:1"], "--http-addr applies to --api openai"),
    (["--target", "mesh", "--api", "openai", "--addr", "h:1"], "--api openai with --addr needs --http-addr"),
])
def test_flag_mistakes_are_usage_errors(tmp_path, capsys, extra, message):
    assert run(parse(["--workload", str(workload_file(tmp_path)), *extra])) == EXIT_USAGE
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_bench_api_openai_through_both_faces_of_the_mesh(mesh, tmp_path, capsys):
    from served_mesh import API_KEY

    out_json, out_png = tmp_path / "faces.json", tmp_path / "faces.png"
    code = run(parse([
        "--workload", str(ROOT / "bench" / "public.jsonl"), "--target", "mesh", "--api", "openai",
        "--methods", "mesh:draftmesh,mesh:plain", "--addr", mesh.address, "--http-addr", mesh.http_address,
        "--api-key", API_KEY, "--limit", "2", "--repeats", "1", "--max-new-tokens", "12", "--threads", "2",
        "--no-progress", "--json", str(out_json), "--plot", str(out_png),
    ]))
    stdout = capsys.readouterr().out
    assert code == 0, stdout
    assert "HTTP/gRPC" in stdout and out_png.stat().st_size > 1000
    data = json.loads(out_json.read_text())
    assert data["mode"] == "faces" and data["passes"] == ["grpc", "http"]
    assert data["mesh"]["http_address"] == mesh.http_address
    assert set(data["summary"]) == {"mesh:draftmesh", "mesh:plain"}
    for s in data["summary"].values():
        assert s["items"] == 2 and s["identical"] == 2 and not s["mismatches"]  # greedy: the same text on both faces
        for face in ("grpc", "http"):
            assert s["faces"][face]["tokens"] > 0 and s["faces"][face]["tokens_per_s"] > 0
            assert s["faces"][face]["first_token_ms"] > 0
        assert s["http_over_grpc"] > 0
    assert len(data["items"]) == 2 * 2 * 2  # items x methods x faces
    assert all(len(rec["runs"]) == 1 and rec["runs"][0]["tokens"] > 0 for rec in data["items"])
