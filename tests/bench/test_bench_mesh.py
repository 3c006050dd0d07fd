"""`draftmesh bench --target mesh` for real: the bench starts its own local mesh (Redis, Ray,
Serve, gRPC, SmolLM2) and runs the public workload through it beside the in-process engine.

It runs the CLI in a subprocess: one process holds at most one Ray/Serve instance and the
mesh tests (tests/router/test_mesh.py) keep theirs for the whole session; a subprocess is
also what users run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_bench_target_mesh_starts_its_own_mesh(tmp_path):
    out_json = tmp_path / "mesh.json"
    cmd = [
        sys.executable, "-m", "draftmesh.cli", "bench", "--workload", str(ROOT / "bench" / "public.jsonl"),
        "--target", "mesh", "--limit", "2", "--repeats", "1", "--max-new-tokens", "16",
        "--threads", "1", "--no-progress", "--no-cost-curve", "--json", str(out_json),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("REDIS_URL", None)  # the mesh's own embedded redis-server
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # a background job may have inherited an ignored SIGINT: restore it so the Ctrl-C below works
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        stdout, stderr = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # Ctrl-C: the bench stops its mesh on the way out
        try:
            stdout, stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        pytest.fail(f"the bench ran past 600 s\nstdout:\n{stdout}\nstderr:\n{stderr[-6000:]}")
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{stdout}\nstderr:\n{stderr[-6000:]}"
    assert "mesh vs in-process" in stdout

    data = json.loads(out_json.read_text())
    assert data["target"] == "mesh"
    assert data["methods"] == ["plain", "draftmesh", "mesh:plain", "mesh:draftmesh"]
    items = data["items"]
    assert len(items) == 2 * 4
    for rec in items:
        if rec["method"] != "plain":
            assert rec["identical_to_plain"] is True, rec  # the mesh too: token for token
        assert rec["first_token_ms"] is not None and rec["first_token_ms"] > 0
    for rec in items:
        if rec["method"].startswith("mesh:"):
            assert rec["prompt_tokens"] > 0 and rec["steps"] >= 1
    assert not data["mismatches"]

    mesh = data["mesh"]
    assert mesh["started_by_bench"] is True and mesh["mesh_state_reset"] is True
    assert mesh["started_s"] > 0
    assert mesh["memory"]["rss_mb"] > 0 and mesh["memory"]["processes"] >= 3
    assert mesh["config"]["threads"] == data["threads"] == 1
    pairs = mesh["pairs"]
    assert set(pairs) == {"mesh:plain", "mesh:draftmesh"}
    for pair in pairs.values():
        assert pair["items"] == 2 and pair["identical"] == 2
        assert pair["tokens_per_s_ratio"] > 0
        assert pair["first_token_ms"]["mesh"] > 0 and pair["first_token_ms"]["local"] > 0
        assert pair["overhead_ms_per_step"] is not None
    assert pairs["mesh:plain"]["mean_accepted_per_step"]["mesh"] == pytest.approx(1.0)
