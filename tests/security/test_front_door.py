"""The front door (issue 18): the gateway in front of Serve's gRPC proxy answers "starting" until the app
is deployed, checks the bearer key before it reads a message body, caps the message size and the calls in
flight, and pins Ray Serve's `application` header. Real gRPC servers and channels; the upstream is the
scripted Generation server (no Ray: the mesh side is in tests/router/test_mesh.py and
tests/cli/test_serve_shutdown.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import grpc
import pytest

from draftmesh.auth import ApiKeyAuth
from draftmesh.router.loopback import loopback_address
from draftmesh.router.tls_gateway import STARTING, TlsGateway
from draftmesh.v1 import generation_pb2 as pb
from draftmesh.v1 import generation_pb2_grpc as pb_grpc
from fake_generation import start_fake_generation

pytestmark = pytest.mark.timeout(120)

KEY = "front-door-key"
AUTH = (("authorization", f"Bearer {KEY}"),)
TESTS_DIR = Path(__file__).resolve().parent.parent


@pytest.fixture
def upstream():
    server, address, servicer = start_fake_generation()
    yield address, servicer
    server.stop(0)


def _gateway(upstream_address: str, **kwargs):
    return TlsGateway(upstream_address, 0, None, None, host="127.0.0.1", **kwargs).run_in_thread()


def _complete(port: int, request: pb.GenerateRequest, metadata=(), timeout: float = 30):
    options = [("grpc.max_send_message_length", -1)]
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
        return pb_grpc.GenerationStub(channel).Complete(request, metadata=metadata, timeout=timeout)


def _code(port: int, request: pb.GenerateRequest, metadata=()) -> tuple[grpc.StatusCode, str]:
    try:
        _complete(port, request, metadata)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def test_the_port_answers_starting_until_the_app_is_ready(upstream):
    address, servicer = upstream
    with _gateway(address, ready=False) as gw:
        code, details = _code(gw.port, pb.GenerateRequest(prompt="hi"))
        assert code == grpc.StatusCode.UNAVAILABLE and details == STARTING
        assert "starting" in details and "Application metadata" not in details
        assert servicer.requests == []  # nothing reached the upstream
        gw.set_ready()  # the GatewayThread's, as the launcher calls it
        assert _complete(gw.port, pb.GenerateRequest(prompt="hi")).text.startswith("The cat")


def test_the_key_is_checked_at_the_gateway(upstream):
    address, servicer = upstream
    with _gateway(address, auth=ApiKeyAuth([KEY])) as gw:
        for metadata in [(), (("authorization", "Bearer wrong"),), (("authorization", f"bearer{KEY}"),)]:
            code, details = _code(gw.port, pb.GenerateRequest(prompt="hi"), metadata)
            assert code == grpc.StatusCode.UNAUTHENTICATED and KEY not in details
        assert servicer.requests == []
        assert _complete(gw.port, pb.GenerateRequest(prompt="hi"), AUTH).text.startswith("The cat")
        # Serve's health methods stay open to keyless container health checks.
        with grpc.insecure_channel(f"127.0.0.1:{gw.port}") as channel:
            healthz = channel.unary_unary("/ray.serve.RayServeAPIService/Healthz")
            with pytest.raises(grpc.RpcError) as info:
                healthz(b"", timeout=10)
            assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED  # forwarded: the fake has no Healthz


def test_the_application_header_is_pinned(upstream):
    address, servicer = upstream
    with _gateway(address, application="draftmesh") as gw:
        metadata = (("application", "someone-elses-app"), ("application", "other"), ("x-keep", "1"))
        _complete(gw.port, pb.GenerateRequest(prompt="hi"), metadata)
    assert servicer.metadata[-1]["application"] == "draftmesh"
    assert servicer.metadata[-1]["x-keep"] == "1"


def test_a_message_over_the_cap_is_refused(upstream):
    address, servicer = upstream
    with _gateway(address, max_message_bytes=64 * 1024) as gw:
        code, _ = _code(gw.port, pb.GenerateRequest(prompt="x" * 100_000))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert _complete(gw.port, pb.GenerateRequest(prompt="x" * 1000)).text.startswith("The cat")
    assert [len(r.prompt) for r in servicer.requests] == [1000]


class HoldingGeneration(pb_grpc.GenerationServicer):
    """Generate sends one delta, then holds the call open until released."""

    def __init__(self):
        self.release = threading.Event()

    def Generate(self, request, context):
        yield pb.GenerateResponse(delta=pb.GenerateDelta(text="x"))
        self.release.wait(30)

    def Complete(self, request, context):
        return pb.GenerateResult(text="done")


def test_calls_in_flight_are_capped():
    """`max_concurrent_rpcs` calls at once (the launcher passes serve.max_streams); beyond: RESOURCE_EXHAUSTED."""
    from concurrent import futures

    servicer = HoldingGeneration()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    pb_grpc.add_GenerationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with _gateway(f"127.0.0.1:{port}", max_concurrent_rpcs=2) as gw, \
                grpc.insecure_channel(f"127.0.0.1:{gw.port}") as channel:
            stub = pb_grpc.GenerationStub(channel)
            held = [stub.Generate(pb.GenerateRequest(prompt="hi"), timeout=30) for _ in range(2)]
            for call in held:
                next(call)  # the first delta: the call is running at the gateway
            try:
                with pytest.raises(grpc.RpcError) as info:
                    stub.Complete(pb.GenerateRequest(prompt="hi"), timeout=10)
                assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            finally:
                servicer.release.set()
                for call in held:
                    list(call)
            assert stub.Complete(pb.GenerateRequest(prompt="hi"), timeout=10).text == "done"
    finally:
        server.stop(0)


GATEWAY_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from draftmesh.auth import ApiKeyAuth
    from draftmesh.router.tls_gateway import TlsGateway
    from fake_generation import start_fake_generation

    server, address, servicer = start_fake_generation()
    gw = TlsGateway(address, 0, None, None, host="127.0.0.1", auth=ApiKeyAuth([{key!r}]),
                    max_message_bytes=128 * 1024 * 1024).run_in_thread()
    print(gw.port, flush=True)
    sys.stdin.readline()
    print(len(servicer.requests), flush=True)
""")


