"""The front door: a gRPC gateway in front of Ray Serve's (plaintext, loopback-only) gRPC proxy.

Ray Serve's gRPC proxy binds an insecure port only, and has no caps of its own. `draftmesh serve`
always runs the Serve proxy on a loopback port (``loopback``) and puts this gateway on the public
port: it terminates TLS (when given a certificate and key; plaintext otherwise) and forwards every
call, byte for byte, to the proxy. Before forwarding it refuses, without reading the message body:
  * every call while the app is not deployed yet (UNAVAILABLE "starting", our words, not Ray's
    NOT_FOUND "Application metadata not set");
  * a call without a valid bearer key (UNAUTHENTICATED), when keys are configured: the refusal is answered from the headers, so a 64 MiB unauthenticated message is never
    buffered (the router checks the key again: it also serves the HTTP face);
and it bounds the calls in flight (``max_concurrent_rpcs``: RESOURCE_EXHAUSTED beyond) and the
message size, and pins Ray Serve's ``application`` metadata to our app (a client cannot reach
another Serve app of the cluster through our port).

Forwarding is generic: a single `grpc.GenericRpcHandler` answers every method name and
never parses a message (identity serializers on both sides). A generic handler cannot
know a method's streaming kind from the wire, so the kinds are read from the generated
descriptors of our protos (`Generation.Generate` is server-streaming, and so on);
anything not found there (Ray Serve's own `RayServeAPIService/ListApplications` and
`Healthz`, for instance) is forwarded as unary-unary.

What is forwarded, in both directions:
  * invocation metadata (`authorization`, Ray Serve's `application`, `request_id`,
    `multiplexed_model_id`, ...) minus pseudo and transport-reserved headers;
  * the client's remaining deadline, as the upstream call's timeout;
  * cancellation: a client that cancels (or whose deadline passes) cancels the upstream
    call;
  * the upstream's initial metadata, status code, details and trailing metadata, exactly.

Use `await gateway.start()` / `await gateway.stop(grace)` from asyncio code, or
`gateway.run_in_thread()` from synchronous code (it returns a handle with `.port` and
`.stop()`).
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from draftmesh.auth import ApiKeyAuth
from draftmesh.v1 import draft_source_pb2, generation_pb2

log = logging.getLogger(__name__)

UNARY_UNARY = "unary_unary"
UNARY_STREAM = "unary_stream"
STREAM_UNARY = "stream_unary"
STREAM_STREAM = "stream_stream"

# Generous, but bounded: this port is public. Prompts plus inline documents are far smaller.
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024

# Headers the gRPC runtime owns (or that only make sense on one hop); never forwarded.
_RESERVED_HEADERS = frozenset(
    {"content-type", "te", "host", "user-agent", "connection", "transfer-encoding", "upgrade"}
)
# Ray Serve's routing header: which Serve application a call goes to (pinned by the gateway).
APPLICATION_HEADER = "application"
STARTING = "draftmesh is starting: the application is not deployed yet; retry shortly"
# Ray Serve's own health methods answer without a key (container health checks carry none).
UNAUTHENTICATED_METHODS = frozenset(
    {"/ray.serve.RayServeAPIService/Healthz", "/ray.serve.RayServeAPIService/ListApplications"}
)

# The one `grpc-` header applications legitimately set: rich error details (google.rpc.Status).
_ALLOWED_GRPC_HEADERS = frozenset({"grpc-status-details-bin"})


class TlsConfigError(ValueError):
    """A TLS certificate or key file that cannot be used (missing, unreadable, not PEM, ...)."""


# --------------------------------------------------------------------------- method kinds


def _default_file_descriptors() -> list[Any]:
    descriptors = [generation_pb2.DESCRIPTOR, draft_source_pb2.DESCRIPTOR]
    # Ray Serve can enable server reflection on its proxy; its one method is bidi-streaming.
    for module in ("grpc_reflection.v1alpha.reflection_pb2", "grpc_reflection.v1.reflection_pb2"):
        try:
            descriptors.append(__import__(module, fromlist=["DESCRIPTOR"]).DESCRIPTOR)
        except Exception:  # noqa: BLE001 - optional package
            pass
    return descriptors


def method_kinds(file_descriptors: Iterable[Any] | None = None) -> dict[str, str]:
    """Full method name ("/pkg.Service/Method") -> streaming kind, from proto file descriptors.

    Defaults to draftmesh's own protos (plus gRPC reflection when installed).
    """
    if file_descriptors is None:
        file_descriptors = _default_file_descriptors()
    kinds: dict[str, str] = {}
    for file_descriptor in file_descriptors:
        for service in file_descriptor.services_by_name.values():
            for method in service.methods:
                client, server = bool(method.client_streaming), bool(method.server_streaming)
                kind = {
                    (False, False): UNARY_UNARY,
                    (False, True): UNARY_STREAM,
                    (True, False): STREAM_UNARY,
                    (True, True): STREAM_STREAM,
                }[(client, server)]
                kinds[f"/{service.full_name}/{method.name}"] = kind
    return kinds


def server_streaming_methods(file_descriptors: Iterable[Any] | None = None) -> frozenset[str]:
    """Full names of the server-streaming methods (e.g. "/draftmesh.v1.Generation/Generate")."""
    return frozenset(
        name for name, kind in method_kinds(file_descriptors).items() if kind in (UNARY_STREAM, STREAM_STREAM)
    )


# --------------------------------------------------------------------------- metadata


def _forwardable(metadata: Iterable[Any] | None, application: str | None = None) -> tuple[tuple[str, Any], ...]:
    """Metadata minus pseudo headers (":path"), transport headers and reserved `grpc-*` keys.

    ``application``: the Serve app every call goes to; a client's own ``application`` headers are
    dropped and this one is set (None: forwarded as they came)."""
    out: list[tuple[str, Any]] = []
    for item in metadata or ():
        key, value = item[0], item[1]
        k = key.lower()
        if k.startswith(":") or k in _RESERVED_HEADERS:
            continue
        if k.startswith("grpc-") and k not in _ALLOWED_GRPC_HEADERS:
            continue
        if application is not None and k == APPLICATION_HEADER:
            continue
        out.append((k, value))
    if application is not None:
        out.append((APPLICATION_HEADER, application))
    return tuple(out)


def _refusal(code: grpc.StatusCode, details: str) -> grpc.RpcMethodHandler:
    """A handler that refuses a call from its headers alone: declared request-streaming so that
    gRPC hands it over before reading any message (a unary handler would first receive the whole
    body, up to the size cap), and it never reads one."""

    async def refuse(requests: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, details)

    return grpc.stream_stream_rpc_method_handler(refuse)


# --------------------------------------------------------------------------- the gateway


class _ForwardingHandler(grpc.GenericRpcHandler):
    def __init__(self, gateway: TlsGateway):
        self._gateway = gateway

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        gw = self._gateway
        refused = gw._refuse(method, handler_call_details.invocation_metadata)
        if refused is not None:
            return _refusal(*refused)
        kind = gw.kinds.get(method, UNARY_UNARY)
        # No (de)serializers: requests and responses stay bytes end to end.
        if kind == UNARY_STREAM:

            async def unary_stream(request: bytes, context: grpc.aio.ServicerContext) -> None:
                await gw._forward_stream(method, UNARY_STREAM, request, context)

            return grpc.unary_stream_rpc_method_handler(unary_stream)
        if kind == STREAM_UNARY:

            async def stream_unary(requests: Any, context: grpc.aio.ServicerContext) -> bytes | None:
                return await gw._forward_unary(method, STREAM_UNARY, requests, context)

            return grpc.stream_unary_rpc_method_handler(stream_unary)
        if kind == STREAM_STREAM:

            async def stream_stream(requests: Any, context: grpc.aio.ServicerContext) -> None:
                await gw._forward_stream(method, STREAM_STREAM, requests, context)

            return grpc.stream_stream_rpc_method_handler(stream_stream)

        async def unary_unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes | None:
            return await gw._forward_unary(method, UNARY_UNARY, request, context)

        return grpc.unary_unary_rpc_method_handler(unary_unary)


class TlsGateway:
    """Terminates TLS on `host:port` and forwards every gRPC call to `upstream` (plaintext).

    `cert_pem` and `key_pem` both None: the public port is plaintext too (the checks still apply).
    `auth`: the bearer keys calls must present (None or no keys: no check). `application`: the
    Serve app every call is pinned to (None: the client's header is forwarded). `ready=False`:
    every call answers UNAVAILABLE "starting" until `set_ready()`. `upstream=None` (only with
    `ready=False`): the upstream is named later (`connect`), once it can be chosen: the mesh picks
    Serve's proxy port after Ray's node is up, so that none of Ray's own processes takes it first.
    `port=0` picks a free port; the bound port is `.port` after `start()`.
    `extra_descriptors` adds proto file descriptors whose streaming methods must be known
    (methods not described anywhere are forwarded as unary-unary).
    """

    def __init__(
        self,
        upstream: str | None,
        port: int,
        cert_pem: bytes | None,
        key_pem: bytes | None,
        *,
        host: str = "[::]",
        max_concurrent_rpcs: int | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        extra_descriptors: Sequence[Any] = (),
        auth: ApiKeyAuth | None = None,
        application: str | None = None,
        ready: bool = True,
    ):
        if upstream is None and ready:
            raise ValueError("upstream: needed for a gateway that is ready from the start")
        if upstream is not None and not upstream:
            raise ValueError("upstream: must be a host:port address")
        if not 0 <= int(port) <= 65535:
            raise ValueError(f"port: must be in [0, 65535], got {port}")
        if (cert_pem is None) != (key_pem is None) or (cert_pem is not None and (not cert_pem or not key_pem)):
            raise TlsConfigError("TLS gateway needs both a PEM certificate chain and a PEM private key")
        if int(max_message_bytes) < 1:
            raise ValueError(f"max_message_bytes: must be >= 1, got {max_message_bytes}")
        if max_concurrent_rpcs is not None and max_concurrent_rpcs < 1:
            raise ValueError(f"max_concurrent_rpcs: must be >= 1, got {max_concurrent_rpcs}")
        self.upstream = upstream
        self.host = host
        self._requested_port = int(port)
        self._cert_pem = None if cert_pem is None else bytes(cert_pem)
        self._key_pem = None if key_pem is None else bytes(key_pem)
        self._auth = auth if auth is not None and auth.enabled else None
        self.application = application
        self._ready = bool(ready)
        self._max_concurrent_rpcs = max_concurrent_rpcs
        self._max_message_bytes = int(max_message_bytes)
        self.kinds: dict[str, str] = method_kinds()
        if extra_descriptors:
            self.kinds.update(method_kinds(extra_descriptors))
        self._server: grpc.aio.Server | None = None
        self._channel: grpc.aio.Channel | None = None
        self._port: int | None = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def port(self) -> int:
        """The bound port (the requested one, or the one picked for port 0)."""
        if self._port is None:
            raise RuntimeError("TlsGateway.port is known only after start()")
        return self._port

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def tls(self) -> bool:
        return self._cert_pem is not None

    @property
    def ready(self) -> bool:
        return self._ready

    def set_ready(self, ready: bool = True) -> None:
        """From now on calls are forwarded (False: answered "starting" again). Thread-safe: a flag."""
        if ready and self.upstream is None:
            raise RuntimeError("the gateway has no upstream yet: connect() first")
        self._ready = bool(ready)

    async def connect(self, upstream: str) -> None:
        """Forward to ``upstream`` from now on (a gateway started without one, or moved). Runs on
        the gateway's event loop (``GatewayThread.connect`` from other threads)."""
        if not upstream:
            raise ValueError("upstream: must be a host:port address")
        old, self.upstream = self._channel, upstream
        self._channel = self._upstream_channel() if self._server is not None else None
        if old is not None:
            await old.close()

    def _refuse(self, method: str, metadata: Any) -> tuple[grpc.StatusCode, str] | None:
        """(code, details) when a call is refused from its method and headers alone, else None."""
        if not self._ready:
            return grpc.StatusCode.UNAVAILABLE, STARTING
        if self._auth is not None and method not in UNAUTHENTICATED_METHODS:
            reason = self._auth.check(metadata)
            if reason is not None:
                return grpc.StatusCode.UNAUTHENTICATED, reason
        return None

    @property
    def server_streaming(self) -> frozenset[str]:
        return frozenset(m for m, k in self.kinds.items() if k in (UNARY_STREAM, STREAM_STREAM))

    def _options(self) -> list[tuple[str, int]]:
        return [
            ("grpc.max_send_message_length", self._max_message_bytes),
            ("grpc.max_receive_message_length", self._max_message_bytes),
        ]

    def _upstream_channel(self) -> grpc.aio.Channel | None:
        """A channel to the upstream (None while it is not named yet: ``connect``)."""
        return grpc.aio.insecure_channel(self.upstream, options=self._options()) if self.upstream is not None else None

    async def start(self) -> int:
        """Binds the TLS port, connects to the upstream and starts serving; returns the port."""
        if self._server is not None:
            raise RuntimeError("TlsGateway already started")
        credentials = None
        if self.tls:
            try:
                credentials = grpc.ssl_server_credentials([(self._key_pem, self._cert_pem)])
            except Exception as exc:  # noqa: BLE001
                raise TlsConfigError(f"unusable TLS certificate/key: {exc}") from exc
        server = grpc.aio.server(
            maximum_concurrent_rpcs=self._max_concurrent_rpcs,
            # No SO_REUSEPORT: a port already in use must be an error, not a silent share.
            options=[*self._options(), ("grpc.so_reuseport", 0)],
        )
        server.add_generic_rpc_handlers((_ForwardingHandler(self),))
        address = f"{self.host}:{self._requested_port}"
        try:
            bound = (server.add_secure_port(address, credentials) if credentials is not None
                     else server.add_insecure_port(address))
        except RuntimeError as exc:
            raise OSError(f"TLS gateway could not bind {address}: {exc}") from exc
        if not bound:
            raise OSError(f"TLS gateway could not bind {address} (in use, or bad certificate/key?)")
        self._channel = self._upstream_channel()
        try:
            await server.start()
        except Exception:
            if self._channel is not None:
                await self._channel.close()
            self._channel = None
            raise
        self._server = server
        self._port = bound
        log.info("gateway (%s) listening on %s:%d, forwarding to %s", "TLS" if self.tls else "plaintext",
                 self.host, bound, self.upstream)
        return bound

    async def stop(self, grace: float | None = None) -> None:
        """Stops accepting calls; in-flight calls get `grace` seconds (None: cancelled now)."""
        server, channel = self._server, self._channel
        self._server = self._channel = None
        if server is not None:
            await server.stop(grace)
        if channel is not None:
            await channel.close()

    async def wait_for_termination(self, timeout: float | None = None) -> bool:
        if self._server is None:
            return True
        return await self._server.wait_for_termination(timeout)

    def run_in_thread(self, *, start_timeout: float = 30.0) -> GatewayThread:
        """Runs the gateway on its own event loop in a daemon thread (for synchronous callers).

        Returns once the port is bound (so `.port` is valid); start-up errors are re-raised here.
        """
        return GatewayThread(self, start_timeout=start_timeout)

    # ------------------------------------------------------------------ forwarding

    def _upstream_callable(self, method: str, kind: str) -> Any:
        channel = self._channel
        if channel is None:
            raise RuntimeError("TlsGateway is not running" if self._server is None else "TlsGateway has no upstream")
        factory = {
            UNARY_UNARY: channel.unary_unary,
            UNARY_STREAM: channel.unary_stream,
            STREAM_UNARY: channel.stream_unary,
            STREAM_STREAM: channel.stream_stream,
        }[kind]
        return factory(method)  # no serializers: bytes in, bytes out

    def _call_kwargs(self, context: grpc.aio.ServicerContext) -> dict[str, Any]:
        # time_remaining() is None when the client set no deadline.
        return {
            "metadata": _forwardable(context.invocation_metadata(), self.application),
            "timeout": context.time_remaining(),
        }

    @staticmethod
    async def _relay_initial_metadata(call: Any, context: grpc.aio.ServicerContext) -> None:
        initial = _forwardable(await call.initial_metadata())
        if initial:
            await context.send_initial_metadata(initial)

    @staticmethod
    async def _relay_error(error: grpc.aio.AioRpcError, context: grpc.aio.ServicerContext) -> None:
        if error.code() == grpc.StatusCode.OK:  # cannot happen, but abort() refuses OK
            return
        await context.abort(error.code(), error.details() or "", _forwardable(error.trailing_metadata()))

    async def _forward_unary(self, method: str, kind: str, request: Any, context: grpc.aio.ServicerContext) -> Any:
        call = self._upstream_callable(method, kind)(request, **self._call_kwargs(context))
        try:
            try:
                response = await call
            except grpc.aio.AioRpcError as error:
                await self._relay_initial_metadata(call, context)
                await self._relay_error(error, context)
                return None
            await self._relay_initial_metadata(call, context)
            context.set_trailing_metadata(_forwardable(await call.trailing_metadata()))
            return response
        finally:
            if not call.done():  # client cancelled / deadline passed / gateway stopping
                call.cancel()

    async def _forward_stream(self, method: str, kind: str, request: Any, context: grpc.aio.ServicerContext) -> None:
        call = self._upstream_callable(method, kind)(request, **self._call_kwargs(context))
        try:
            try:
                await self._relay_initial_metadata(call, context)
                async for response in call:
                    await context.write(response)
            except grpc.aio.AioRpcError as error:
                await self._relay_error(error, context)
                return
            context.set_trailing_metadata(_forwardable(await call.trailing_metadata()))
        finally:
            if not call.done():
                call.cancel()


class GatewayThread:
    """A `TlsGateway` running on a private event loop in a daemon thread."""

    def __init__(self, gateway: TlsGateway, *, start_timeout: float = 30.0):
        self.gateway = gateway
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="draftmesh-tls-gateway", daemon=True)
        self._thread.start()
        if not self._started.wait(start_timeout):
            self.stop(0)
            raise TimeoutError(f"TLS gateway did not start within {start_timeout}s")
        if self._error is not None:
            self._thread.join()
            raise self._error

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            try:
                self._loop.run_until_complete(self.gateway.start())
            except BaseException as exc:  # noqa: BLE001 - re-raised in the starting thread
                self._error = exc
                return
            finally:
                self._started.set()
            self._loop.run_forever()
        finally:
            try:
                self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            finally:
                self._loop.close()

    @property
    def port(self) -> int:
        return self.gateway.port

    @property
    def address(self) -> str:
        return self.gateway.address

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def set_ready(self, ready: bool = True) -> None:
        """See `TlsGateway.set_ready`."""
        self.gateway.set_ready(ready)

    def connect(self, upstream: str, timeout: float = 10.0) -> None:
        """See `TlsGateway.connect`: run on the gateway's loop, waited for."""
        asyncio.run_coroutine_threadsafe(self.gateway.connect(upstream), self._loop).result(timeout)

    def stop(self, grace: float | None = None, timeout: float | None = 30.0) -> None:
        """Stops the gateway (in-flight calls get `grace` seconds) and joins the thread. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        if self._thread.is_alive() and not self._loop.is_closed():
            future = asyncio.run_coroutine_threadsafe(self.gateway.stop(grace), self._loop)
            try:
                future.result(timeout)
            except Exception:  # noqa: BLE001 - stopping anyway
                log.exception("TLS gateway did not stop cleanly")
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)

    def join(self, timeout: float | None = None) -> None:
        """Blocks until the gateway thread exits (after `stop()`)."""
        self._thread.join(timeout)

    def __enter__(self) -> GatewayThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(0)


# --------------------------------------------------------------------------- TLS files

_CERT_RE = re.compile(rb"-----BEGIN CERTIFICATE-----")
_KEY_RE = re.compile(rb"-----BEGIN (?:RSA |EC |DSA )?PRIVATE KEY-----")
_ENCRYPTED_RE = re.compile(rb"-----BEGIN ENCRYPTED PRIVATE KEY-----|Proc-Type:\s*4,\s*ENCRYPTED")


def _read_pem_file(path: str | Path, what: str) -> bytes:
    p = Path(path).expanduser()
    if not str(path):
        raise TlsConfigError(f"TLS {what} path is empty")
    if not p.exists():
        raise TlsConfigError(f"TLS {what} file not found: {p}")
    if p.is_dir():
        raise TlsConfigError(f"TLS {what} path is a directory, not a file: {p}")
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise TlsConfigError(f"TLS {what} file {p} cannot be read: {exc.strerror or exc}") from exc
    if not data.strip():
        raise TlsConfigError(f"TLS {what} file {p} is empty")
    return data


def load_tls_files(cert_path: str | Path, key_path: str | Path) -> tuple[bytes, bytes]:
    """Reads and checks a PEM certificate chain and its PEM private key; returns (cert_pem, key_pem).

    Raises `TlsConfigError` (a ValueError) naming the file and the problem: missing,
    unreadable, empty, not PEM, an encrypted key, or (when `cryptography` is installed)
    an unparsable certificate/key or a key that does not match the certificate.
    """
    cert_pem = _read_pem_file(cert_path, "certificate")
    key_pem = _read_pem_file(key_path, "private key")
    if not _CERT_RE.search(cert_pem):
        hint = " (it looks like a private key; are cert and key swapped?)" if _KEY_RE.search(cert_pem) else ""
        raise TlsConfigError(
            f"TLS certificate file {cert_path} is not PEM: no '-----BEGIN CERTIFICATE-----' block{hint}"
        )
    if _ENCRYPTED_RE.search(key_pem):
        raise TlsConfigError(f"TLS private key file {key_path} is encrypted; provide an unencrypted PEM key")
    if not _KEY_RE.search(key_pem):
        hint = " (it looks like a certificate; are cert and key swapped?)" if _CERT_RE.search(key_pem) else ""
        raise TlsConfigError(
            f"TLS private key file {key_path} is not PEM: no '-----BEGIN ... PRIVATE KEY-----' block{hint}"
        )
    _check_with_cryptography(cert_pem, key_pem, cert_path, key_path)
    return cert_pem, key_pem


def _check_with_cryptography(cert_pem: bytes, key_pem: bytes, cert_path: Any, key_path: Any) -> None:
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization
    except ImportError:  # optional: the PEM checks above still ran
        return
    try:
        certs = x509.load_pem_x509_certificates(cert_pem)
    except Exception as exc:  # noqa: BLE001
        raise TlsConfigError(f"TLS certificate file {cert_path} cannot be parsed: {exc}") from exc
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except Exception as exc:  # noqa: BLE001
        raise TlsConfigError(f"TLS private key file {key_path} cannot be parsed: {exc}") from exc
    fmt = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    if certs and certs[0].public_key().public_bytes(*fmt) != key.public_key().public_bytes(*fmt):
        raise TlsConfigError(
            f"TLS private key {key_path} does not match the (first) certificate in {cert_path}"
        )
