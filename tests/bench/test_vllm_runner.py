"""The bench's vllm method without vLLM: the worker protocol (start, requests, errors, time-outs,
clean-up of the whole process group) against fake worker processes, and a whole `draftmesh
bench` run whose "vLLM" is transformers greedy behind the same protocol (fake_vllm_worker.py),
so agreement, a reported difference and the cold-start table are checked end to end. The real
vLLM run is in test_vllm_real.py."""

from __future__ import annotations

import json
import os
import stat
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from draftmesh.bench.items import PreparedItem
from draftmesh.bench.methods import parse_methods
from draftmesh.bench.vllm_runner import (
    SPECULATIVE_CONFIGS,
    VLLM_PYTHON_ENV,
    VLLMError,
    VLLMRunner,
    find_vllm_python,
    max_model_len,
    preloads,
    worker_command,
    worker_environment,
)
from draftmesh.bench.worker_process import WorkerError, WorkerProcess
from draftmesh.bench.workload import WorkItem

HERE = Path(__file__).parent


def script(tmp_path, body: str) -> list[str]:
    path = tmp_path / "worker.py"
    path.write_text(textwrap.dedent(body))
    return [sys.executable, str(path)]


ECHO = """
    import json, os, sys
    out = os.fdopen(os.dup(1), "w", buffering=1); os.dup2(2, 1)
    print("library noise on stdout")  # must not reach the protocol
    out.write(json.dumps({"event": "ready", "load_s": 0.0, "pid": os.getpid()}) + "\\n")
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["op"] == "exit":
            break
        toks = [t + 1 for t in msg["prompt_ids"]][: msg["max_new_tokens"]]
        out.write(json.dumps({"event": "result", "id": msg["id"], "token_ids": toks, "seconds": 0.25}) + "\\n")
"""


def item(item_id="a", prompt=(5, 6, 7), n=3) -> PreparedItem:
    return PreparedItem(WorkItem(id=item_id, kind="k", prompt="p", max_new_tokens=n), tuple(prompt), n)


def test_a_worker_answers_requests_over_its_own_channel(tmp_path):
    with WorkerProcess(script(tmp_path, ECHO), name="echo") as w:
        assert w.ready["event"] == "ready" and w.ready_s > 0 and w.first_result_s is None
        time.sleep(1.0)  # idle between ready and the first request: not part of the cold start
        sent = time.perf_counter()
        got = w.generate("r1", [1, 2, 3], 2)
        took = time.perf_counter() - sent
        assert got["token_ids"] == [2, 3] and got["seconds"] == 0.25
        assert w.ready_s <= w.first_result_s <= w.ready_s + took
        assert w.generate("r2", [9], 5)["token_ids"] == [10]
        mem = w.memory()
        assert mem["processes"] == 1 and mem["rss_mb"] > 1
        pid = w.pid
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_worker_that_dies_at_start_says_why(tmp_path):
    cmd = script(tmp_path, """
        import sys
        print("cannot load the model: out of cheese", file=sys.stderr)
        sys.exit(3)
    """)
    with pytest.raises(WorkerError, match=r"(?s)exited with status 3 before 'ready'.*out of cheese"):
        WorkerProcess(cmd, name="w")


def test_a_worker_that_writes_garbage_or_nothing_fails_in_time(tmp_path):
    garbage = script(tmp_path, """
        import time
        print("INFO starting up", flush=True)
        time.sleep(60)
    """)
    with pytest.raises(WorkerError, match="not JSON"):
        WorkerProcess(garbage, name="w")
    (tmp_path / "worker.py").unlink()
    silent = script(tmp_path, "import time\ntime.sleep(60)\n")
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=r"no 'ready' within 1 s"):
        WorkerProcess(silent, name="w", start_timeout_s=1)
    assert time.monotonic() - t0 < 15


def test_a_missing_program_is_a_worker_error(tmp_path):
    with pytest.raises(WorkerError, match="cannot start"):
        WorkerProcess([str(tmp_path / "no-such-python")], name="w")


