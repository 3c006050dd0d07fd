"""The OpenAI-compatible HTTP API's bodies: typed requests and responses, and their mapping onto the
router's one request type.

A request body is parsed into a pydantic model (strict types, unknown fields refused), checked for
the OpenAI fields that would change the result and that draftmesh does not implement (each a 400
naming the field, never silently ignored), then turned into the ``GenerateRequest`` the gRPC face
takes, so ``parse_request`` checks every field for both faces. Its errors name proto fields; ``Face``
renames them to the field the HTTP client sent (``max_new_tokens`` -> ``max_tokens``).

draftmesh's own knobs come in the body beside the OpenAI fields (the ``openai`` client's
``extra_body``): ``speculation``, ``documents``, ``session_id``, ``factcheck``, ``top_k``.
Pure logic: no Ray, no HTTP server.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from draftmesh.io_struct import FactCheckReport, InvalidField, ServedResult
from draftmesh.v1 import generation_pb2 as pb

INT32_MAX = 2**31 - 1
UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1
ROLE_ALIASES = {"developer": "system"}
"""OpenAI's newer name for the system turn."""


# ---------------------------------------------------------------------- request bodies
class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    # What an assistant message copied from an earlier response carries; only their empty values.
    refusal: str | None = None
    tool_calls: list[Any] | None = None
    annotations: list[Any] | None = None


class Speculation(_Body):
    enabled: bool | None = None
    sources: list[str] | None = None
    source_caps: dict[str, int] | None = None
    max_nodes: int | None = None
    policy: str | None = None
    policy_params: dict[str, str | int | float | bool] | None = None


class Document(_Body):
    id: str = ""
    text: str


class FactCheck(_Body):
    enabled: bool | None = None
    wait_ms: int | None = None


class StreamOptions(_Body):
    include_usage: bool | None = None


class _GenerationBody(_Body):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    # draftmesh's own (extra_body)
    top_k: int | None = None
    speculation: Speculation | None = None
    documents: list[Document | str] | None = None
    session_id: str | None = None
    factcheck: FactCheck | None = None
    # OpenAI fields accepted only at the value that changes nothing (see UNSUPPORTED)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None


class ChatCompletionRequest(_GenerationBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: str | None = None
    web_search_options: Any = None
    # No effect on the output.
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None


class CompletionRequest(_GenerationBody):
    prompt: str | list[str]
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


def _off(*values: Any) -> Callable[[Any], bool]:
    return lambda v: v is None or any(v == ok for ok in values)


UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "n": (_off(1), "only n=1 is supported (one choice per request)"),
    "best_of": (_off(1), "only best_of=1 is supported"),
    "logprobs": (_off(False), "log probabilities are not supported"),
    "top_logprobs": (_off(0), "log probabilities are not supported"),
    "echo": (_off(False), "echo is not supported"),
    "suffix": (_off(""), "suffix (insertion) is not supported"),
    "tools": (_off([]), "tool calls are not supported"),
    "functions": (_off([]), "function calls are not supported"),
    "function_call": (_off("none"), "function calls are not supported"),
    "tool_choice": (_off("none", "auto"), "tool calls are not supported"),
    "response_format": (_off({"type": "text"}), "only response_format {\"type\": \"text\"} is supported"),
    "presence_penalty": (_off(0), "penalties are not supported (only 0)"),
    "frequency_penalty": (_off(0), "penalties are not supported (only 0)"),
    "logit_bias": (_off({}), "logit_bias is not supported"),
    "modalities": (_off(["text"]), "only text output is supported"),
    "audio": (_off(), "audio output is not supported"),
    "prediction": (_off(), "predicted outputs are not supported"),
    "reasoning_effort": (_off(), "reasoning_effort is not supported"),
    "web_search_options": (_off(), "web search is not supported"),
}
"""OpenAI fields that would change the result: refused unless at their no-op value."""