def _peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc (Linux)")
def test_an_unauthenticated_64_mib_message_is_not_buffered():
    """The refusal comes from the headers: the gateway process's peak RSS grows by far less than the
    message (a unary handler would first receive all of it). The size cap is set above the message,
    so that what is measured is the order of the checks, not the cap."""
    proc = subprocess.Popen([sys.executable, "-c", GATEWAY_SCRIPT.format(tests=str(TESTS_DIR), key=KEY)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        assert _complete(port, pb.GenerateRequest(prompt="hi"), AUTH).text.startswith("The cat")  # warm
        before = _peak_rss_kib(proc.pid)
        big = pb.GenerateRequest(prompt="x" * (64 * 1024 * 1024))
        code, _ = _code(port, big)
        after = _peak_rss_kib(proc.pid)
        print(f"gateway peak RSS before {before / 1024:.1f} MiB, after a 64 MiB unauthenticated message "
              f"{after / 1024:.1f} MiB (+{(after - before) / 1024:.1f} MiB)")
        assert code == grpc.StatusCode.UNAUTHENTICATED
        assert after - before < 16 * 1024, f"peak RSS grew by {(after - before) / 1024:.1f} MiB"
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert int(proc.stdout.readline()) == 1  # only the authenticated warm-up reached the upstream
    finally:
        proc.kill()
        proc.wait()


def test_wildcard_binds_are_rewritten_to_loopback():
    assert loopback_address("[::]:9000") == "127.0.0.1:9000"
    assert loopback_address("0.0.0.0:0") == "127.0.0.1:0"
    assert loopback_address("10.1.2.3:9000") == "10.1.2.3:9000"
    assert loopback_address("127.0.0.1:5") == "127.0.0.1:5"


def test_start_up_refuses_an_upstream_reachable_from_the_network():
    """`start_mesh` runs this check on Serve's proxy port: a listener on every interface is refused, a
    loopback one passes (real sockets on this machine)."""
    import socket

    from draftmesh.router.launcher import UpstreamExposed, check_upstream_private
    from draftmesh.router.loopback import non_loopback_addresses

    if not non_loopback_addresses():
        pytest.skip("this machine has no non-loopback address to test from")
    for host, exposed in (("0.0.0.0", True), ("127.0.0.1", False)):
        with socket.socket() as listener:
            listener.bind((host, 0))
            listener.listen()
            port = listener.getsockname()[1]
            if exposed:
                with pytest.raises(UpstreamExposed, match=str(port)):
                    check_upstream_private(port)
                check_upstream_private(port, strict=False)  # an existing cluster: logged, not refused
            else:
                check_upstream_private(port)


@pytest.mark.parametrize("metadata, ok", [
    ((), False),                                                              # missing
    ((("authorization", f"Bearer {KEY}"), ("authorization", f"Bearer {KEY}")), False),  # duplicated
    ((("authorization", f"Bearer {KEY}"), ("authorization", "Bearer other")), False),   # duplicated, differing
    ((("authorization", f"bearer {KEY}"),), True),                            # lowercase scheme (RFC 7235)
    ((("authorization", f"BEARER {KEY}"),), True),
    ((("authorization", f"Bearer   {KEY}  "),), True),                        # extra spaces
    ((("authorization", f"Basic {KEY}"),), False),                            # another scheme
    ((("authorization", KEY),), False),                                       # no scheme
    ((("authorization", f"Bearer {KEY.upper()}"),), False),                   # keys are case-sensitive
])
def test_auth_edge_cases_through_the_tls_gateway(upstream, metadata, ok):
    """The issue's auth cases through the TLS gateway itself (a real TLS channel), not the checker alone:
    only one well-formed bearer header with the exact key gets through, and nothing else reaches the upstream."""
    from tls_certs import self_signed

    address, servicer = upstream
    cert, key = self_signed()
    with TlsGateway(address, 0, cert, key, host="127.0.0.1", auth=ApiKeyAuth([KEY])).run_in_thread() as gw:
        creds = grpc.ssl_channel_credentials(root_certificates=cert)
        with grpc.secure_channel(f"localhost:{gw.port}", creds) as channel:
            stub = pb_grpc.GenerationStub(channel)
            try:
                stub.Complete(pb.GenerateRequest(prompt="hi"), metadata=metadata, timeout=30)
                code = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                code = exc.code()
                assert KEY not in (exc.details() or "")
    assert code == (grpc.StatusCode.OK if ok else grpc.StatusCode.UNAUTHENTICATED)
    assert len(servicer.requests) == (1 if ok else 0)
