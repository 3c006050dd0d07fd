"""Keep Ray Serve's plaintext gRPC servers on loopback, so that the gateway cannot be bypassed.

Ray Serve 2.60 binds its gRPC proxy on ``[::]:port`` and every replica's inter-deployment gRPC
server on ``[::]:0``, with no option to choose the host. Both speak plaintext and skip our
gateway's checks (TLS, the concurrency cap, the size cap, the pinned application), so anyone who
can reach this machine's network address could call the app directly.

We considered a firewall rule (needs root and differs per platform; forgotten in one deployment
means open) and serving the proxy in a network namespace (root again, and Ray's workers cannot be
moved). Instead a Ray ``worker_process_setup_hook`` (``install``) runs in every worker process of
the private cluster that ``draftmesh serve`` starts, before any actor code, and rewrites the two
wildcard addresses to ``127.0.0.1``. It is a patch of two Ray functions by name: ``launcher``
checks the effect at start-up (``wildcard_listeners``) and refuses to serve if a Ray upgrade made
it a no-op, so the failure mode is a clear error, not a silent bypass.
"""

from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"
HOOK = "draftmesh.router.loopback.install"
"""The import path to give as ``runtime_env["worker_process_setup_hook"]``."""


def loopback_address(address: str) -> str:
    """``[::]:9000`` / ``0.0.0.0:9000`` -> ``127.0.0.1:9000``; any other address unchanged."""
    host, sep, port = address.rpartition(":")
    if sep and host in ("[::]", "0.0.0.0", "", "[::0]"):
        return f"{LOOPBACK}:{port}"
    return address


def install() -> None:
    """The setup hook: patch Ray Serve's gRPC bind helpers in this worker process (idempotent)."""
    from ray.serve._private import default_impl, replica

    if getattr(default_impl.add_grpc_address, "_draftmesh_loopback", False):
        return
    proxy_bind = default_impl.add_grpc_address  # the proxy imports it by name at call time
    replica_bind = replica.add_port_to_grpc_server  # imported into the replica module at load

    def add_grpc_address(server, server_address: str):
        return proxy_bind(server, loopback_address(server_address))

    def add_port_to_grpc_server(server, address: str):
        return replica_bind(server, loopback_address(address))

    add_grpc_address._draftmesh_loopback = True  # type: ignore[attr-defined]
    add_port_to_grpc_server._draftmesh_loopback = True  # type: ignore[attr-defined]
    default_impl.add_grpc_address = add_grpc_address
    replica.add_port_to_grpc_server = add_port_to_grpc_server


def reachable(host: str, port: int, timeout: float = 1.0) -> bool:
    """Whether a TCP connection to ``host:port`` succeeds."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def non_loopback_addresses() -> list[str]:
    """This machine's IPv4 addresses that are not loopback (best effort: the default route's, plus
    the host name's)."""
    found: list[str] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: a UDP connect sends nothing
            found.append(s.getsockname()[0])
        except OSError:
            pass
    try:
        found.extend(info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET))
    except OSError:
        pass
    return sorted({a for a in found if not a.startswith("127.") and a != "0.0.0.0"})


def exposed_on(port: int) -> list[str]:
    """The non-loopback addresses of this machine on which ``port`` accepts connections."""
    return [addr for addr in non_loopback_addresses() if reachable(addr, port)]