# ---------------------------------------------------------------------- parsing
def parse_body(raw: bytes, model: type[_Body]) -> _Body:
    """The typed body, or InvalidField naming the first field at fault (invalid JSON: ``body``)."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        first = errors[0]
        if first["type"] == "json_invalid":
            raise InvalidField("body", f"not valid JSON ({first['msg']})") from None
        param = loc_to_param(first["loc"]) or "body"
        msg = "unknown field" if first["type"] == "extra_forbidden" else first["msg"]
        more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
        raise InvalidField(param, f"{msg}{more}") from None


def loc_to_param(loc: tuple) -> str:
    """A pydantic error location as a field path: ('messages', 0, 'role') -> messages[0].role."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("str", "list[str]", "list[TextPart]", "Document", "TextPart") or str(part).startswith(
                ("list[", "dict[", "function-")):
            continue  # the member of a union pydantic tried, not a field
        else:
            out += f".{part}" if out else str(part)
    return out


@dataclass
class Face:
    """What the HTTP face needs to answer one endpoint: the proto request, and how its fields are named."""

    endpoint: Literal["chat", "completions"]
    body: _Body
    request: pb.GenerateRequest = field(default_factory=pb.GenerateRequest)
    names: dict[str, str] = field(default_factory=dict)
    """proto field -> the field this client sent (for error messages)."""

    def rename(self, exc_field: str | None, message: str) -> tuple[str | None, str]:
        """An error's param and message in the client's field names."""
        for proto, http in self.names.items():
            if proto == http:
                continue
            message = re.sub(rf"\b{re.escape(proto)}\b", http, message)
            if exc_field is not None and (exc_field == proto or exc_field.startswith(proto + "[")
                                          or exc_field.startswith(proto + ".")):
                exc_field = http + exc_field[len(proto):]
        return exc_field, message

    @property
    def stream(self) -> bool:
        return bool(self.body.stream)

    @property
    def include_usage(self) -> bool:
        opts = self.body.stream_options
        return bool(opts is not None and opts.include_usage)


def to_face(endpoint: Literal["chat", "completions"], body: _Body) -> Face:
    """Check what only the HTTP face knows and build the proto request; InvalidField names the field."""
    face = Face(endpoint, body)
    for name, (is_off, why) in UNSUPPORTED.items():
        if name in type(body).model_fields and not is_off(getattr(body, name)):
            raise InvalidField(name, f"{why}; got {getattr(body, name)!r}")
    if body.stream_options is not None and not body.stream:
        raise InvalidField("stream_options", "only allowed with stream: true")
    req = face.request
    if isinstance(body, ChatCompletionRequest):
        _messages(body, req)
        face.names["prompt"] = "messages"
        tokens, tokens_field = body.max_completion_tokens, "max_completion_tokens"
        if body.max_tokens is not None:
            if tokens is not None:
                raise InvalidField("max_tokens", "give max_tokens or max_completion_tokens, not both")
            tokens, tokens_field = body.max_tokens, "max_tokens"
    else:
        prompt = body.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise InvalidField("prompt", f"give one prompt (a string or a list of one), got {len(prompt)}")
            prompt = prompt[0]
        req.prompt = prompt
        tokens, tokens_field = body.max_tokens, "max_tokens"
    face.names["max_new_tokens"] = tokens_field
    if tokens is not None:
        _set_int(req, "max_new_tokens", tokens, tokens_field, -INT32_MAX, INT32_MAX)
    if body.temperature is not None:
        req.temperature = body.temperature
    if body.top_p is not None:
        req.top_p = body.top_p
    if body.top_k is not None:
        _set_int(req, "top_k", body.top_k, "top_k", -INT32_MAX, INT32_MAX)
    if body.seed is not None:
        if body.seed < 0:
            raise InvalidField("seed", f"must be a non-negative integer, got {body.seed}")
        _set_int(req, "seed", body.seed, "seed", 0, UINT64_MAX)
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or ())
    req.stop.extend(s.encode("utf-8", "surrogatepass") for s in stops)
    if body.session_id is not None:
        req.session_id = body.session_id
    for i, doc in enumerate(body.documents or ()):
        req.documents.append(pb.Document(text=doc) if isinstance(doc, str) else pb.Document(id=doc.id, text=doc.text))
    if body.speculation is not None:
        _speculation(body.speculation, req.speculation)
    if body.factcheck is not None:
        if body.factcheck.enabled is not None:
            req.factcheck.enabled = body.factcheck.enabled
        if body.factcheck.wait_ms is not None:
            _set_int(req.factcheck, "wait_ms", body.factcheck.wait_ms, "factcheck.wait_ms", 0, UINT32_MAX)
    return face


