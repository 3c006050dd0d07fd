"""`draftmesh demo` as users run it: a real mesh in a child process, real requests, clean stop."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from draftmesh.net import free_port

pytestmark = pytest.mark.slow


def test_mesh_demo_runs_all_requests_identically_and_stops_the_mesh():
    cmd = [sys.executable, "-m", "draftmesh.cli", "demo", "--threads", "2", "--max-new-tokens", "24",
           "--grpc-port", str(free_port()), "--http-port", str(free_port()), "--log-level", "WARNING"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert re.search(r"mesh ready on localhost:\d+ in [\d.]+s", out)
    rows = [line for line in out.splitlines() if re.search(r"\d+\.\d+x", line)]
    assert len(rows) == 4, out
    assert all(" yes " in row for row in rows), rows
    assert "mesh stopped" in out
    assert re.search(r"HTTP face: \d+ tokens in [\d.]+s, [\d.]+ tokens/step, identical to gRPC Complete: yes", out), out
    # the answer store makes the repeated question cheaper per token than its first time
    per_step = [float(re.search(r"x\s+([\d.]+)\s+(yes|NO)", row).group(1)) for row in rows]
    assert per_step[3] > per_step[2]
