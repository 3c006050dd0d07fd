"""How the router refuses or fails a request, for both of its faces.

The router's steps (auth, validation, admission, the verifier call) raise ``RpcError`` with a gRPC
status code. The gRPC face sets that code and details on the call; the HTTP face answers the
OpenAI-style JSON error with the HTTP status the code maps to (``http_status``).
"""

from __future__ import annotations

import logging
import uuid

import grpc

log = logging.getLogger(__name__)


class RpcError(Exception):
    """Ends a request with ``code``; ``param`` names the request field at fault, if one is."""

    def __init__(self, code: grpc.StatusCode, details: str, param: str | None = None) -> None:
        super().__init__(code, details, param)  # all in args, so Ray can pickle it to the proxy
        self.code = code
        self.details = details
        self.param = param

    def __str__(self) -> str:
        return f"{self.code.name}: {self.details}"


def internal_error(exc: BaseException, request_id: str | None = None,
                   code: grpc.StatusCode = grpc.StatusCode.INTERNAL) -> RpcError:
    """The error a client gets for a failure that is not its fault: a generic message with a request
    id, never the exception's text (it can hold paths, addresses, other requests' data). The details
    are logged here with the same id, so an operator can find them from what the client saw."""
    rid = request_id or uuid.uuid4().hex
    log.error("request %s failed (%s): %r", rid, code.name, exc, exc_info=exc)
    what = "the server is unavailable" if code == grpc.StatusCode.UNAVAILABLE else "internal error"
    return RpcError(code, f"{what} (request id {rid}); the server's log has the details")


# (HTTP status, OpenAI error type, OpenAI error code) per gRPC code.
_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", "invalid_value"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error", "failed_precondition"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error", "invalid_value"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error", "invalid_api_key"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error", "permission_denied"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", "not_found"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.CANCELLED: (499, "cancelled", "cancelled"),
    grpc.StatusCode.UNIMPLEMENTED: (501, "server_error", "unimplemented"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error", "unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error", "deadline_exceeded"),
}


def http_status(code: grpc.StatusCode) -> tuple[int, str, str]:
    """(HTTP status, OpenAI error type, error code) for a gRPC code (anything else: 500)."""
    return _HTTP.get(code, (500, "server_error", "internal_error"))