def test_a_request_that_hangs_times_out_and_close_kills_the_group(tmp_path):
    cmd = script(tmp_path, """
        import json, os, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
        out = os.fdopen(os.dup(1), "w", buffering=1); os.dup2(2, 1)
        out.write(json.dumps({"event": "ready", "child": child.pid}) + "\\n")
        for line in sys.stdin:
            time.sleep(300)  # never answers, ignores exit
    """)
    w = WorkerProcess(cmd, name="w", request_timeout_s=1)
    child = w.ready["child"]
    assert w.memory()["processes"] == 2
    with pytest.raises(WorkerError, match=r"no 'result' within 1 s \(request 'r'\)"):
        w.generate("r", [1], 1)
    t0 = time.monotonic()
    w.close(timeout_s=1)
    assert time.monotonic() - t0 < 10
    for pid in (w.pid, child):
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_an_error_answer_fails_that_request_only(tmp_path):
    cmd = script(tmp_path, """
        import json, os, sys
        out = os.fdopen(os.dup(1), "w", buffering=1); os.dup2(2, 1)
        out.write(json.dumps({"event": "ready"}) + "\\n")
        for line in sys.stdin:
            msg = json.loads(line)
            if msg["op"] == "exit":
                break
            if msg["id"] == "bad":
                out.write(json.dumps({"event": "error", "id": "bad", "message": "ValueError: too long"}) + "\\n")
            else:
                out.write(json.dumps({"event": "result", "id": msg["id"], "token_ids": [4], "seconds": 0.1}) + "\\n")
    """)
    with WorkerProcess(cmd, name="w") as w:
        with pytest.raises(WorkerError, match="request 'bad': ValueError: too long"):
            w.generate("bad", [1], 1)
        assert w.generate("good", [1], 1)["token_ids"] == [4]


def test_the_runner_stops_at_eos_and_takes_the_workers_time(tmp_path):
    with WorkerProcess(script(tmp_path, ECHO), name="echo") as w:
        runner = VLLMRunner("vllm", w, eos_token_ids=[7])
        assert runner.other_engine and runner.startup is None
        run = runner.run(item(prompt=(3, 6, 9, 12), n=4))  # echo: 4 7 10 13 -> cut after the EOS 7
        assert run.token_ids == [4, 7] and run.seconds == 0.25 and run.prompt_tokens == 4
        assert runner.startup["ready_s"] > 0 and runner.startup["rss_mb"] > 1
        assert runner.startup["first_result_s"] >= runner.startup["ready_s"]
        w.close()
        with pytest.raises(VLLMError, match="cannot send request|exited"):
            runner.run(item())


def test_find_vllm_python_says_how_to_make_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(VLLM_PYTHON_ENV, raising=False)
    with pytest.raises(VLLMError, match=r"make vllm-env.*\.venv-vllm"):
        find_vllm_python(root=tmp_path)
    py = tmp_path / ".venv-vllm" / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text("")
    assert find_vllm_python(root=tmp_path) == py
    monkeypatch.setenv(VLLM_PYTHON_ENV, str(tmp_path / "elsewhere"))
    with pytest.raises(VLLMError, match=r"elsewhere does not exist.*--vllm-python"):
        find_vllm_python(root=tmp_path)
    assert find_vllm_python(str(py)) == py


