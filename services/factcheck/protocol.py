"""The fact-check stream contract: names, entry encoding, the annotation record.

Producers (the verifier, the router's ``FactCheck`` RPC) and workers agree on these
through one ``FactCheckConfig.stream_prefix``; nothing else is shared. Under the prefix:

- ``<prefix>:spans``          the stream of ``SpanEntry`` (XADD ... MAXLEN ~ maxlen)
- ``<prefix>:workers``        its consumer group
- ``<prefix>:dead``           the dead-letter stream (malformed or poisonous entries, with why)
- ``<prefix>:errors``         hash: stream entry id -> last annotate error (retried entries)
- ``<prefix>:ann:<id>``       the ``Annotation`` JSON of one annotation id (SET NX EX ttl)
- ``<prefix>:done:<id>``      a one-element list pushed when ``ann:<id>`` is written, so
                              waiters BLPOP instead of polling
- ``<prefix>:queued:<id>``    the stream entry id of the span queued for ``<id>`` (SET EX ttl
                              by the producer with its XADD, in one script): a waiter tells an
                              id that was never queued (unknown) from one still queued, and one
                              whose entry MAXLEN trimmed before any worker held it (lost)

Annotation ids are hashes (``annotation_id_for_text``): of the content for drafts and
queries, so a draft proposed again in a later step, or by another request, maps to the
annotation already made; of the request id and content for outputs, one per request. The
kind is part of the id, so a checker may treat outputs and queries differently from drafts.
(For Redis Cluster put a hash tag in the prefix, e.g. ``{draftmesh:factcheck}``: the worker
writes the annotation and acks the entry in one MULTI.)

Importing this module pulls in nothing but the standard library and ``findings``.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

from draftmesh.io_struct import FactCheckReport, Finding

PROTOCOL_VERSION = "1"
"""Bumped on incompatible changes; workers dead-letter entries of another version."""

Kind = Literal["draft", "output", "query"]
KINDS: tuple[str, ...] = ("draft", "output", "query")
"""draft: a non-trivial draft span proposed to the verifier; output: a finished output;
query: a text sent to the ``FactCheck`` RPC."""

AnnotationStatus = Literal["done", "failed"]
STATUSES: tuple[str, ...] = ("done", "failed")

MAX_TEXT_CHARS = 100_000
"""Longer texts are refused (a long output is ~16k characters); protects the workers."""
MAX_FIELD_CHARS = 512
"""Bound on request ids and traceparents."""

_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
_TEXT_ID_RE = re.compile(r"[doq]-[0-9a-f]{32}")
_KIND_TAG = {"draft": "d", "output": "o", "query": "q"}


class MalformedEntry(ValueError):
    """A stream entry that cannot be a ``SpanEntry``; ``reason`` says why (for the dead letter).

    ``annotation_id`` is set when the entry carried a valid one, so the worker can still
    write a "failed" annotation and nobody waits for it in vain."""

    def __init__(self, reason: str, annotation_id: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.annotation_id = annotation_id


def annotation_id_for_text(kind: str, text: str, request_id: str = "") -> str:
    """The id of ``text``'s annotation: ``<d|o|q>-`` + 128 bits of SHA-256 over kind,
    request id and text.

    Drafts and queries are keyed by content alone (leave ``request_id`` empty): a span seen
    again, in any request, reuses its annotation. Outputs pass their request id: the serving
    layer awaits that request's annotation, whatever other request produced the same text."""
    if kind not in _KIND_TAG:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    digest = hashlib.sha256(f"{kind}\0{request_id}\0{text}".encode("utf-8", "surrogatepass")).hexdigest()
    return f"{_KIND_TAG[kind]}-{digest[:32]}"


def valid_annotation_id(annotation_id: str) -> bool:
    return isinstance(annotation_id, str) and _ID_RE.fullmatch(annotation_id) is not None


def producible_annotation_id(annotation_id: str) -> bool:
    """Whether ``annotation_id_for_text`` can give this id (``<d|o|q>-`` + 32 hex digits): any
    other id cannot have an annotation from our producers."""
    return isinstance(annotation_id, str) and _TEXT_ID_RE.fullmatch(annotation_id) is not None


def content_keyed(annotation_id: str) -> bool:
    """Ids keyed by content alone (drafts, queries, anything but an output's): the same text
    asked again maps to the same id, so a "failed" annotation of one must not live long."""
    return not annotation_id.startswith(_KIND_TAG["output"] + "-")


