"""Syntactic validation of a public ``GenerateRequest`` into the router's ``ServeRequest``.

Every field is checked here, before anything is admitted or sent to a verifier replica.
A bad field is an ``InvalidRequest`` naming the proto field path ("stop[1]",
"speculation.max_nodes", "messages[0].role") and the rule it breaks; the gRPC front door
turns it into INVALID_ARGUMENT. The rules of the parameter groups (sampling, speculation) are
``draftmesh.io_struct``'s own, checked when the groups are built, so the library and the front door
enforce the same ones. What only the model knows (token counts against the context, a policy's
parameter ranges) is left to the verifier, which answers ``Rejected``.
"""

from __future__ import annotations

import math
import re
import uuid
from typing import TYPE_CHECKING, Any, Sequence

from draftmesh.config import LimitsConfig
from draftmesh.io_struct import (
    ROLES,
    FactCheckOptions,
    InvalidField,
    SamplingParams,
    ServeRequest,
    SpeculationParams,
)

if TYPE_CHECKING:  # pragma: no cover
    from draftmesh.v1 import generation_pb2

_INT = re.compile(r"[+-]?\d+", re.ASCII)
_FLOAT = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?", re.ASCII)


InvalidRequest = InvalidField
"""A request field breaks a rule (the io_struct error the parameter groups raise too)."""


def parse_request(
    req: "generation_pb2.GenerateRequest",
    limits: LimitsConfig,
    *,
    sources: Sequence[str],
    policies: Sequence[str],
    request_id: str | None = None,
) -> ServeRequest:
    """Check every field of ``req``; return the ServeRequest a verifier replica runs.

    ``sources`` are the draft sources this mesh serves, ``policies`` the acceptance
    policies it knows. ``request_id`` is the server's id for the request (e.g. from
    metadata), used when the client left ``req.request_id`` empty; a uuid4 hex otherwise.
    """
    prompt, messages = _prompt(req, limits)
    return ServeRequest(
        request_id=_request_id(req.request_id, request_id, limits),
        prompt=prompt,
        messages=messages,
        max_new_tokens=_max_new_tokens(req, limits),
        sampling=_sampling(req),
        stop=_stop(req, limits),
        session_id=_ident("session_id", req.session_id, limits) or None,
        documents=_documents(req, limits),
        speculation=_speculation(req, sources, policies, limits),
        factcheck_options=_factcheck_options(req.factcheck, limits),
    )


def parse_factcheck(req: "generation_pb2.FactCheckRequest", limits: LimitsConfig) -> tuple[str, str, int | None]:
    """(text, annotation_id, wait_ms) of a FactCheck call; exactly one of text and id is set."""
    if bool(req.text) == bool(req.annotation_id):
        raise InvalidRequest("text", "give exactly one of text and annotation_id")
    if req.text:
        size = _utf8_len("text", req.text)
        if size > limits.max_prompt_bytes:
            raise InvalidRequest("text", f"is {size} bytes; the limit is {limits.max_prompt_bytes}")
        if not req.text.strip():
            raise InvalidRequest("text", "is blank")
    annotation_id = _ident("annotation_id", req.annotation_id, limits) if req.annotation_id else ""
    return req.text, annotation_id, _wait_ms("wait_ms", req, limits)


def _factcheck_options(options, limits: LimitsConfig) -> FactCheckOptions:
    enabled = options.enabled if options.HasField("enabled") else True
    return FactCheckOptions(enabled=enabled, wait_ms=_wait_ms("factcheck.wait_ms", options, limits))


def _wait_ms(field: str, message, limits: LimitsConfig) -> int | None:
    if not message.HasField("wait_ms"):
        return None
    if message.wait_ms > limits.max_factcheck_wait_ms:
        raise InvalidRequest(field, f"must be <= {limits.max_factcheck_wait_ms}, got {message.wait_ms}")
    return int(message.wait_ms)


# ---------------------------------------------------------------------- prompt
def _utf8_len(field: str, text: str) -> int:
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:  # lone surrogates set from Python
        raise InvalidRequest(field, f"not valid text (unencodable character at offset {exc.start})") from None