def _set_int(message, name: str, value: int, param: str, lo: int, hi: int) -> None:
    if not lo <= value <= hi:
        raise InvalidField(param, f"out of range, got {value}")
    setattr(message, name, value)


def _messages(body: ChatCompletionRequest, req: pb.GenerateRequest) -> None:
    for i, msg in enumerate(body.messages):
        if msg.tool_calls:
            raise InvalidField(f"messages[{i}].tool_calls", "tool calls are not supported")
        content = msg.content
        if content is None:
            raise InvalidField(f"messages[{i}].content", "is required")
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        req.messages.append(pb.ChatMessage(role=ROLE_ALIASES.get(msg.role, msg.role), content=content))


def _speculation(spec: Speculation, out: pb.Speculation) -> None:
    if spec.enabled is not None:
        out.enabled = spec.enabled
    out.sources.extend(spec.sources or ())
    for name, cap in (spec.source_caps or {}).items():
        if not 0 <= cap <= UINT32_MAX:
            raise InvalidField(f"speculation.source_caps[{name}]", f"must be a non-negative integer, got {cap}")
        out.source_caps[name] = cap
    if spec.max_nodes is not None:
        _set_int(out, "max_nodes", spec.max_nodes, "speculation.max_nodes", 0, UINT32_MAX)
    if spec.policy is not None:
        out.policy = spec.policy
    for key, value in (spec.policy_params or {}).items():
        out.policy_params[key] = str(value).lower() if isinstance(value, bool) else str(value)


# ---------------------------------------------------------------------- response bodies
class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class SourceInfo(BaseModel):
    source: str
    nodes: int
    accepted_tokens: int
    acceptance: float
    failed_steps: int


class Annotation(BaseModel):
    check: str
    start: int
    end: int
    text: str
    verdict: str
    flagged: bool
    label: str
    rule: str
    entity_id: str
    evidence: str


class FactCheckInfo(BaseModel):
    status: str
    annotation_id: str
    annotations: list[Annotation]
    error: str
    drafts_submitted: int
    drafts_skipped: int
    flagged_steps: int


class DraftmeshInfo(BaseModel):
    """What the gRPC ``GenerateResult`` says beyond the text, plus vLLM-style speculative metrics."""

    request_id: str
    lossless: bool
    policy: str
    lenient_tokens: int
    steps: int
    tokens_per_step: float
    """Tokens committed per target forward (1.0 for plain decoding)."""
    mean_acceptance_length: float
    """vLLM's per-request metric: 1 + accepted draft tokens / drafts (steps that verified a draft)."""
    num_drafts: int
    num_draft_tokens: int
    """Draft tokens (tree nodes) the target verified."""
    num_accepted_tokens: int
    accepted_per_source: dict[str, int]
    sources: list[SourceInfo]
    replica: str
    seconds: float
    first_token_ms: float
    factcheck: FactCheckInfo | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    finish_reason: Literal["stop", "length"]
    logprobs: None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    draftmesh: DraftmeshInfo


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    draftmesh: DraftmeshInfo | None = None


class TextChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: None = None