def test_the_workers_environment_is_offline_bounded_and_pinned_to_the_threads():
    env = worker_environment(1, kv_cache_gib=2, base={"PYTHONPATH": "/x", "PATH": "/bin"})
    assert env["HF_HUB_OFFLINE"] == "1" and env["VLLM_NO_USAGE_STATS"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["OMP_NUM_THREADS"] == "1" and len(env["VLLM_CPU_OMP_THREADS_BIND"].split(",")) == 1
    assert "PYTHONPATH" not in env and env["PATH"] == "/bin"
    every = worker_environment(0, base={})
    assert int(every["OMP_NUM_THREADS"]) == len(os.sched_getaffinity(0)) and "LD_PRELOAD" not in every
    kept = worker_environment(1, base={"LD_PRELOAD": "/mine.so"}, preload=["/a.so", "/b.so"])
    assert kept["LD_PRELOAD"] == "/a.so:/b.so:/mine.so"


def test_intel_openmp_is_preloaded_from_the_vllm_venv(tmp_path):
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    assert str(tmp_path) not in ":".join(preloads(python))
    (tmp_path / "venv" / "lib").mkdir()
    (tmp_path / "venv" / "lib" / "libiomp5.so").write_bytes(b"")
    assert preloads(python)[-1] == str(tmp_path / "venv" / "lib" / "libiomp5.so")


def test_each_vllm_method_gets_its_speculative_config():
    plain = worker_command(Path("/v/bin/python"), "/m", dtype="float32", max_model_len=512)
    assert plain[:2] == ["/v/bin/python", "-P"] and plain[2].endswith("vllm_worker.py")
    assert "--speculative-config" not in plain and plain[plain.index("--model") + 1] == "/m"
    ngram = worker_command(Path("/v/bin/python"), "/m", dtype="float32", max_model_len=512,
                           speculative_config=SPECULATIVE_CONFIGS["vllm-ngram"])
    assert json.loads(ngram[ngram.index("--speculative-config") + 1])["method"] == "ngram"
    assert SPECULATIVE_CONFIGS["vllm"] is None
    assert "--eager" not in plain
    assert worker_command(Path("/v/bin/python"), "/m", dtype="float32", max_model_len=512, eager=True)[-1] == "--eager"
    assert [m.family for m in parse_methods("vllm,vllm-ngram")] == ["engine", "vllm", "vllm"]


def test_max_model_len_fits_the_longest_item():
    items = [item(prompt=tuple(range(300)), n=64), item(prompt=(1,), n=8)]
    assert max_model_len(items, 8192) == 512
    assert max_model_len(items, 400) == 400


# ---------------------------------------------------------------------- a whole bench run
@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """The tiny random model saved as a model folder: both the bench and the fake vLLM load it."""
    from tiny_models import tiny_target

    folder = tmp_path_factory.mktemp("tiny-model")
    target = tiny_target("llama")
    target.model.save_pretrained(folder)
    target.tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def fake_vllm_python(tmp_path):
    """A "python" that runs fake_vllm_worker.py with the arguments the bench gives vLLM's Python."""
    path = tmp_path / "fake-vllm-python"
    path.write_text(f"#!/bin/sh\nexec {sys.executable} {HERE / 'fake_vllm_worker.py'} \"$@\"\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def bench(tmp_path, folder, python, capsys, methods="plain,vllm,draftmesh", extra=()):
    from bench_args import parse, workload_file

    from draftmesh.bench.run import run

    out = tmp_path / "out.json"
    args = parse(["--workload", str(workload_file(tmp_path, n=3, max_new_tokens=8)), "--methods", methods,
                  "--repeats", "1", "--threads", "1", "--json", str(out), "--no-progress", "--model", str(folder),
                  "--vllm-python", str(python), "--no-cost-curve", *extra])
    code = run(args)
    return code, capsys.readouterr(), (json.loads(out.read_text()) if out.exists() else None)


def test_bench_runs_vllm_beside_our_methods_and_reports_agreement_and_cold_starts(
    tmp_path, tiny_folder, fake_vllm_python, capsys
):
    code, printed, data = bench(tmp_path, tiny_folder, fake_vllm_python, capsys)
    assert code == 0, printed.err
    vllm = [r for r in data["items"] if r["method"] == "vllm"]
    assert len(vllm) == 3 and all(r["identical_to_plain"] is True and r["other_engine"] for r in vllm)
    assert all(r["new_tokens"] > 0 for r in vllm)
    assert "vllm vs plain greedy: 3/3 items token for token identical" in printed.out
    engines = data["startup"]["engines"]
    assert set(engines) == {"plain", "draftmesh", "vllm"}
    for name, s in engines.items():
        assert s["ready_s"] > 0 and s["first_result_s"] >= s["ready_s"] and s["rss_mb"] > 50, (name, s)
    assert engines["vllm"]["engine"] == "vllm fake"
    assert "cold start and memory" in printed.out


def test_a_difference_from_vllm_is_reported_with_the_gap_but_does_not_fail_the_run(
    tmp_path, tiny_folder, fake_vllm_python, capsys, monkeypatch
):
    monkeypatch.setenv("FAKE_VLLM_FLIP", "2")
    code, printed, data = bench(tmp_path, tiny_folder, fake_vllm_python, capsys, methods="plain,vllm,vllm-ngram",
                                extra=["--vllm-eager"])
    assert code == 0, printed.err
    rows = [r for r in data["other_engines"]["agreement"] if r["method"] == "vllm"]
    assert len(data["other_engines"]["agreement"]) == 6
    # an eager vLLM (no torch.compile) is labelled so, never read as vLLM's best
    assert data["startup"]["engines"]["vllm-ngram"]["engine"] == "vllm fake + ngram (eager)"
    assert data["startup"]["engines"]["vllm"]["engine"] == "vllm fake (eager)"
    assert len(rows) == 3 and all(r["identical_to_plain"] is False and r["first_difference"] == 2 for r in rows)
    assert all(r["plain_top2_gap"] is not None and r["plain_top2_gap"] >= 0 for r in rows)
    assert data["mismatches"] == []  # not a lossless violation
    assert "vllm vs plain greedy: 0/3 items" in printed.out and "first difference at token 2" in printed.out
    assert "OUTPUT MISMATCH" not in printed.out


@pytest.mark.parametrize("switch,needle", [("crash", "cannot load the model"), ("garbage", "not JSON")])
def test_a_vllm_that_cannot_start_is_a_clear_error(tmp_path, tiny_folder, fake_vllm_python, capsys, monkeypatch,
                                                   switch, needle):
    monkeypatch.setenv("FAKE_VLLM_START", switch)
    code, printed, _ = bench(tmp_path, tiny_folder, fake_vllm_python, capsys, methods="plain,vllm")
    assert code == 2 and "draftmesh bench: error: vllm:" in printed.err and needle in printed.err


def test_a_failed_vllm_request_stops_the_bench_with_its_message(tmp_path, tiny_folder, fake_vllm_python, capsys,
                                                               monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_FAIL_ID", "item-1")
    pids = tmp_path / "pids"
    monkeypatch.setenv("FAKE_VLLM_CHILD", str(pids))
    code, printed, _ = bench(tmp_path, tiny_folder, fake_vllm_python, capsys, methods="plain,vllm")
    assert code == 2 and "request 'item-1': ValueError: fake failure" in printed.err
    for pid in map(int, pids.read_text().split()):  # the worker and its child are gone with the run
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_vllm_without_its_environment_is_a_clear_error(tmp_path, tiny_folder, capsys):
    code, printed, _ = bench(tmp_path, tiny_folder, tmp_path / "nowhere" / "python", capsys, methods="plain,vllm")
    assert code == 2 and "needs vLLM's own environment" in printed.err


class _FakeEngine:
    """vLLM's ``LLMEngine`` surface the closed loop uses: each step gives every running request
    one token and finishes those that reached their max."""

    def __init__(self):
        self.running: dict[str, list] = {}
        self.peak = 0
        self.order: list[str] = []

    def add_request(self, rid, prompt, params):
        self.running[rid] = [params, []]
        self.order.append(rid)
        self.peak = max(self.peak, len(self.running))

    def has_unfinished_requests(self):
        return bool(self.running)

    def step(self):
        from types import SimpleNamespace as NS

        outs = []
        for rid, (max_tokens, toks) in list(self.running.items()):
            toks.append(len(toks))
            done = len(toks) >= max_tokens
            outs.append(NS(request_id=rid, finished=done,
                           outputs=[NS(token_ids=list(toks), finish_reason="length" if done else None)]))
            if done:
                del self.running[rid]
        return outs


@pytest.mark.parametrize("concurrency", [1, 2, 5])
def test_closed_loop_keeps_at_most_c_in_flight_and_answers_every_request(concurrency):
    from draftmesh.bench.vllm_worker import run_closed_loop

    engine = _FakeEngine()
    reqs = [{"id": f"r{i}", "max_new_tokens": 1 + i % 3} for i in range(5)]
    results, seconds, steady = run_closed_loop(engine, lambda r: r["max_new_tokens"], lambda r: None, reqs, concurrency)
    assert engine.peak == min(concurrency, 5) and engine.order == [r["id"] for r in reqs]
    got = {r["id"]: r for r in results}
    assert set(got) == {r["id"] for r in reqs} and seconds >= 0
    for r in reqs:
        assert len(got[r["id"]]["token_ids"]) == r["max_new_tokens"]
        assert 0 <= got[r["id"]]["ttft_s"] <= got[r["id"]]["latency_s"]


def test_closed_loop_counts_the_tokens_generated_while_c_were_in_flight():
    """Until the first step after which fewer than C were in flight (the bench's steady window): at
    C=2 over lengths 1, 2, 3, 1, 2 the last request, r4, is added when r3 ends (step 3), and r2 ends
    at step 4 with r4 one token in: 1 + 2 + 3 + 1 + 1 tokens. A stop token at the end of an output
    is not counted (the bench cuts it)."""
    from draftmesh.bench.vllm_worker import run_closed_loop

    reqs = [{"id": f"r{i}", "max_new_tokens": 1 + i % 3} for i in range(5)]
    _, seconds, steady = run_closed_loop(_FakeEngine(), lambda r: r["max_new_tokens"], lambda r: None, reqs, 2)
    assert steady["steady_tokens"] == 8 and 0 <= steady["steady_seconds"] <= seconds
    reqs[0]["stop_token_ids"] = [0]  # r0's one token is the fake engine's token 0
    _, _, steady = run_closed_loop(_FakeEngine(), lambda r: r["max_new_tokens"], lambda r: None, reqs, 2)
    assert steady["steady_tokens"] == 7
    _, _, steady = run_closed_loop(_FakeEngine(), lambda r: r["max_new_tokens"], lambda r: None, reqs, 5)
    assert steady["steady_tokens"] == 4  # all five at once; r0 and r3 end at the first step (r0's is a stop)
    _, _, steady = run_closed_loop(_FakeEngine(), lambda r: r["max_new_tokens"], lambda r: None, reqs, 6)
    assert steady == {"steady_seconds": None, "steady_tokens": None}  # never C requests in flight