def failed_ttl(annotation_id: str, failed_ttl_s: int, annotation_ttl_s: int) -> int:
    """Lifetime of a "failed" annotation: ``failed_ttl_s`` for content-keyed ids (the text may be
    asked again), ``annotation_ttl_s`` for an output's (its request's record)."""
    return min(failed_ttl_s, annotation_ttl_s) if content_keyed(annotation_id) else annotation_ttl_s


def lost_annotation(annotation_id: str, worker: str = "") -> "Annotation":
    """The "failed" annotation of a span whose stream entry was trimmed (``maxlen``) before a
    worker annotated it: nobody will, so waiters get this instead of waiting in vain."""
    return Annotation(annotation_id, "failed", (), worker,
                      error="lost: the span's stream entry was trimmed (factcheck.maxlen) before a worker read it; "
                            "ask again")  # fmt: skip


@dataclass(frozen=True)
class StreamNames:
    """Every Redis name under one prefix (see the module docstring)."""

    prefix: str

    def __post_init__(self) -> None:
        if not self.prefix:
            raise ValueError("stream prefix must not be empty")

    @classmethod
    def from_prefix(cls, prefix: str) -> StreamNames:
        return cls(prefix)

    @property
    def stream(self) -> str:
        return f"{self.prefix}:spans"

    @property
    def group(self) -> str:
        return f"{self.prefix}:workers"

    @property
    def dead_letter(self) -> str:
        return f"{self.prefix}:dead"

    @property
    def errors(self) -> str:
        return f"{self.prefix}:errors"

    def annotation_key(self, annotation_id: str) -> str:
        return f"{self.prefix}:ann:{annotation_id}"

    def done_key(self, annotation_id: str) -> str:
        return f"{self.prefix}:done:{annotation_id}"

    def queued_key(self, annotation_id: str) -> str:
        return f"{self.prefix}:queued:{annotation_id}"


def as_str(value: Any) -> str:
    """A Redis reply value as text: replies are bytes unless the client decodes them."""
    return value.decode() if isinstance(value, bytes) else str(value)


def _text(value: Any, name: str) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise MalformedEntry(f"field {name!r} is not valid UTF-8") from None
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    raise MalformedEntry(f"field {name!r} has type {type(value).__name__}")