class TextCompletion(BaseModel):
    """A /v1/completions answer, and (object text_completion too, as OpenAI sends) each stream chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage | None = None
    draftmesh: DraftmeshInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "draftmesh"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorInfo


# ---------------------------------------------------------------------- rendering
def finish_reason(reason: str) -> Literal["stop", "length"]:
    """The engine's eos/stop/length as OpenAI's: the model ending and a stop string are both "stop"."""
    return "length" if reason == "length" else "stop"


def usage(served: ServedResult) -> Usage:
    r = served.result
    return Usage(prompt_tokens=r.prompt_tokens, completion_tokens=len(r.token_ids),
                 total_tokens=r.prompt_tokens + len(r.token_ids),
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=r.reused_tokens))


def factcheck_info(report: FactCheckReport) -> FactCheckInfo:
    return FactCheckInfo(
        status=report.status, annotation_id=report.annotation_id, error=report.error,
        annotations=[Annotation(**f.to_dict(), flagged=f.flagged) for f in report.findings],
        drafts_submitted=report.drafts_submitted, drafts_skipped=report.drafts_skipped,
        flagged_steps=report.flagged_steps,
    )


def draftmesh_info(served: ServedResult, request_id: str) -> DraftmeshInfo:
    r = served.result
    drafts = [s for s in r.steps if s.tree_size > 0]
    accepted = sum(s.accepted for s in r.steps)
    stats = r.source_stats()
    return DraftmeshInfo(
        request_id=request_id, lossless=r.lossless, policy=r.policy, lenient_tokens=r.lenient_tokens,
        steps=len(r.steps), tokens_per_step=r.mean_accepted_per_step,
        mean_acceptance_length=1.0 + accepted / len(drafts) if drafts else 1.0,
        num_drafts=len(drafts), num_draft_tokens=sum(s.tree_size for s in drafts), num_accepted_tokens=accepted,
        accepted_per_source={name: int(s.get("accepted", 0)) for name, s in sorted(stats.items())},
        sources=[SourceInfo(source=name, nodes=int(s.get("nodes", 0)), accepted_tokens=int(s.get("accepted", 0)),
                            acceptance=float(s.get("acceptance", 0.0)), failed_steps=int(s.get("failed_steps", 0)))
                 for name, s in sorted(stats.items())],
        replica=served.replica, seconds=r.seconds, first_token_ms=r.first_token_s * 1000.0,
        factcheck=factcheck_info(served.factcheck_report) if served.factcheck_report is not None else None,
    )


def response_id(endpoint: str, request_id: str) -> str:
    return ("chatcmpl-" if endpoint == "chat" else "cmpl-") + request_id


def completion(endpoint: str, served: ServedResult, request_id: str, model: str, created: int | None = None):
    """The whole answer of a non-streamed request."""
    created = int(time.time()) if created is None else created
    r = served.result
    info = draftmesh_info(served, request_id)
    rid = response_id(endpoint, request_id)
    if endpoint == "chat":
        choice = ChatChoice(message=ChatMessageOut(content=r.text), finish_reason=finish_reason(r.finish_reason))
        return ChatCompletion(id=rid, created=created, model=model, choices=[choice], usage=usage(served), draftmesh=info)
    choice = TextChoice(text=r.text, finish_reason=finish_reason(r.finish_reason))
    return TextCompletion(id=rid, created=created, model=model, choices=[choice], usage=usage(served), draftmesh=info)


def chunk(endpoint: str, request_id: str, model: str, created: int, *, text: str | None = None, role: bool = False,
          finish: str | None = None, served: ServedResult | None = None, with_usage: bool = False):
    """One streamed chunk: a step's text, or the end (finish reason and the draftmesh object), or with no
    choices, the usage (``stream_options.include_usage``)."""
    rid = response_id(endpoint, request_id)
    info = draftmesh_info(served, request_id) if served is not None and not with_usage else None
    use = usage(served) if served is not None and with_usage else None
    reason = finish_reason(finish) if finish is not None else None
    if endpoint == "chat":
        choices = [] if with_usage else [ChatChunkChoice(
            delta=ChatDelta(role="assistant" if role else None, content=text), finish_reason=reason)]
        return ChatCompletionChunk(id=rid, created=created, model=model, choices=choices, usage=use, draftmesh=info)
    choices = [] if with_usage else [TextChoice(text=text or "", finish_reason=reason)]
    return TextCompletion(id=rid, created=created, model=model, choices=choices, usage=use, draftmesh=info)
