"""A draft source in another process, another machine or another language, over gRPC.

``GrpcDraftSource`` is a DraftSource whose ``propose`` calls ``draftmesh.v1.DraftSource/Propose``
(protos/draftmesh/v1/draft_source.proto) with a deadline. A slow, hung or dead server
therefore costs at most ``timeout_s`` per step and then raises; the verifier's
SourceCaller counts the source as failed for that step and the request goes on with the
other sources (a failing source degrades speed, never the output).

Token ids: an external source shares the target's tokenizer only when the user says so
(``token_ids: true`` in its config, ``token_ids_ok=True`` here). By default its id
proposals are dropped and only text proposals are used, since ids of another vocabulary
would be wrong drafts at best. Ids beyond the target vocabulary are dropped later by the
decoder. The request always names the target tokenizer (``tokenizer_name``), so a source
can decide for itself whether to answer in ids or in text.
"""

from __future__ import annotations

import logging
import threading

import grpc

from draftmesh import tracing
from draftmesh.auth import ApiKeyAuth, read_key_file
from draftmesh.config import RemoteSource
from draftmesh.draft import wire
from draftmesh.draft.base import DraftContext, Proposal
from draftmesh.v1 import draft_source_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

MAX_ANSWER_BYTES = 4 * 1024 * 1024
"""The largest ProposeResponse read from a remote source."""

LOG_EVERY = 100
"""While a source keeps failing the same way, one log line per this many failed calls."""

_CHANNEL_OPTIONS = (
    # A dead server is retried soon after it comes back, not after grpc's default
    # backoff of up to two minutes; calls in between fail fast (wait_for_ready=False).
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 5000),
    # What wire.proposals_from_proto keeps (64 proposals of 1024 ids or 32k characters) fits
    # in well under 4 MiB; a larger answer fails that call (the step drafts without it).
    ("grpc.max_receive_message_length", MAX_ANSWER_BYTES),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
)