@dataclass(frozen=True)
class SpanEntry:
    """One span to annotate, as the producer put it on the stream.

    ``start``/``end``: the span to check, as character offsets into ``text`` (which may
    carry context around it); 0/0 means all of ``text``. Findings' offsets are offsets into
    ``text`` too. ``traceparent`` is the W3C trace context of the producing request, carried
    through to the annotation."""

    annotation_id: str
    kind: str
    text: str
    request_id: str = ""
    start: int = 0
    end: int = 0
    traceparent: str = ""

    def __post_init__(self) -> None:
        if not valid_annotation_id(self.annotation_id):
            raise ValueError(f"invalid annotation id {self.annotation_id!r} (1-128 of [A-Za-z0-9._:-])")
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.text, str) or not self.text.strip():
            raise ValueError("text must be a non-blank string")
        if len(self.text) > MAX_TEXT_CHARS:
            raise ValueError(f"text has {len(self.text)} characters, more than {MAX_TEXT_CHARS}")
        for name in ("start", "end"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.end < self.start:
            raise ValueError(f"end ({self.end}) is before start ({self.start})")
        if self.end > len(self.text):
            raise ValueError(f"end ({self.end}) is past the text's {len(self.text)} characters")
        for name in ("request_id", "traceparent"):
            value = getattr(self, name)
            if not isinstance(value, str) or len(value) > MAX_FIELD_CHARS:
                raise ValueError(f"{name} must be a string of at most {MAX_FIELD_CHARS} characters")

    @classmethod
    def for_text(
        cls, kind: str, text: str, *, request_id: str = "", start: int = 0, end: int | None = None,
        traceparent: str = "",
    ) -> SpanEntry:
        """An entry with its ``annotation_id_for_text`` id (outputs: per request, others: per
        content); the span defaults to all of ``text``."""
        end = len(text) if end is None else end
        annotation_id = annotation_id_for_text(kind, text, request_id if kind == "output" else "")
        return cls(annotation_id, kind, text, request_id, start, end, traceparent)

    def to_fields(self) -> dict[str, str]:
        """The XADD field map (every value a string; empty optional fields are left out)."""
        fields = {"v": PROTOCOL_VERSION, "id": self.annotation_id, "kind": self.kind, "text": self.text}
        if self.request_id:
            fields["request_id"] = self.request_id
        if self.start or self.end:
            fields["start"], fields["end"] = str(self.start), str(self.end)
        if self.traceparent:
            fields["traceparent"] = self.traceparent
        return fields

    @classmethod
    def from_fields(cls, fields: Mapping[Any, Any] | None) -> SpanEntry:
        """Decode a stream entry (bytes or str keys/values); unknown fields are ignored so
        newer producers can add optional ones. Raises ``MalformedEntry`` with the reason."""
        if not fields:
            raise MalformedEntry("empty entry")
        try:
            data = {_text(k, "<key>"): v for k, v in fields.items()}
        except MalformedEntry as exc:
            raise MalformedEntry(f"a field name is not text: {exc.reason}") from None
        raw_id = data.get("id")
        annotation_id = ""
        if raw_id is not None:
            try:
                candidate = _text(raw_id, "id")
                annotation_id = candidate if valid_annotation_id(candidate) else ""
            except MalformedEntry:
                pass
        try:
            for name in ("v", "id", "kind", "text"):
                if name not in data:
                    raise MalformedEntry(f"missing field {name!r}")
            version = _text(data["v"], "v")
            if version != PROTOCOL_VERSION:
                raise MalformedEntry(f"unsupported protocol version {version!r} (this worker speaks {PROTOCOL_VERSION})")
            names = ("id", "kind", "text", "request_id", "traceparent")
            values = {name: _text(data[name], name) for name in names if name in data}
            offsets = {}
            for name in ("start", "end"):
                if name in data:
                    raw = _text(data[name], name)
                    if not re.fullmatch(r"[0-9]{1,12}", raw):
                        raise MalformedEntry(f"field {name!r} is not a non-negative integer: {raw[:40]!r}")
                    offsets[name] = int(raw)
            return cls(
                annotation_id=values["id"], kind=values["kind"], text=values["text"],
                request_id=values.get("request_id", ""), traceparent=values.get("traceparent", ""),
                start=offsets.get("start", 0), end=offsets.get("end", 0),
            )  # fmt: skip
        except MalformedEntry as exc:
            raise MalformedEntry(exc.reason, annotation_id) from None
        except ValueError as exc:
            raise MalformedEntry(str(exc), annotation_id) from None


@dataclass(frozen=True)
class Annotation:
    """A worker's result for one annotation id (the JSON value of ``<prefix>:ann:<id>``).

    status "done": ``findings`` hold every check's verdicts (possibly none); "failed": the
    span could not be checked (``error`` says why) and no findings are claimed."""

    annotation_id: str
    status: AnnotationStatus
    findings: tuple[Finding, ...] = field(default=())
    worker: str = ""
    latency_ms: float = 0.0
    error: str = ""
    traceparent: str = ""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {', '.join(STATUSES)}, got {self.status!r}")
        findings = tuple(self.findings)
        if not all(isinstance(f, Finding) for f in findings):
            raise TypeError("findings must be Finding objects")
        object.__setattr__(self, "findings", findings)

    @property
    def flagged(self) -> bool:
        """Whether any finding flags its span (``io_struct.FLAGGING``)."""
        return any(f.flagged for f in self.findings)

    def report(self, **counts: int) -> FactCheckReport:
        """What a client sees of this annotation: done with the findings, or failed with why;
        ``counts``: the producing request's draft counters (drafts_submitted, ...)."""
        if self.status == "done":
            return FactCheckReport("done", self.annotation_id, self.findings, **counts)
        return FactCheckReport("failed", self.annotation_id, self.findings, error=self.error, **counts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "v": PROTOCOL_VERSION, "annotation_id": self.annotation_id, "status": self.status,
            "findings": [f.to_dict() for f in self.findings], "worker": self.worker,
            "latency_ms": round(float(self.latency_ms), 3), "error": self.error, "traceparent": self.traceparent,
        }  # fmt: skip

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False, separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Annotation:
        if not isinstance(data, Mapping):
            raise ValueError("annotation must be a JSON object")
        try:
            findings = data.get("findings", [])
            if not isinstance(findings, list):
                raise ValueError("findings must be a list")
            return cls(
                annotation_id=str(data["annotation_id"]), status=str(data["status"]),
                findings=tuple(Finding.from_dict(f) for f in findings), worker=str(data.get("worker", "")),
                latency_ms=float(data.get("latency_ms", 0.0)), error=str(data.get("error", "")),
                traceparent=str(data.get("traceparent", "")),
            )  # fmt: skip
        except KeyError as exc:
            raise ValueError(f"annotation lacks {exc.args[0]!r}") from None
        except TypeError as exc:
            raise ValueError(f"bad annotation: {exc}") from None

    @classmethod
    def from_json(cls, raw: str | bytes) -> Annotation:
        """Parse a stored annotation; raises ValueError on anything that is not one."""
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"annotation is not JSON: {exc}") from None
        return cls.from_dict(data)

