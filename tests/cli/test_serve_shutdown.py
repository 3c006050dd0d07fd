"""`draftmesh serve` stops promptly on Ctrl-C in every phase (issue 18): while starting (its port already
answers, with our "starting", not Ray's NOT_FOUND), idle, and with a request streaming (a bounded drain,
then the call is cancelled). Exit code 130 after SIGINT. A real `draftmesh serve` child process each;
run under the heavy-test lock. Stop times are printed (measured, bounded generously, not benchmarked)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from draftmesh.net import free_port
from draftmesh.router.tls_gateway import STARTING
from draftmesh.v1 import generation_pb2 as pb
from draftmesh.v1 import generation_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

KEY = "shutdown-test-key"
AUTH = (("authorization", f"Bearer {KEY}"),)
DRAIN_S = 5.0
STOP_BOUND_S = DRAIN_S + 40  # generous: Ray's teardown on a loaded 2-core machine (the old code: ~50 s busy)


class Serve:
    """A `draftmesh serve` child in its own session (so that leftovers can be killed as a group)."""

    def __init__(self, tmp_path: Path):
        self.port = free_port()
        self.out = tmp_path / "serve.out"
        self.err = tmp_path / "serve.err"
        cmd = [sys.executable, "-m", "draftmesh.cli", "serve", "--threads", "1", "--grpc-port", str(self.port),
               "--http-port", "0", "--no-factcheck", "--drain-s", str(DRAIN_S), "--api-keys", KEY,
               "--verifier-num-cpus", "0.5", "--log-level", "WARNING"]
        # A cold start, as a user meets it: the forward's costs are timed, not read from the session's
        # engine.cost_cache. With them cached (ready ~35 s sooner), one clean-clone run saw the first
        # Complete after "ready" answer UNAVAILABLE, its details unrecorded. Since then the mesh is ready
        # only once Serve's proxy routes the app, and the proxy's port is picked after Ray's node is up
        # (either could explain it; neither is established: six cached starts since answered OK).
        env = {k: v for k, v in os.environ.items() if k != "DRAFTMESH_COST_CACHE"}
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=err, start_new_session=True,
                                         env={**env, "HF_HUB_OFFLINE": "1"})

    def logs(self) -> str:
        return f"--- stdout\n{self.out.read_text()[-3000:]}\n--- stderr\n{self.err.read_text()[-6000:]}"

    def ready(self) -> bool:
        return "ready in" in self.out.read_text()

    def wait_ready(self, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.ready():
            assert self.proc.poll() is None, f"serve exited early ({self.proc.returncode})\n{self.logs()}"
            assert time.monotonic() < deadline, f"serve not ready in {timeout_s}s\n{self.logs()}"
            time.sleep(0.5)

    def interrupt_and_time(self) -> tuple[int, float]:
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGINT)
        try:
            code = self.proc.wait(timeout=STOP_BOUND_S + 60)
        except subprocess.TimeoutExpired:
            code = None
        return code, time.monotonic() - t0

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


@pytest.fixture
def serve(tmp_path):
    s = Serve(tmp_path)
    yield s
    s.kill()


def _complete_code(port: int) -> tuple[grpc.StatusCode | None, str]:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            pb_grpc.GenerationStub(channel).Complete(pb.GenerateRequest(prompt="hi", max_new_tokens=2),
                                                     metadata=AUTH, timeout=5)
        except grpc.RpcError as exc:
            return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def test_ctrl_c_while_starting_stops_it_and_the_port_said_starting(serve):
    deadline = time.monotonic() + 120
    while True:  # the port opens first and answers our own UNAVAILABLE until the app is deployed
        code, details = _complete_code(serve.port)
        if code == grpc.StatusCode.UNAVAILABLE and details == STARTING:
            break
        assert code != grpc.StatusCode.NOT_FOUND, details  # Ray's "Application metadata not set"
        assert serve.proc.poll() is None and time.monotonic() < deadline, f"{code} {details}\n{serve.logs()}"
        time.sleep(0.2)
    time.sleep(5)  # into Ray's start
    assert not serve.ready(), "the mesh came up before the test could interrupt its start"
    code, took = serve.interrupt_and_time()
    print(f"stopped while starting in {took:.1f}s")
    assert code == 130, serve.logs()
    assert took < STOP_BOUND_S, serve.logs()
    assert not serve.ready()


def test_ctrl_c_when_idle_stops_it(serve):
    serve.wait_ready()
    code, details = _complete_code(serve.port)
    assert code == grpc.StatusCode.OK, f"{code} {details!r}\n{serve.logs()}"
    code, took = serve.interrupt_and_time()
    print(f"stopped idle in {took:.1f}s")
    assert code == 130, serve.logs()
    assert took < STOP_BOUND_S, serve.logs()


def test_ctrl_c_while_streaming_drains_then_stops(serve):
    serve.wait_ready()
    got: dict = {"deltas": 0}
    first = threading.Event()

    def stream() -> None:
        with grpc.insecure_channel(f"127.0.0.1:{serve.port}") as channel:
            request = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="Write a long essay about rivers.")],
                                         max_new_tokens=4000)
            try:
                for _ in pb_grpc.GenerationStub(channel).Generate(request, metadata=AUTH, timeout=600):
                    got["deltas"] += 1
                    first.set()
                got["code"] = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                got["code"] = exc.code()
            got["ended"] = time.monotonic()
            first.set()

    client = threading.Thread(target=stream, daemon=True)
    client.start()
    assert first.wait(300) and "code" not in got, f"{got}\n{serve.logs()}"
    t0 = time.monotonic()
    code, took = serve.interrupt_and_time()
    client.join(30)
    ended = got.get("ended", float("inf")) - t0
    print(f"stopped while streaming in {took:.1f}s; the stream ended after {ended:.1f}s with {got.get('code')} "
          f"({got['deltas']} deltas)")
    assert code == 130, serve.logs()
    assert took < STOP_BOUND_S, serve.logs()
    assert got.get("code") not in (None, grpc.StatusCode.OK)  # cut short, not run to 4000 tokens
    assert ended < DRAIN_S + 15  # the drain is bounded: cancelled soon after drain_s
