"""`draftmesh draft-serve` listens on loopback by default, checks the router's bearer keys
and speaks TLS when given a certificate (issue 18). Real gRPC servers and stubs."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys

import grpc
import pytest

from draftmesh.auth import INVALID, MISSING, ApiKeyAuth
from draftmesh.config import RemoteSource
from draftmesh.draft.base import DraftContext, Proposal
from draftmesh.draft.grpc_server import serve_source
from draftmesh.draft.grpc_source import GrpcDraftSource, RemoteSourceError
from draftmesh.v1 import draft_source_pb2 as pb
from draftmesh.v1 import draft_source_pb2_grpc as pb_grpc
from tls_certs import self_signed

CTX = DraftContext(token_ids=(5, 6, 7), prompt_len=2, text_tail="abc", request_id="r1", size_hint=8)
REQUEST = pb.ProposeRequest(token_ids=[5, 6, 7], prompt_len=2, text_tail="abc", request_id="r1", size_hint=8)


class FixedSource:
    name = "fixed"

    def __init__(self) -> None:
        self.calls = 0

    def propose(self, ctx: DraftContext) -> list[Proposal]:
        self.calls += 1
        return [Proposal("fixed", text="xyz", confidence=0.5)]


@pytest.fixture
def started():
    servers = []

    def start(source, **kwargs) -> int:
        server, port = serve_source(source, 0, **kwargs)
        servers.append(server)
        return port

    yield start
    for server in servers:
        server.stop(0)


def _non_loopback_address() -> str | None:
    """An address of this machine that is not loopback (the route to a public address), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: nothing is sent for a UDP connect
            addr = s.getsockname()[0]
        except OSError:
            return None
    return None if addr.startswith("127.") or addr == "0.0.0.0" else addr


def _code(address: str, metadata=(), credentials=None) -> grpc.StatusCode:
    channel = grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
    with channel:
        try:
            pb_grpc.DraftSourceStub(channel).Propose(REQUEST, timeout=5, metadata=metadata)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def test_default_bind_is_loopback_only(started):
    from draftmesh.cli.main import build_parser

    assert build_parser().parse_args(["draft-serve", "--source", "rules"]).host == "127.0.0.1"
    port = started(FixedSource())  # serve_source's own default
    assert _code(f"127.0.0.1:{port}") == grpc.StatusCode.OK
    other = _non_loopback_address()
    if other is None:
        pytest.skip("this machine has no non-loopback IPv4 address to probe from")
    with socket.socket() as s:
        s.settimeout(2)
        assert s.connect_ex((other, port)) != 0, f"port {port} answers on {other}"


@pytest.mark.parametrize(
    "metadata, reason",
    [
        ((), MISSING),
        ((("authorization", "Bearer wrong-key"),), INVALID),
        ((("authorization", "right-key"),), "authorization must be 'Bearer <key>'"),
        ((("authorization", "Bearer right-key"), ("authorization", "Bearer right-key")), "authorization must be"),
    ],
)
def test_a_missing_or_wrong_key_is_unauthenticated(started, metadata, reason):
    source = FixedSource()
    port = started(source, auth=ApiKeyAuth(["right-key", "other-key"]))
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.DraftSourceStub(channel).Propose(REQUEST, timeout=5, metadata=metadata)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and reason in err.value.details()
    assert "right-key" not in err.value.details() and source.calls == 0  # the source never ran


def test_the_right_key_works(started, tmp_path):
    source = FixedSource()
    port = started(source, auth=ApiKeyAuth(["right-key", "other-key"]))
    for key in ("right-key", "other-key"):
        assert _code(f"127.0.0.1:{port}", (("authorization", f"bearer  {key}"),)) == grpc.StatusCode.OK
    # The mesh's client sends its configured key (sources.remote.<name>.api_key_file).
    keyfile = tmp_path / "key"
    keyfile.write_text("# the draft server's key\nright-key\n")
    spec = RemoteSource(address=f"127.0.0.1:{port}", timeout_ms=5000, api_key_file=str(keyfile))
    with GrpcDraftSource.from_spec("fixed", spec) as client:
        assert [p.text for p in client.propose(CTX)] == ["xyz"]
    with GrpcDraftSource("fixed", f"127.0.0.1:{port}", timeout_s=5) as keyless:
        with pytest.raises(RemoteSourceError, match="UNAUTHENTICATED"):
            keyless.propose(CTX)
    assert source.calls == 3


def test_tls(started):
    cert, key = self_signed()
    port = started(FixedSource(), server_credentials=grpc.ssl_server_credentials([(key, cert)]),
                   auth=ApiKeyAuth(["k1"]))
    creds = grpc.ssl_channel_credentials(root_certificates=cert)
    assert _code(f"localhost:{port}", (("authorization", "Bearer k1"),), creds) == grpc.StatusCode.OK
    assert _code(f"localhost:{port}", (), creds) == grpc.StatusCode.UNAUTHENTICATED
    assert _code(f"127.0.0.1:{port}", (("authorization", "Bearer k1"),)) == grpc.StatusCode.UNAVAILABLE  # plaintext
    with GrpcDraftSource("fixed", f"localhost:{port}", timeout_s=5, secure=True, root_certificates=cert,
                         api_key="k1") as client:
        assert [p.text for p in client.propose(CTX)] == ["xyz"]


def test_cli_draft_serve_with_keys_and_tls(tmp_path):
    """The CLI end to end: --api-key and --tls-cert/--tls-key on the default (loopback) host."""
    cert, key = self_signed()
    (tmp_path / "c.pem").write_bytes(cert)
    (tmp_path / "k.pem").write_bytes(key)
    proc = subprocess.Popen(
        [sys.executable, "-m", "draftmesh.cli", "draft-serve", "--source", "rules", "--port", "0",
         "--api-key", "cli-key", "--tls-cert", str(tmp_path / "c.pem"), "--tls-key", str(tmp_path / "k.pem")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        line = proc.stdout.readline()
        assert "listening on 127.0.0.1:" in line and "with TLS with API keys" in line, (
            line, proc.stderr.read() if proc.poll() is not None else "")
        port = int(line.split("127.0.0.1:", 1)[1].split()[0])
        creds = grpc.ssl_channel_credentials(root_certificates=cert)
        assert _code(f"localhost:{port}", (("authorization", "Bearer cli-key"),), creds) == grpc.StatusCode.OK
        assert _code(f"localhost:{port}", (("authorization", "Bearer nope"),), creds) == grpc.StatusCode.UNAUTHENTICATED
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_refuses_half_a_tls_pair(tmp_path):
    from draftmesh.cli.main import main

    assert main(["draft-serve", "--source", "rules", "--tls-cert", str(tmp_path / "c.pem")]) == 2