def _prompt(req, limits: LimitsConfig) -> tuple[str | None, tuple[tuple[str, str], ...] | None]:
    if req.prompt and len(req.messages):
        raise InvalidRequest("prompt", "prompt and messages are both set; give exactly one")
    if not req.prompt and not len(req.messages):
        raise InvalidRequest("prompt", "give prompt or messages")
    if req.prompt:
        if not req.prompt.strip():
            raise InvalidRequest("prompt", "must not be empty or whitespace only")
        size = _utf8_len("prompt", req.prompt)
        if size > limits.max_prompt_bytes:
            raise InvalidRequest("prompt", f"{size} UTF-8 bytes exceeds the limit of {limits.max_prompt_bytes}")
        return req.prompt, None

    if len(req.messages) > limits.max_messages:
        raise InvalidRequest("messages", f"at most {limits.max_messages} messages, got {len(req.messages)}")
    turns: list[tuple[str, str]] = []
    size = 0
    last_user = None
    for i, msg in enumerate(req.messages):
        if msg.role not in ROLES:
            raise InvalidRequest(f"messages[{i}].role", f"must be one of {', '.join(ROLES)}, got {msg.role!r}")
        size += _utf8_len(f"messages[{i}].content", msg.content)
        if msg.role == "user":
            last_user = i
        turns.append((msg.role, msg.content))
    if last_user is None:
        raise InvalidRequest("messages", "need at least one user message")
    if not turns[last_user][1].strip():
        raise InvalidRequest(f"messages[{last_user}].content", "the last user message must not be empty")
    if size > limits.max_prompt_bytes:
        raise InvalidRequest("messages", f"{size} UTF-8 bytes in all exceeds the limit of {limits.max_prompt_bytes}")
    return None, tuple(turns)


# ---------------------------------------------------------------------- sampling
def _max_new_tokens(req, limits: LimitsConfig) -> int:
    if not req.HasField("max_new_tokens"):
        return limits.default_max_new_tokens
    n = req.max_new_tokens
    if not 1 <= n <= limits.max_new_tokens_cap:
        raise InvalidRequest("max_new_tokens", f"must be in [1, {limits.max_new_tokens_cap}], got {n}")
    return n


def _float32(value: float) -> float:
    """The shortest decimal of a proto float (0.7f reads as 0.7, not 0.699999988079071)."""
    import numpy as np

    return float(str(np.float32(value)))


def _sampling(req) -> SamplingParams:
    """Unset fields take the defaults; proto floats read as their shortest decimal (0.7f is 0.7)."""
    return SamplingParams(
        temperature=_float32(req.temperature) if req.HasField("temperature") else 0.0,
        top_p=_float32(req.top_p) if req.HasField("top_p") else 1.0,
        top_k=req.top_k if req.HasField("top_k") else 0,
        seed=req.seed if req.HasField("seed") else None,
    )


