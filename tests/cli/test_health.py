"""`draftmesh health` against a real in-process gRPC server that answers Ray Serve's two proxy
health methods, registered under the names Ray's own generated ``serve_pb2`` defines."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest
from ray.serve.generated import serve_pb2, serve_pb2_grpc

from deploy.deploy_files import dispatch
from draftmesh import serve_health
from draftmesh.cli import health
from draftmesh.cli.main import main
from draftmesh.net import free_port

SERVICE = serve_pb2.DESCRIPTOR.services_by_name["RayServeAPIService"]


class FakeProxy:
    """Behaves like Serve's gRPCProxy for Healthz/ListApplications (ray/serve/_private/proxy.py:
    the message is returned together with OK or UNAVAILABLE)."""

    def __init__(self):
        self.healthy = True
        self.message = "success"
        self.routes_ready = True
        self.applications = ["draftmesh"]
        self.delay_s = 0.0
        self.requests: list[tuple[str, object]] = []

    def healthz(self, request, context):
        self.requests.append(("Healthz", request))
        time.sleep(self.delay_s)
        if not self.healthy:
            context.set_code(grpc.StatusCode.UNAVAILABLE)
            context.set_details(self.message)
        return serve_pb2.HealthzResponse(message=self.message)

    def list_applications(self, request, context):
        self.requests.append(("ListApplications", request))
        if not self.routes_ready:
            context.set_code(grpc.StatusCode.UNAVAILABLE)
            context.set_details("Route table is not populated yet.")
        return serve_pb2.ListApplicationsResponse(application_names=self.applications)


@pytest.fixture
def proxy():
    fake = FakeProxy()
    methods = {m.name: m for m in SERVICE.methods}
    handlers = {
        "Healthz": grpc.unary_unary_rpc_method_handler(
            fake.healthz,
            request_deserializer=getattr(serve_pb2, methods["Healthz"].input_type.name).FromString,
            response_serializer=lambda m: m.SerializeToString(),
        ),
        "ListApplications": grpc.unary_unary_rpc_method_handler(
            fake.list_applications,
            request_deserializer=getattr(serve_pb2, methods["ListApplications"].input_type.name).FromString,
            response_serializer=lambda m: m.SerializeToString(),
        ),
    }
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    fake.addr = f"127.0.0.1:{port}"
    try:
        yield fake
    finally:
        server.stop(0).wait()


# --------------------------------------------------------------------------- the contract with Ray


def test_method_paths_are_the_ones_ray_defines():
    paths = {f"/{SERVICE.full_name}/{m.name}" for m in SERVICE.methods}
    assert health.HEALTHZ_METHOD in paths and health.LIST_APPLICATIONS_METHOD in paths

    class RecordingChannel:
        def __init__(self):
            self.paths = []

        def unary_unary(self, path, *args, **kwargs):
            self.paths.append(path)
            return None

    channel = RecordingChannel()
    serve_pb2_grpc.RayServeAPIServiceStub(channel)  # Ray's client stub: the paths it would call
    assert {health.HEALTHZ_METHOD, health.LIST_APPLICATIONS_METHOD} <= set(channel.paths)


def test_response_messages_match_rays():
    for name, cls in serve_health._messages().items():
        ours = cls.DESCRIPTOR
        theirs = getattr(serve_pb2, name).DESCRIPTOR
        assert ours.full_name == theirs.full_name
        assert [(f.name, f.number, f.type, f.is_repeated) for f in ours.fields] == \
               [(f.name, f.number, f.type, f.is_repeated) for f in theirs.fields]
    # and bytes from Ray's classes decode with ours
    raw = serve_pb2.ListApplicationsResponse(application_names=["a", "draftmesh"]).SerializeToString()
    assert list(serve_health._messages()["ListApplicationsResponse"].FromString(raw).application_names) == ["a", "draftmesh"]


def test_default_application_is_the_mesh_app():
    from draftmesh.router.app import APP_NAME

    assert health.DEFAULT_APPLICATION == APP_NAME


# --------------------------------------------------------------------------- healthy / unhealthy / unreachable


def test_healthy(proxy):
    status = health.check_health(proxy.addr, timeout=5)
    assert status.healthy and status.applications == ("draftmesh",)
    assert "success" in status.message
    # both methods were called, each with an (empty) request Ray's proxy can parse
    assert [name for name, _ in proxy.requests] == ["Healthz", "ListApplications"]
    assert isinstance(proxy.requests[0][1], serve_pb2.HealthzRequest)
    assert isinstance(proxy.requests[1][1], serve_pb2.ListApplicationsRequest)


def test_cli_healthy_exit_0_one_line(proxy, capsys):
    assert main(["health", "--addr", proxy.addr, "--timeout", "5"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("healthy: ") and out.count("\n") == 1 and err == ""


def test_app_not_deployed_is_unhealthy(proxy, capsys):
    proxy.applications = ["other-app"]
    assert main(["health", "--addr", proxy.addr]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("unhealthy: ") and err.count("\n") == 1
    assert "'draftmesh' is not deployed" in err and "'other-app'" in err
    # the same proxy is healthy for the app it does serve
    assert main(["health", "--addr", proxy.addr, "--application", "other-app"]) == 0


def test_draining_proxy_is_unhealthy(proxy, capsys):
    proxy.healthy = False
    proxy.message = "This node is being drained."
    assert main(["health", "--addr", proxy.addr]) == 1
    err = capsys.readouterr().err
    assert "Healthz failed: UNAVAILABLE: This node is being drained." in err
    assert [name for name, _ in proxy.requests] == ["Healthz"]


def test_routes_not_populated_is_unhealthy(proxy):
    proxy.routes_ready = False
    status = health.check_health(proxy.addr, timeout=5)
    assert not status.healthy and "ListApplications failed: UNAVAILABLE" in status.message


def test_wait_served_returns_once_the_proxy_routes_the_app(proxy):
    """The mesh's readiness (``start_mesh``): it waits while the proxy's routes are not populated,
    then returns the healthy answer."""
    proxy.routes_ready = False
    threading.Timer(0.5, lambda: setattr(proxy, "routes_ready", True)).start()
    t0 = time.monotonic()
    status = serve_health.wait_served(proxy.addr, timeout_s=20)
    assert status.healthy and time.monotonic() - t0 >= 0.5
    assert sum(1 for name, _ in proxy.requests if name == "ListApplications") >= 2


def test_wait_served_gives_up_with_the_last_answer(proxy):
    proxy.applications = ["other-app"]
    t0 = time.monotonic()
    status = serve_health.wait_served(proxy.addr, timeout_s=0.6)
    assert not status.healthy and "'draftmesh' is not deployed" in status.message
    assert 0.5 <= time.monotonic() - t0 < 5


def test_unreachable_is_unhealthy_and_fast(capsys):
    addr = f"127.0.0.1:{free_port()}"  # nothing listens there
    t0 = time.monotonic()
    assert main(["health", "--addr", addr, "--timeout", "10"]) == 1
    assert time.monotonic() - t0 < 8, "a refused connection must not wait for the whole timeout"
    err = capsys.readouterr().err
    assert err.startswith(f"unhealthy: cannot reach {addr}") and err.count("\n") == 1


def test_timeout_bounds_the_check(proxy, capsys):
    proxy.delay_s = 3.0
    t0 = time.monotonic()
    assert main(["health", "--addr", proxy.addr, "--timeout", "0.5"]) == 1
    assert time.monotonic() - t0 < 2.5
    assert "DEADLINE_EXCEEDED" in capsys.readouterr().err


def test_a_non_grpc_peer_is_unhealthy(capsys):
    """Something else listening on the port (here: a plain TCP socket that closes) is not healthy."""
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    port = sock.getsockname()[1]
    stop = threading.Event()

    def accept():
        sock.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
                conn.close()
            except OSError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        assert main(["health", "--addr", f"127.0.0.1:{port}", "--timeout", "2"]) == 1
    finally:
        stop.set()
        thread.join()
        sock.close()
    assert capsys.readouterr().err.startswith("unhealthy: ")


def test_bad_arguments(monkeypatch):
    with pytest.raises(ValueError, match="timeout"):
        health.check_health("localhost:9000", timeout=0)
    with pytest.raises(ValueError, match="addr"):
        health.check_health(" ")
    command, args = dispatch(["health"], monkeypatch)
    assert command == "health" and args.addr == "localhost:9000" and args.timeout > 0
