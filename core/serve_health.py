"""Is a Serve gRPC proxy up and serving an application? (``draftmesh health`` and the mesh's own
readiness both ask it.)

Ray Serve's gRPC proxy answers two built-in methods on the same port as the application
(Ray docs, "Set Up a gRPC Service", section "Check proxy health"; ``ray.serve.generated.serve_pb2``):

- ``/ray.serve.RayServeAPIService/Healthz`` (``HealthzRequest {}`` -> ``HealthzResponse {string message = 1}``):
  OK with message "success" while the proxy is healthy; UNAVAILABLE while it is draining or its
  route table is not populated yet;
- ``/ray.serve.RayServeAPIService/ListApplications`` (``ListApplicationsRequest {}`` ->
  ``ListApplicationsResponse {repeated string application_names = 1}``): the deployed applications.

Healthy: ``Healthz`` is OK and ``ListApplications`` lists the application. The calls are generic
unary calls with identity serializers (raw bytes) over an insecure channel, and the two responses
are decoded with message classes built here from the same field layout, so this module imports
neither Ray nor generated stubs: a container health check starts in a fraction of a second.
``tests/cli/test_health.py`` checks the method paths and the messages against Ray's own
``serve_pb2``.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import grpc

SERVICE = "ray.serve.RayServeAPIService"
HEALTHZ_METHOD = f"/{SERVICE}/Healthz"
LIST_APPLICATIONS_METHOD = f"/{SERVICE}/ListApplications"
DEFAULT_ADDR = "localhost:9000"
# draftmesh.router.app.APP_NAME (a test keeps the two equal; importing the app module here would
# make the health check depend on the engine's imports).
DEFAULT_APPLICATION = "draftmesh"
DEFAULT_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class HealthStatus:
    healthy: bool
    message: str
    """One line: what was checked and, when unhealthy, why it failed."""
    applications: tuple[str, ...] = ()
    """What ListApplications returned (empty when it was not reached)."""


@functools.cache
def _messages() -> dict[str, type]:
    """HealthzResponse and ListApplicationsResponse, built in a private descriptor pool (the same
    names and field numbers as Ray's serve.proto; a private pool cannot clash with Ray's when both
    are loaded in one process)."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    fdp = descriptor_pb2.FileDescriptorProto(name="draftmesh_health/serve_api.proto", package="ray.serve",
                                             syntax="proto3")
    F = descriptor_pb2.FieldDescriptorProto
    healthz = fdp.message_type.add(name="HealthzResponse")
    healthz.field.add(name="message", number=1, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
    apps = fdp.message_type.add(name="ListApplicationsResponse")
    apps.field.add(name="application_names", number=1, type=F.TYPE_STRING, label=F.LABEL_REPEATED)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return {
        name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"ray.serve.{name}"))
        for name in ("HealthzResponse", "ListApplicationsResponse")
    }


def _identity(data: bytes) -> bytes:
    return data


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _rpc_failure(addr: str, method: str, exc: grpc.RpcError) -> str:
    code = exc.code() if hasattr(exc, "code") else None
    details = _one_line(exc.details() if hasattr(exc, "details") else exc) or "no details"
    name = code.name if code is not None else type(exc).__name__
    if code == grpc.StatusCode.UNAVAILABLE and ("connect" in details.lower() or "connection" in details.lower()):
        return f"cannot reach {addr}: {name}: {details}"
    return f"{addr}: {method} failed: {name}: {details}"


def check_health(addr: str = DEFAULT_ADDR, application: str = DEFAULT_APPLICATION,
                 timeout: float = DEFAULT_TIMEOUT_S) -> HealthStatus:
    """Ask the Serve gRPC proxy at ``addr`` whether it is healthy and serves ``application``.

    ``timeout`` bounds both calls together. Never raises for an unhealthy or unreachable mesh."""
    if not addr or not addr.strip():
        raise ValueError("--addr must be host:port, got an empty address")
    if not timeout > 0:
        raise ValueError(f"--timeout must be > 0 seconds, got {timeout}")
    deadline = time.monotonic() + timeout
    messages = _messages()
    # No HTTP proxy for a local probe, whatever http_proxy/https_proxy the container has.
    with grpc.insecure_channel(addr, options=[("grpc.enable_http_proxy", 0)]) as channel:
        calls = {
            method: channel.unary_unary(method, request_serializer=_identity, response_deserializer=_identity)
            for method in (HEALTHZ_METHOD, LIST_APPLICATIONS_METHOD)
        }

        def call(method: str) -> bytes:
            # Both requests are empty messages, which serialize to no bytes.
            return calls[method](b"", timeout=max(deadline - time.monotonic(), 0.001))

        try:
            raw = call(HEALTHZ_METHOD)
        except grpc.RpcError as exc:
            return HealthStatus(False, _rpc_failure(addr, "Healthz", exc))
        try:
            proxy_message = messages["HealthzResponse"].FromString(raw).message
        except Exception as exc:  # google.protobuf.message.DecodeError
            return HealthStatus(False, f"{addr}: Healthz returned a malformed response ({_one_line(exc)})")
        try:
            raw = call(LIST_APPLICATIONS_METHOD)
        except grpc.RpcError as exc:
            return HealthStatus(False, _rpc_failure(addr, "ListApplications", exc))
        try:
            names = tuple(messages["ListApplicationsResponse"].FromString(raw).application_names)
        except Exception as exc:
            return HealthStatus(False, f"{addr}: ListApplications returned a malformed response ({_one_line(exc)})")
    listed = ", ".join(repr(n) for n in names) or "none"
    if application not in names:
        return HealthStatus(False, f"{addr}: the Serve proxy is up but application {application!r} is not "
                                   f"deployed (applications: {listed})", names)
    return HealthStatus(True, f"{addr}: application {application!r} is served "
                              f"(proxy: {_one_line(proxy_message) or 'OK'}; applications: {listed})", names)


def wait_served(addr: str, application: str = DEFAULT_APPLICATION, timeout_s: float = 30.0,
                interval_s: float = 0.1) -> HealthStatus:
    """Ask ``check_health`` until the proxy is healthy and serves ``application``, or ``timeout_s``
    has passed; the last answer. ``serve.run`` returns once the app's replicas run, but the proxy
    learns its routes by a long poll of its own: a mesh is ready when its proxy routes the app."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        status = check_health(addr, application, timeout=max(0.05, min(DEFAULT_TIMEOUT_S, left)))
        if status.healthy or time.monotonic() + interval_s >= deadline:
            return status
        time.sleep(interval_s)
