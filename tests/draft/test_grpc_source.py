"""The external DraftSource path: GrpcDraftSource against real gRPC servers on 127.0.0.1."""

from __future__ import annotations

import importlib.util
import logging
import socket
import threading
import time
from pathlib import Path

import grpc
import pytest

from draftmesh.config import RemoteSource
from draftmesh.draft import registry, wire
from draftmesh.draft.base import DraftContext, Proposal
from draftmesh.draft.grpc_server import DraftSourceServicer, serve_source
from draftmesh.draft.grpc_source import GrpcDraftSource, RemoteSourceError
from draftmesh.v1 import draft_source_pb2 as pb
from draftmesh.v1 import draft_source_pb2_grpc as pb_grpc
from draftmesh.verify.source_caller import SourceCaller
from thread_width import ComputeBoundSource, ThreadWidthSource, compute_thread, process_width

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 0.3


class FixedSource:
    """Answers the same proposals whatever it is asked, and remembers the last context."""

    def __init__(self, name: str = "fixed", proposals: list[Proposal] | None = None) -> None:
        self.name = name
        self.proposals = proposals or []
        self.last: DraftContext | None = None

    def propose(self, ctx: DraftContext) -> list[Proposal]:
        self.last = ctx
        return list(self.proposals)


class SleepySource:
    """Hangs for 5 s (or until released, so the test run does not wait for it at exit)."""

    name = "sleepy"

    def __init__(self) -> None:
        self.release = threading.Event()

    def propose(self, ctx: DraftContext) -> list[Proposal]:
        self.release.wait(5.0)
        return []


class BrokenSource:
    name = "broken"

    def propose(self, ctx: DraftContext) -> list[Proposal]:
        raise RuntimeError("boom")


CTX = DraftContext(
    token_ids=(5, 6, 7, 8, 5, 6),
    prompt_len=4,
    text_tail="Visit https:",
    documents=("a passage",),
    session_id="s1",
    request_id="r1",
    size_hint=12,
)


@pytest.fixture
def serve():
    """serve(source) -> port of a started server; every server is stopped afterwards."""
    servers = []

    def start(source, **kwargs) -> int:
        server, port = serve_source(source, 0, **kwargs)
        servers.append(server)
        return port

    yield start
    for server in servers:
        server.stop(None)


@pytest.fixture
def clients():
    made: list[GrpcDraftSource] = []

    def make(*args, **kwargs) -> GrpcDraftSource:
        client = GrpcDraftSource(*args, **kwargs)
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_proposals_round_trip(serve, clients):
    source = FixedSource(
        "server-side-name",
        [
            Proposal("x", token_ids=(1, 2, 3), token_probs=(0.5, 0.25, 0.125), confidence=0.7),
            Proposal("x", text=" world", confidence=3.0, text_complete=True),
            Proposal("x", token_ids=(9,), confidence=0.0),
        ],
    )
    port = serve(source)
    with_ids = clients("mine", f"127.0.0.1:{port}", token_ids_ok=True, timeout_s=TIMEOUT, tokenizer_name="smol")
    got = with_ids.propose(CTX)
    assert [p.source for p in got] == ["mine"] * 3
    assert got[0].token_ids == (1, 2, 3) and got[0].token_probs == (0.5, 0.25, 0.125)
    assert got[0].confidence == pytest.approx(0.7)
    assert got[1].text == " world" and got[1].text_complete and got[1].confidence == 1.0  # clamped
    assert got[2].token_ids == (9,) and got[2].confidence == 0.0
    # The server saw the whole context.
    seen = source.last
    assert seen is not None
    assert tuple(seen.token_ids) == CTX.token_ids and seen.prompt_len == 4
    assert seen.text_tail == CTX.text_tail and tuple(seen.documents) == CTX.documents
    assert seen.session_id == "s1" and seen.request_id == "r1" and seen.size_hint == 12

    # By default ids are not trusted (another tokenizer): only text arrives.
    text_only = clients("mine", f"127.0.0.1:{port}", timeout_s=TIMEOUT)
    got = text_only.propose(CTX)
    assert [(p.source, p.text) for p in got] == [("mine", " world")]
    assert with_ids.calls == 1 and with_ids.failures == 0


def test_builtin_sources_through_the_server(serve, clients):
    """rules and prompt_lookup need no tokenizer, so they are served as-is."""
    rules = registry.create("rules")
    local = rules.propose(CTX)
    assert local, "the default rules should complete 'https:'"
    remote = clients("rules-remote", f"127.0.0.1:{serve(rules)}", timeout_s=TIMEOUT).propose(CTX)
    assert [(p.text, p.text_complete) for p in remote] == [(p.text, p.text_complete) for p in local]
    assert [p.confidence for p in remote] == pytest.approx([p.confidence for p in local])

    lookup = registry.create("prompt_lookup")
    local = lookup.propose(CTX)
    assert local and all(p.token_ids is not None for p in local)
    client = clients("pl", f"127.0.0.1:{serve(lookup)}", timeout_s=TIMEOUT, token_ids_ok=True)
    assert [p.token_ids for p in client.propose(CTX)] == [p.token_ids for p in local]