# ---------------------------------------------------------------------- text fields
def _stop(req, limits: LimitsConfig) -> tuple[str, ...]:
    if len(req.stop) > limits.max_stop_strings:
        raise InvalidRequest("stop", f"at most {limits.max_stop_strings} stop strings, got {len(req.stop)}")
    out = []
    for i, raw in enumerate(req.stop):
        field = f"stop[{i}]"
        if not raw:
            raise InvalidRequest(field, "must not be empty")
        if len(raw) > limits.max_stop_bytes:
            raise InvalidRequest(field, f"{len(raw)} bytes exceeds the limit of {limits.max_stop_bytes}")
        try:
            out.append(bytes(raw).decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise InvalidRequest(
                field, f"not valid UTF-8 (byte 0x{raw[exc.start]:02x} at offset {exc.start})"
            ) from None
    return tuple(out)


def _documents(req, limits: LimitsConfig) -> tuple[str, ...]:
    if len(req.documents) > limits.max_documents:
        raise InvalidRequest("documents", f"at most {limits.max_documents} documents, got {len(req.documents)}")
    out = []
    total = 0
    for i, doc in enumerate(req.documents):
        _ident(f"documents[{i}].id", doc.id, limits)
        field = f"documents[{i}].text"
        if not doc.text.strip():
            raise InvalidRequest(field, "must not be empty")
        size = _utf8_len(field, doc.text)
        if size > limits.max_document_bytes:
            raise InvalidRequest(field, f"{size} UTF-8 bytes exceeds the limit of {limits.max_document_bytes}")
        total += size
        if total > limits.max_document_total_bytes:
            raise InvalidRequest("documents", f"{total} UTF-8 bytes in documents[0..{i}] exceeds the limit of "
                                 f"{limits.max_document_total_bytes} for all documents together")
        if "\x00" in doc.text:
            raise InvalidRequest(field, f"not valid text (NUL character at offset {doc.text.index(chr(0))})")
        out.append(doc.text)
    return tuple(out)


def _ident(field: str, value: str, limits: LimitsConfig) -> str:
    """An id: at most ``limits.max_id_chars`` printable characters (may be empty)."""
    if len(value) > limits.max_id_chars:
        raise InvalidRequest(field, f"at most {limits.max_id_chars} characters, got {len(value)}")
    for pos, ch in enumerate(value):
        if not ch.isprintable():
            raise InvalidRequest(field, f"must be printable (character U+{ord(ch):04X} at offset {pos})")
    return value


def _request_id(client: str, server: str | None, limits: LimitsConfig) -> str:
    if client:
        return _ident("request_id", client, limits)
    if server:
        return _ident("request_id", server, limits)
    return uuid.uuid4().hex


# ---------------------------------------------------------------------- speculation
def _speculation(req, sources: Sequence[str], policies: Sequence[str], limits: LimitsConfig) -> SpeculationParams:
    """The speculation group; names must be this mesh's sources and policies (the ranges and the
    duplicate check are SpeculationParams' own)."""
    spec = req.speculation
    known = list(sources)
    available = ", ".join(known) or "none"
    for field, name in [*((f"speculation.sources[{i}]", n) for i, n in enumerate(spec.sources)),
                        *((f"speculation.source_caps[{n}]", n) for n in sorted(spec.source_caps))]:
        if name not in known:
            raise InvalidRequest(field, f"unknown draft source {name!r}; this mesh serves: {available}")
    policy = spec.policy or "exact"
    if policy != "exact" and policy not in policies:
        raise InvalidRequest(
            "speculation.policy", f"unknown acceptance policy {policy!r}; available: {', '.join(policies) or 'none'}"
        )
    params = _policy_params(spec.policy_params, limits)
    if params and policy == "exact":
        raise InvalidRequest("speculation.policy_params", "the exact policy takes no parameters")
    return SpeculationParams(
        enabled=spec.enabled if spec.HasField("enabled") else True,
        sources=tuple(spec.sources) if len(spec.sources) else None,
        source_caps={name: spec.source_caps[name] for name in sorted(spec.source_caps)},
        max_nodes=spec.max_nodes if spec.HasField("max_nodes") else None,
        policy=policy,
        policy_params=params,
    )


def _policy_params(raw, limits: LimitsConfig) -> dict[str, Any]:
    if len(raw) > limits.max_policy_params:
        raise InvalidRequest("speculation.policy_params", f"at most {limits.max_policy_params} parameters, got {len(raw)}")
    out: dict[str, Any] = {}
    for key in sorted(raw):
        if not key:
            raise InvalidRequest("speculation.policy_params", "parameter names must not be empty")
        field = f"speculation.policy_params[{key}]"
        if len(key) > limits.max_policy_key_chars or not key.isprintable():
            raise InvalidRequest(field, f"parameter names are at most {limits.max_policy_key_chars} printable characters")
        value = raw[key]
        if len(value) > limits.max_policy_value_chars:
            raise InvalidRequest(field, f"value has {len(value)} characters; the limit is {limits.max_policy_value_chars}")
        out[key] = _param_value(field, value)
    return out


def _param_value(field: str, text: str) -> Any:
    s = text.strip()
    if _INT.fullmatch(s):
        return int(s)
    if _FLOAT.fullmatch(s):
        value = float(s)
        if not math.isfinite(value):
            raise InvalidRequest(field, f"number out of range: {s}")
        return value
    if s.lower() in ("true", "false"):
        return s.lower() == "true"
    return text
