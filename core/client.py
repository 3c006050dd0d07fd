"""The Python client of the draftmesh gRPC service (used by `draftmesh generate`, the demos and the bench).

```python
from draftmesh.client import MeshClient, build_request

with MeshClient("localhost:9000", api_key="...") as client:
    result = client.complete(build_request("Fix the typos: teh cat", max_new_tokens=32))
    for response in client.generate(build_request(messages=[{"role": "user", "content": "hi"}])):
        if response.HasField("delta"):
            print(response.delta.text, end="", flush=True)
```

`tls_ca` (PEM bytes) switches to a TLS channel that trusts that CA (the server's
self-signed certificate works too); `tls=True` uses the system roots.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import grpc

from draftmesh import tracing
from draftmesh.v1 import generation_pb2 as pb
from draftmesh.v1 import generation_pb2_grpc as pb_grpc

DEFAULT_ADDR = "localhost:9000"
API_KEY_ENV = "DRAFTMESH_API_KEY"
"""Where the command-line clients (`draftmesh generate`, the bench) take an API key from when no flag gives one."""
_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


# --------------------------------------------------------------------------- requests


def _chat_message(message: Any, index: int) -> pb.ChatMessage:
    if isinstance(message, pb.ChatMessage):
        return message
    if isinstance(message, Mapping):
        role, content = message.get("role"), message.get("content")
    elif isinstance(message, Sequence) and not isinstance(message, (str, bytes)) and len(message) == 2:
        role, content = message
    else:
        raise ValueError(f"messages[{index}]: expected {{'role': ..., 'content': ...}}, got {message!r}")
    if not isinstance(role, str) or not isinstance(content, str):
        raise ValueError(f"messages[{index}]: role and content must be strings")
    return pb.ChatMessage(role=role, content=content)


def _document(document: Any, index: int) -> pb.Document:
    if isinstance(document, pb.Document):
        return document
    if isinstance(document, str):
        return pb.Document(id=str(index), text=document)
    if isinstance(document, Mapping):
        return pb.Document(id=str(document.get("id", index)), text=str(document.get("text", "")))
    if isinstance(document, Sequence) and len(document) == 2:
        return pb.Document(id=str(document[0]), text=str(document[1]))
    raise ValueError(f"documents[{index}]: expected a string, (id, text) or {{'id', 'text'}}, got {document!r}")


def _stop_bytes(stop: str | bytes) -> bytes:
    if isinstance(stop, (bytes, bytearray)):
        return bytes(stop)
    if isinstance(stop, str):
        return stop.encode("utf-8")
    raise ValueError(f"stop: expected str or bytes, got {type(stop).__name__}")


def _source_list(sources: str | Iterable[str]) -> list[str]:
    if isinstance(sources, str):
        sources = sources.split(",")
    return [s.strip() for s in sources if s and s.strip()]


def build_request(
    prompt: str | None = None,
    *,
    messages: Sequence[Any] | None = None,
    max_new_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: Iterable[str | bytes] = (),
    session_id: str = "",
    documents: Iterable[Any] = (),
    speculate: bool | None = None,
    sources: str | Iterable[str] = (),
    max_nodes: int | None = None,
    policy: str = "",
    policy_params: Mapping[str, Any] | None = None,
    source_caps: Mapping[str, int] | None = None,
    request_id: str = "",
    factcheck: bool | None = None,
    factcheck_wait_ms: int | None = None,
) -> pb.GenerateRequest:
    """A `GenerateRequest` from plain Python values.

    Exactly one of `prompt` (raw text) or `messages` (dicts {role, content}, (role, content)
    pairs or ChatMessage) must be given. Unset (None) options stay unset on the wire so the
    server's defaults apply. Stop strings are UTF-8 encoded; `sources` is a list or a
    comma-separated string; documents are strings (ids "0", "1", ...), (id, text) pairs,
    {id, text} dicts or Document messages. The server does the real validation.
    """
    if prompt is not None and messages is not None:
        raise ValueError("give exactly one of prompt or messages, not both")
    if prompt is None and messages is None:
        raise ValueError("give exactly one of prompt or messages")
    req = pb.GenerateRequest(session_id=session_id or "", request_id=request_id or "")
    if prompt is not None:
        req.prompt = prompt
    else:
        req.messages.extend(_chat_message(m, i) for i, m in enumerate(messages or ()))
    if max_new_tokens is not None:
        req.max_new_tokens = int(max_new_tokens)
    if temperature is not None:
        req.temperature = float(temperature)
    if top_p is not None:
        req.top_p = float(top_p)
    if top_k is not None:
        req.top_k = int(top_k)
    if seed is not None:
        if int(seed) < 0:
            raise ValueError(f"seed: must be >= 0, got {seed}")
        req.seed = int(seed)
    req.stop.extend(_stop_bytes(s) for s in stop or ())
    req.documents.extend(_document(d, i) for i, d in enumerate(documents or ()))

    spec_sources = _source_list(sources or ())
    if speculate is not None:
        req.speculation.enabled = bool(speculate)
    if spec_sources:
        req.speculation.sources.extend(spec_sources)
    if max_nodes is not None:
        if int(max_nodes) < 0:
            raise ValueError(f"max_nodes: must be >= 0, got {max_nodes}")
        req.speculation.max_nodes = int(max_nodes)
    if policy:
        req.speculation.policy = policy
    for key, value in (policy_params or {}).items():
        req.speculation.policy_params[str(key)] = str(value)
    for key, value in (source_caps or {}).items():
        req.speculation.source_caps[str(key)] = int(value)
    if factcheck is not None:
        req.factcheck.enabled = bool(factcheck)
    if factcheck_wait_ms is not None:
        if int(factcheck_wait_ms) < 0:
            raise ValueError(f"factcheck_wait_ms: must be >= 0, got {factcheck_wait_ms}")
        req.factcheck.wait_ms = int(factcheck_wait_ms)
    return req


# --------------------------------------------------------------------------- the client


class MeshClient:
    """A synchronous client of `draftmesh.v1.Generation`.

    `api_key` is sent as `authorization: Bearer <key>`; `application` as Ray Serve's
    `application` metadata (needed only when several Serve apps share the proxy);
    `timeout_s` is the default per-call deadline (None: no deadline).
    """

    def __init__(
        self,
        addr: str = DEFAULT_ADDR,
        *,
        api_key: str | None = None,
        tls_ca: bytes | None = None,
        tls: bool = False,
        tls_server_name: str | None = None,
        timeout_s: float | None = None,
        application: str | None = None,
        metadata: Sequence[tuple[str, str | bytes]] = (),
        options: Sequence[tuple[str, Any]] = (),
    ):
        self.addr = addr
        self.timeout_s = timeout_s
        md: list[tuple[str, str | bytes]] = []
        if api_key:
            md.append(("authorization", f"Bearer {api_key}"))
        if application:
            md.append(("application", application))
        md.extend((k.lower(), v) for k, v in metadata)
        self._metadata = tuple(md)
        opts: list[tuple[str, Any]] = [
            ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
        ]
        if tls_server_name:
            opts.append(("grpc.ssl_target_name_override", tls_server_name))
        opts.extend(options)
        if tls_ca is not None or tls:
            credentials = grpc.ssl_channel_credentials(root_certificates=tls_ca)
            self._channel = grpc.secure_channel(addr, credentials, options=opts)
        else:
            self._channel = grpc.insecure_channel(addr, options=opts)
        # With tracing on in this process, each call sends its traceparent: the mesh's trace
        # continues this client's.
        self._stub = pb_grpc.GenerationStub(tracing.traced_channel(self._channel))

    def _call_args(self, timeout_s: float | None, metadata: Sequence[tuple[str, Any]]) -> dict[str, Any]:
        timeout = self.timeout_s if timeout_s is None else timeout_s
        return {"timeout": timeout, "metadata": self._metadata + tuple(metadata)}

    def generate(
        self,
        request: pb.GenerateRequest,
        *,
        timeout_s: float | None = None,
        metadata: Sequence[tuple[str, Any]] = (),
    ) -> Iterator[pb.GenerateResponse]:
        """Streams `GenerateResponse`s: deltas as steps complete, then one result.

        The returned iterator is the gRPC call: `.cancel()` stops the generation server-side;
        errors surface as `grpc.RpcError` while iterating.
        """
        return self._stub.Generate(request, **self._call_args(timeout_s, metadata))

    def complete(
        self,
        request: pb.GenerateRequest,
        *,
        timeout_s: float | None = None,
        metadata: Sequence[tuple[str, Any]] = (),
    ) -> pb.GenerateResult:
        """Generates to the end and returns the result (raises `grpc.RpcError` on failure)."""
        return self._stub.Complete(request, **self._call_args(timeout_s, metadata))

    def factcheck(
        self,
        text: str = "",
        *,
        annotation_id: str = "",
        wait_ms: int | None = None,
        timeout_s: float | None = None,
        metadata: Sequence[tuple[str, Any]] = (),
    ) -> pb.FactCheckReport:
        """Checks `text` now, or fetches an earlier output's annotations by `annotation_id`."""
        request = pb.FactCheckRequest(text=text, annotation_id=annotation_id)
        if wait_ms is not None:
            request.wait_ms = int(wait_ms)
        return self._stub.FactCheck(request, **self._call_args(timeout_s, metadata))

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> MeshClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def api_key_from_env(explicit: str | None = None) -> str | None:
    """``explicit``, else ``$DRAFTMESH_API_KEY``, else None: the client-side key the CLIs send."""
    return explicit or os.environ.get(API_KEY_ENV) or None