class RemoteSourceError(RuntimeError):
    """A remote draft source did not answer usefully this time (``code``: the gRPC status, if any)."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


class GrpcDraftSource:
    """A DraftSource backed by a remote ``draftmesh.v1.DraftSource`` server at ``address``.

    One long-lived channel, opened on first use and shared by all threads (gRPC channels
    are thread-safe); ``close()`` drops it, a later ``propose`` opens a new one.
    """

    def __init__(
        self,
        name: str,
        address: str,
        *,
        tokenizer_name: str = "",
        timeout_s: float = 0.1,
        token_ids_ok: bool = False,
        secure: bool = False,
        root_certificates: bytes | None = None,
        api_key: str | None = None,
    ) -> None:
        if not name:
            raise ValueError("a remote draft source needs a name")
        if not address or ":" not in address:
            raise ValueError(f"remote draft source {name!r}: address must be host:port, got {address!r}")
        if not timeout_s > 0:
            raise ValueError(f"remote draft source {name!r}: timeout must be > 0 seconds, got {timeout_s}")
        if root_certificates is not None and not secure:
            raise ValueError(f"remote draft source {name!r}: root_certificates need secure=True")
        self.name = name
        self.address = address
        self.tokenizer_name = tokenizer_name
        self.timeout_s = float(timeout_s)
        self.token_ids_ok = token_ids_ok
        self.secure = secure
        self.root_certificates = root_certificates
        # Sent as ``authorization: Bearer <key>`` (draft-serve's and the router's check); never logged.
        self._metadata = (("authorization", f"Bearer {api_key.strip()}"),) if api_key and api_key.strip() else ()
        self._lock = threading.Lock()
        self._channel: grpc.Channel | None = None
        self._stub: pb_grpc.DraftSourceStub | None = None
        self.calls = 0
        self.failures = 0
        self._failing: str | None = None
        """The kind of the current run of failures (a status code name), None while healthy."""
        self._failing_count = 0

    @classmethod
    def from_spec(
        cls, name: str, spec: RemoteSource, *, tokenizer_name: str = "", default_timeout_s: float = 0.1
    ) -> GrpcDraftSource:
        """From its config entry (``sources.remote.<name>``: address, timeout_ms, token_ids, secure,
        root_certificates, a PEM file path that implies secure)."""
        if spec.address is None:
            raise ValueError(f"remote source {name!r}: no address")
        roots = None
        if spec.root_certificates is not None:
            with open(spec.root_certificates, "rb") as fh:
                roots = fh.read()
        api_key = None
        if spec.api_key_file is not None:
            keys = read_key_file(spec.api_key_file, f"sources.remote.{name}.api_key_file")
            if len(keys) != 1:
                raise ValueError(f"sources.remote.{name}.api_key_file={spec.api_key_file}: holds {len(keys)} keys, "
                                 "give the one to send")
            ApiKeyAuth(keys)  # the same checks as the server's: printable ASCII, no whitespace
            api_key = keys[0]
        return cls(
            name,
            spec.address,
            tokenizer_name=tokenizer_name,
            timeout_s=default_timeout_s if spec.timeout_ms is None else spec.timeout_ms / 1e3,
            token_ids_ok=spec.token_ids,
            secure=spec.secure or roots is not None,
            root_certificates=roots,
            api_key=api_key,
        )

    def _get_stub(self) -> pb_grpc.DraftSourceStub:
        with self._lock:
            if self._stub is None:
                if self.secure:
                    creds = grpc.ssl_channel_credentials(root_certificates=self.root_certificates)
                    self._channel = grpc.secure_channel(self.address, creds, options=_CHANNEL_OPTIONS)
                else:
                    self._channel = grpc.insecure_channel(self.address, options=_CHANNEL_OPTIONS)
                # traceparent in the call's metadata: the source's server span joins the step's trace
                self._stub = pb_grpc.DraftSourceStub(tracing.traced_channel(self._channel))
            return self._stub

    def propose(self, ctx: DraftContext) -> list[Proposal]:
        request = wire.context_to_proto(ctx, self.tokenizer_name)
        stub = self._get_stub()
        try:
            response = stub.Propose(request, timeout=self.timeout_s, wait_for_ready=False, metadata=self._metadata)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            details = exc.details() if hasattr(exc, "details") else str(exc)
            kind = code.name if code is not None else type(exc).__name__
            message = f"remote draft source {self.name!r} at {self.address}: {kind}: {details}"
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                message += f" (deadline {1e3 * self.timeout_s:.0f} ms)"
            self._failed(kind, message)
            raise RemoteSourceError(message, code) from None
        try:
            proposals = wire.proposals_from_proto(response, self.name, token_ids_ok=self.token_ids_ok)
        except (ValueError, TypeError) as exc:
            message = f"remote draft source {self.name!r} at {self.address}: bad response: {exc}"
            self._failed("bad response", message)
            raise RemoteSourceError(message) from None
        self._succeeded()
        return proposals

    def _failed(self, kind: str, message: str) -> None:
        with self._lock:
            self.calls += 1
            self.failures += 1
            if kind != self._failing:
                self._failing, self._failing_count = kind, 1
                log.warning("%s (logged again on change, or every %d failures)", message, LOG_EVERY)
                return
            self._failing_count += 1
            if self._failing_count % LOG_EVERY == 0:
                log.warning("%s (%d failures in a row)", message, self._failing_count)

    def _succeeded(self) -> None:
        with self._lock:
            self.calls += 1
            if self._failing is not None:
                log.info("remote draft source %r at %s answers again after %d failed calls",
                         self.name, self.address, self._failing_count)
                self._failing, self._failing_count = None, 0

    def close(self) -> None:
        with self._lock:
            channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            channel.close()

    def __enter__(self) -> GrpcDraftSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"GrpcDraftSource({self.name!r}, {self.address!r}, timeout_s={self.timeout_s}, token_ids_ok={self.token_ids_ok})"