def test_server_down_fails_within_the_timeout(clients):
    client = clients("down", f"127.0.0.1:{free_port()}", timeout_s=TIMEOUT)
    for _ in range(3):  # the first call (connecting) and the later ones (channel in backoff)
        t0 = time.perf_counter()
        with pytest.raises(RemoteSourceError) as info:
            client.propose(CTX)
        assert time.perf_counter() - t0 < TIMEOUT + 0.5
        assert info.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        assert "down" in str(info.value) and "127.0.0.1" in str(info.value)
    assert client.failures == 3


def test_hung_server_hits_the_deadline(serve, clients):
    sleepy = SleepySource()
    client = clients("hung", f"127.0.0.1:{serve(sleepy)}", timeout_s=TIMEOUT)
    t0 = time.perf_counter()
    try:
        with pytest.raises(RemoteSourceError) as info:
            client.propose(CTX)
    finally:
        sleepy.release.set()
    assert time.perf_counter() - t0 < TIMEOUT + 0.5
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "DEADLINE_EXCEEDED" in str(info.value)


def test_source_error_is_internal(serve, clients, caplog):
    client = clients("b", f"127.0.0.1:{serve(BrokenSource())}", timeout_s=TIMEOUT)
    with caplog.at_level(logging.ERROR, logger="draftmesh.draft.grpc_server"):
        with pytest.raises(RemoteSourceError) as info:
            client.propose(CTX)
    assert info.value.code == grpc.StatusCode.INTERNAL
    assert "RuntimeError: boom" in str(info.value)
    assert any("broken" in r.getMessage() for r in caplog.records)


def test_bad_request_is_invalid_argument(serve):
    port = serve(FixedSource())
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.DraftSourceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Propose(pb.ProposeRequest(token_ids=[1, 2], prompt_len=5), timeout=2.0)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt_len 5" in info.value.details()


def test_failures_are_logged_once_per_state(clients, caplog, monkeypatch):
    from draftmesh.draft import grpc_source

    monkeypatch.setattr(grpc_source, "LOG_EVERY", 5)
    client = clients("quiet", f"127.0.0.1:{free_port()}", timeout_s=TIMEOUT)
    with caplog.at_level(logging.WARNING, logger="draftmesh.draft.grpc_source"):
        for _ in range(7):
            with pytest.raises(RemoteSourceError):
                client.propose(CTX)
    lines = [r for r in caplog.records if r.name == "draftmesh.draft.grpc_source"]
    # The first failure, then the 5th in a row (a change of status code would add one more).
    assert 2 <= len(lines) <= 3


def test_source_caller_skips_a_down_source(clients):
    down = clients("down", f"127.0.0.1:{free_port()}", timeout_s=TIMEOUT)
    good = FixedSource("good", [Proposal("good", text=" ok")])
    caller = SourceCaller(deadline_s=0.2)
    try:
        t0 = time.perf_counter()
        answers = caller.call([down, good], CTX)
        assert time.perf_counter() - t0 < 0.2 + 0.5
    finally:
        caller.close()
    assert answers.failed.get("down") in ("error", "timeout")
    assert [p.text for p in answers.proposals["good"]] == [" ok"]
    assert "down" not in answers.proposals


def test_servicer_wire_directly():
    """The servicer without a network: what the server answers is wire.proposals_to_proto."""
    source = FixedSource("f", [Proposal("f", text="abc", confidence=0.5)])
    resp = DraftSourceServicer(source).Propose(wire.context_to_proto(CTX), context=None)
    assert resp.source == "f" and [p.text for p in resp.proposals] == ["abc"]


def test_echo_example_server(clients):
    path = ROOT / "examples" / "external_source" / "echo_server.py"
    spec = importlib.util.spec_from_file_location("echo_server_example", path)
    echo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(echo)
    server, port = echo.serve(0, "127.0.0.1")
    try:
        client = clients("echo", f"127.0.0.1:{port}", timeout_s=1.0)
        ctx = DraftContext(token_ids=(1,), prompt_len=1, text_tail="The story begins. Once upon a")
        got = client.propose(ctx)
        assert [(p.source, p.text, p.text_complete) for p in got] == [("echo", " time, there was", True)]
        assert 0.0 < got[0].confidence <= 1.0
        assert client.propose(DraftContext(token_ids=(1,), prompt_len=1, text_tail="nothing known")) == []
    finally:
        server.stop(None)


def test_constructor_checks():
    with pytest.raises(ValueError):
        GrpcDraftSource("x", "no-port")
    with pytest.raises(ValueError):
        GrpcDraftSource("x", "127.0.0.1:1", timeout_s=0)
    spec = GrpcDraftSource.from_spec("x", RemoteSource(address="127.0.0.1:1", timeout_ms=50, token_ids=True))
    assert spec.timeout_s == pytest.approx(0.05) and spec.token_ids_ok and not spec.secure


