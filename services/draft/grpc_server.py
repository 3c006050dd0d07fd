"""Serve any DraftSource as ``draftmesh.v1.DraftSource`` over gRPC (``draftmesh draft-serve``).

Only ``Propose`` is exposed. A LearningSource's ``finish`` is not (the contract has no
call for it), so a history source served this way drafts from what its store already
holds and learns nothing new from requests.

The server is gRPC's synchronous one: up to ``max_workers`` calls run at once on a thread
pool, so the source must be thread-safe unless ``max_workers`` is 1.

It listens on loopback unless told otherwise. With API keys (``draftmesh.auth.ApiKeyAuth``,
the router's check) every call must carry ``authorization: Bearer <key>`` or is answered
UNAUTHENTICATED before the servicer runs; with server credentials the port speaks TLS only.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging

import grpc

from draftmesh import compute, tracing
from draftmesh.auth import ApiKeyAuth
from draftmesh.draft import wire
from draftmesh.draft.base import DraftSource, propose_on_compute
from draftmesh.v1 import draft_source_pb2 as pb
from draftmesh.v1 import draft_source_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

_SERVER_OPTIONS = (
    # A request carries the whole context and its documents.
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 16 * 1024 * 1024),
)


class DraftSourceServicer(pb_grpc.DraftSourceServicer):
    """``Propose`` for one wrapped source: proto -> DraftContext -> proposals -> proto."""

    def __init__(self, source: DraftSource) -> None:
        self.source = source

    def Propose(self, request: pb.ProposeRequest, context: grpc.ServicerContext) -> pb.ProposeResponse:
        try:
            ctx = wire.context_from_proto(request)
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            proposals = propose_on_compute(self.source, ctx)
        except Exception as exc:
            log.exception("draft source %s failed on request %r", self.source.name, request.request_id)
            context.abort(grpc.StatusCode.INTERNAL, f"draft source {self.source.name!r} failed: {_short(exc)}")
        return wire.proposals_to_proto(self.source.name, proposals)


class _AuthInterceptor(grpc.ServerInterceptor):
    """Refuses, UNAUTHENTICATED, every call whose metadata ``auth`` does not accept."""

    def __init__(self, auth: ApiKeyAuth) -> None:
        self.auth = auth

    def intercept_service(self, continuation, handler_call_details):
        reason = self.auth.check(handler_call_details.invocation_metadata)
        if reason is None:
            return continuation(handler_call_details)

        def refuse(request, context: grpc.ServicerContext):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

        return grpc.unary_unary_rpc_method_handler(refuse)


def _short(exc: BaseException, limit: int = 200) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def serve_source(
    source: DraftSource,
    port: int = 0,
    *,
    host: str = "127.0.0.1",
    max_workers: int = 4,
    server_credentials: grpc.ServerCredentials | None = None,
    auth: ApiKeyAuth | None = None,
) -> tuple[grpc.Server, int]:
    """Start a gRPC server for ``source`` on ``host:port`` (0: any free port).

    ``auth``: API keys every call must present (None or no keys: no check).

    Returns the started server and the bound port; stop it with ``server.stop(grace)``.
    """
    if max_workers < 1:
        raise ValueError(f"max_workers must be >= 1, got {max_workers}")
    server = grpc.server(
        cf.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=f"draft-serve-{source.name}",
                              initializer=compute.confine_side_thread),  # see draftmesh.compute
        options=_SERVER_OPTIONS,
        # The key check first: a refused call never reaches the tracing or the source.
        interceptors=([_AuthInterceptor(auth)] if auth is not None and auth.enabled else [])
        + list(tracing.server_interceptors()),
    )
    pb_grpc.add_DraftSourceServicer_to_server(DraftSourceServicer(source), server)
    bind = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    try:
        if server_credentials is not None:
            bound = server.add_secure_port(bind, server_credentials)
        else:
            bound = server.add_insecure_port(bind)
    except RuntimeError as exc:
        raise ValueError(f"cannot listen on {bind}: {exc}") from None
    if not bound:
        raise ValueError(f"cannot listen on {bind}")
    server.start()
    log.info("draft source %s listening on %s", source.name, bind.rsplit(":", 1)[0] + f":{bound}")
    return server, bound
