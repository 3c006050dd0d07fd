"""The Python client of the draftmesh gRPC service (used by `draftmesh generate` and the bench).

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

import argparse
import json
import os
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc

from draftmesh import tracing
from draftmesh.v1 import generation_pb2 as pb
from draftmesh.v1 import generation_pb2_grpc as pb_grpc

DEFAULT_ADDR = "localhost:9000"
API_KEY_ENV = "DRAFTMESH_API_KEY"
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


# --------------------------------------------------------------------------- CLI


class CliError(Exception):
    """A usage error of `draftmesh generate` (exit code 2)."""


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `draftmesh generate`."""
    parser.add_argument(
        "prompt", nargs="?", default=None,
        help="the prompt, sent as a user turn (chat template applied; '-' reads stdin); with --messages it is "
        "appended as the final user turn",
    )
    parser.add_argument("--raw", action="store_true", help="send the prompt as raw text, without the chat template")
    parser.add_argument("--addr", default=DEFAULT_ADDR, help=f"server host:port (default {DEFAULT_ADDR})")
    parser.add_argument("--stream", action="store_true", help="stream text as it is generated (Generate)")
    parser.add_argument("--messages", metavar="FILE.json", help="chat messages: a JSON list of {role, content}")
    parser.add_argument(
        "--document", dest="documents", metavar="FILE", action="append", default=[],
        help="a text file the rag source may draft from (repeatable)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=None, help="0 or unset = greedy")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", metavar="S", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--session-id", default="", help="share history drafts / KV cache across requests")
    parser.add_argument("--no-speculate", action="store_true", help="plain decoding (the baseline)")
    parser.add_argument("--sources", default="", help="draft sources to ask, comma-separated (default: all)")
    parser.add_argument("--max-nodes", type=int, default=None, help="token-tree node cap per step")
    parser.add_argument("--policy", default="", help="acceptance policy (default exact = lossless)")
    parser.add_argument("--no-factcheck", action="store_true", help="do not fact-check the output")
    parser.add_argument("--factcheck-wait-ms", type=int, default=None,
                        help="how long the result may wait for the output's fact-check")
    parser.add_argument(
        "--api-key", default=None, help=f"API key sent as a bearer token (default: ${API_KEY_ENV})"
    )
    parser.add_argument("--tls-ca", metavar="FILE", default=None, help="PEM CA/certificate to trust; enables TLS")
    parser.add_argument("--application", default=None, help="Ray Serve application name (multi-app setups)")
    parser.add_argument("--timeout", type=float, default=None, help="deadline in seconds")


def _load_messages(path: str) -> list[dict[str, str]]:
    try:
        data = json.loads(Path(path).expanduser().read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise CliError(f"--messages: file not found: {path}") from exc
    except OSError as exc:
        raise CliError(f"--messages: cannot read {path}: {exc.strerror or exc}") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CliError(f"--messages: {path} is not valid JSON: {exc}") from exc
    if isinstance(data, Mapping) and "messages" in data:
        data = data["messages"]
    if not isinstance(data, list) or not data:
        raise CliError(f"--messages: {path} must hold a non-empty JSON list of {{role, content}} objects")
    for i, m in enumerate(data):
        if not (isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise CliError(f"--messages: item {i} of {path} must be an object with string 'role' and 'content'")
    return [{"role": m["role"], "content": m["content"]} for m in data]


def _load_documents(paths: Sequence[str]) -> list[pb.Document]:
    docs = []
    for path in paths:
        p = Path(path).expanduser()
        try:
            text = p.read_text(encoding="utf-8")
        except FileNotFoundError as exc:
            raise CliError(f"--document: file not found: {path}") from exc
        except (OSError, UnicodeDecodeError) as exc:
            raise CliError(f"--document: cannot read {path} as UTF-8 text: {exc}") from exc
        docs.append(pb.Document(id=p.name, text=text))
    return docs


def _request_from_args(args: argparse.Namespace) -> pb.GenerateRequest:
    prompt = getattr(args, "prompt", None)
    if prompt == "-":
        prompt = sys.stdin.read()
    messages = None
    if getattr(args, "messages", None):
        messages = _load_messages(args.messages)
        if prompt is not None:
            messages.append({"role": "user", "content": prompt})
            prompt = None
    elif prompt is None:
        raise CliError("give a prompt (or --messages FILE.json)")
    elif not getattr(args, "raw", False):
        messages, prompt = [{"role": "user", "content": prompt}], None
    try:
        return build_request(
            prompt,
            messages=messages,
            max_new_tokens=getattr(args, "max_new_tokens", None),
            temperature=getattr(args, "temperature", None),
            top_p=getattr(args, "top_p", None),
            top_k=getattr(args, "top_k", None),
            seed=getattr(args, "seed", None),
            stop=getattr(args, "stop", None) or (),
            session_id=getattr(args, "session_id", "") or "",
            documents=_load_documents(getattr(args, "documents", None) or ()),
            speculate=False if getattr(args, "no_speculate", False) else None,
            sources=getattr(args, "sources", "") or "",
            max_nodes=getattr(args, "max_nodes", None),
            policy=getattr(args, "policy", "") or "",
            factcheck=False if getattr(args, "no_factcheck", False) else None,
            factcheck_wait_ms=getattr(args, "factcheck_wait_ms", None),
        )
    except ValueError as exc:
        raise CliError(str(exc)) from exc


def _client_from_args(args: argparse.Namespace) -> MeshClient:
    tls_ca = None
    if getattr(args, "tls_ca", None):
        try:
            tls_ca = Path(args.tls_ca).expanduser().read_bytes()
        except OSError as exc:
            raise CliError(f"--tls-ca: cannot read {args.tls_ca}: {exc.strerror or exc}") from exc
    api_key = getattr(args, "api_key", None) or os.environ.get(API_KEY_ENV) or None
    return MeshClient(
        getattr(args, "addr", None) or DEFAULT_ADDR,
        api_key=api_key,
        tls_ca=tls_ca,
        timeout_s=getattr(args, "timeout", None),
        application=getattr(args, "application", None),
    )


def format_stats(result: pb.GenerateResult, *, wall_s: float | None = None) -> str:
    """A short human-readable summary of a GenerateResult (what `draftmesh generate` prints)."""
    tokens = result.usage.completion_tokens or len(result.token_ids)
    steps = result.usage.steps
    seconds = result.seconds if result.seconds > 0 else (wall_s or 0.0)
    tok_s = tokens / seconds if seconds > 0 else 0.0
    lines = [
        f"tokens: {tokens}  tok/s: {tok_s:.1f}  steps: {steps}  "
        f"accepted/step: {result.mean_accepted_per_step:.2f}  finish: {result.finish_reason or '?'}"
    ]
    prompt_line = f"prompt tokens: {result.usage.prompt_tokens}"
    if result.usage.cached_prompt_tokens:
        prompt_line += f" ({result.usage.cached_prompt_tokens} from session cache)"
    lines.append(prompt_line)
    if result.sources:
        width = max(6, *(len(s.source) for s in result.sources))
        lines.append(f"  {'source':<{width}}  {'nodes':>7}  {'accepted':>8}  {'acceptance':>10}  {'failed':>6}")
        for s in result.sources:
            lines.append(
                f"  {s.source:<{width}}  {s.nodes:>7}  {s.accepted_tokens:>8}  "
                f"{s.acceptance:>10.3f}  {s.failed_steps:>6}"
            )
    policy = result.policy or "exact"
    lossless = "lossless" if result.lossless else f"LOSSY, {result.lenient_tokens} lenient tokens"
    lines.append(
        f"policy: {policy} ({lossless})  first token: {result.first_token_ms:.1f} ms  "
        f"replica: {result.replica or '?'}"
    )
    if result.HasField("factcheck"):
        lines.append(format_factcheck(result.factcheck))
    return "\n".join(lines)


def format_factcheck(report: pb.FactCheckReport) -> str:
    """The fact-check report: status, then one line per finding (flagged ones marked '!')."""
    head = f"fact-check: {report.status}"
    if report.annotation_id:
        head += f"  id: {report.annotation_id}"
    if report.drafts_submitted or report.drafts_skipped or report.flagged_steps:
        head += (f"  drafts sent: {report.drafts_submitted}  skipped: {report.drafts_skipped}  "
                 f"steps with flags: {report.flagged_steps}")
    if report.error:
        head += f"  ({report.error})"
    lines = [head]
    for a in report.annotations:
        mark = "!" if a.flagged else " "
        what = " ".join(x for x in (a.label, a.rule, a.entity_id) if x)
        lines.append(f"  {mark} [{a.start}:{a.end}] {a.text!r} {a.check}/{a.verdict} ({what}) {a.evidence}".rstrip())
    return "\n".join(lines)


def _print_error(message: str, *, newline_first: bool = False) -> None:
    if newline_first:
        sys.stdout.write("\n")
        sys.stdout.flush()
    print(f"error: {message}", file=sys.stderr)


def run_generate_cli(args: argparse.Namespace) -> int:
    """The body of `draftmesh generate`. Exit codes: 0 ok, 2 bad input (INVALID_ARGUMENT
    or a usage error), 1 any other failure, 130 interrupted."""
    try:
        request = _request_from_args(args)
        tracing.setup_tracing("client")
        client = _client_from_args(args)
    except (CliError, ValueError) as exc:  # ValueError: a bad OTEL_* setting
        _print_error(str(exc))
        return 2

    printed = False
    call = None
    t0 = time.perf_counter()
    try:
        with client:
            if getattr(args, "stream", False):
                result = None
                call = client.generate(request)
                for response in call:
                    kind = response.WhichOneof("event")
                    if kind == "delta":
                        if response.delta.text:
                            sys.stdout.write(response.delta.text)
                            sys.stdout.flush()
                            printed = True
                    elif kind == "result":
                        result = response.result
                if result is None:
                    _print_error("the stream ended without a result", newline_first=printed)
                    return 1
                sys.stdout.write("\n")
                sys.stdout.flush()
            else:
                result = client.complete(request)
                sys.stdout.write(result.text + "\n")
                sys.stdout.flush()
            print(format_stats(result, wall_s=time.perf_counter() - t0), file=sys.stderr)
            return 0
    except grpc.RpcError as exc:
        code = exc.code() if hasattr(exc, "code") else None
        details = exc.details() if hasattr(exc, "details") else str(exc)
        name = code.name if code is not None else "UNKNOWN"
        _print_error(f"{name}: {details}", newline_first=printed)
        return 2 if code == grpc.StatusCode.INVALID_ARGUMENT else 1
    except KeyboardInterrupt:
        if call is not None:
            call.cancel()
        _print_error("interrupted", newline_first=printed)
        return 130