def test_cli_draft_serve(clients, tmp_path):
    """`draftmesh draft-serve` serves a built-in source (with its options) and stops cleanly on SIGTERM."""
    import signal
    import subprocess
    import sys

    options = tmp_path / "rules.yaml"
    options.write_text("max_proposals: 1\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "draftmesh.cli", "draft-serve", "--source", "rules", "--port", "0",
         "--host", "127.0.0.1", "--options-yaml", str(options)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        line = proc.stdout.readline()
        assert "listening on 127.0.0.1:" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
        address = line.strip().rsplit(" ", 1)[1]
        got = clients("rules", address, timeout_s=5.0).propose(CTX)
        assert [p.text for p in got] == ["//"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_what_a_remote_source_sends_is_bounded_on_arrival():
    resp = pb.ProposeResponse(source="x")
    for k in range(200):
        resp.proposals.add(token_ids=list(range(5000)), token_probs=[float("inf")] * 5000, confidence=float("inf"))
    resp.proposals[0].ClearField("token_ids")
    resp.proposals[0].ClearField("token_probs")
    resp.proposals[0].text = "a" * 10_000_000
    resp.proposals[0].text_complete = True
    got = wire.proposals_from_proto(resp, "remote", token_ids_ok=True)
    from draftmesh.draft.base import MAX_PROPOSALS_PER_SOURCE, TEXT_CHARS_PER_NODE
    from draftmesh.io_struct import MAX_TREE_NODES

    assert len(got) == MAX_PROPOSALS_PER_SOURCE
    assert len(got[0].text) == MAX_TREE_NODES * TEXT_CHARS_PER_NODE and got[0].text_complete is False
    assert all(len(p.token_ids) == MAX_TREE_NODES and set(p.token_probs) == {1.0} for p in got[1:])
    assert all(p.confidence == 1.0 and p.source == "remote" for p in got)


def test_bounded_cuts_and_clamps_only_what_is_out_of_bounds():
    from draftmesh.draft.base import TEXT_CHARS_PER_NODE, bounded

    fine = Proposal("s", token_ids=(1, 2, 3), token_probs=(0.5, 1.0, 0.0), confidence=0.7)
    assert bounded(fine, 3) is fine
    cut = bounded(Proposal("s", token_ids=(1, 2, 3), token_probs=(float("nan"), 9.0, -2.0), confidence=float("inf")), 2)
    assert cut.token_ids == (1, 2) and cut.token_probs == (0.0, 1.0) and cut.confidence == 1.0
    text = bounded(Proposal("s", text="x" * 1000, text_complete=True), 2)
    assert text.text == "x" * (2 * TEXT_CHARS_PER_NODE) and not text.text_complete
    assert bounded(Proposal("s", token_ids=(1, 2)), 0).token_ids == ()


def test_an_answer_larger_than_we_read_fails_that_call_only(clients):
    import grpc as grpc_mod
    from concurrent import futures

    from draftmesh.draft.grpc_source import MAX_ANSWER_BYTES

    class Flood(pb_grpc.DraftSourceServicer):
        def Propose(self, request, context):  # noqa: N802
            return pb.ProposeResponse(source="f", proposals=[pb.Proposal(text="z" * (MAX_ANSWER_BYTES + 1))])

    server = grpc_mod.server(futures.ThreadPoolExecutor(2), options=[("grpc.max_send_message_length", 64 << 20)])
    pb_grpc.add_DraftSourceServicer_to_server(Flood(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        client = clients("flood", f"127.0.0.1:{port}", timeout_s=5.0)
        with pytest.raises(RemoteSourceError) as err:
            client.propose(CTX)
        assert err.value.code == grpc_mod.StatusCode.RESOURCE_EXHAUSTED
    finally:
        server.stop(None)


def test_served_sources_run_torch_single_threaded(serve, clients):
    """Each server thread at the process's width would start an OpenMP team of its own: a served
    source's concurrent torch calls would throttle each other (draftmesh.compute)."""
    source = ThreadWidthSource()
    with process_width(2):
        client = clients("llm", f"127.0.0.1:{serve(source, max_workers=2)}", timeout_s=TIMEOUT)
        for _ in range(3):
            assert client.propose(CTX) == []
    assert source.widths == [1, 1, 1]


def test_a_draft_deployment_runs_its_source_single_threaded():
    """The Serve draft deployment's calls too (its class, called without Ray)."""
    import asyncio

    from draftmesh.draft.deployment import DraftDeployment

    spec = RemoteSource(factory="thread_width:ThreadWidthSource")
    with process_width(2):
        deployment = DraftDeployment.func_or_class("llm", "smollm2-135m", spec)
        for _ in range(2):
            asyncio.run(deployment.Propose(wire.context_to_proto(CTX)))
    assert deployment.source.widths == [1, 1]


def test_a_served_compute_bound_source_runs_on_the_compute_thread(serve, clients):
    source = ComputeBoundSource()
    client = clients("llm", f"127.0.0.1:{serve(source)}", token_ids_ok=True, timeout_s=TIMEOUT)
    assert [p.token_ids for p in client.propose(CTX)] == [(9,)]
    assert source.threads == [compute_thread()]


def test_the_llm_source_says_it_is_compute_bound():
    from draftmesh.draft.base import compute_bound
    from draftmesh.draft.llm import LLMSource

    assert compute_bound(LLMSource) and not compute_bound(registry.create("rules"))
