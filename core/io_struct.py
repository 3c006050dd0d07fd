"""The messages between the parts, defined once (like SGLang's ``io_struct``).

Every request, step and result that crosses a boundary is one of these frozen dataclasses:

- router → verifier replica (pickled by Ray): ``ServeRequest`` (text, before tokenization);
- replica → decode loop: ``GenerationRequest`` (token ids), built by ``ServeRequest.to_generation``;
- decode loop → replica: a ``StepEvent`` per step, then the ``GenerationResult``;
- replica → router: ``Rejected``, ``StepEvent``s, then a ``ServedResult`` (the engine's result with
  the replica that served it and the output's ``FactCheckReport``);
- fact-check worker → Redis → verifier and router: ``Finding``.

The two requests share their parameter groups (``SamplingParams``, ``SpeculationParams``), and
what each field may hold is checked here, in the group's constructor, whichever door a request
came in by: a bad value raises ``InvalidField`` naming the field.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

FinishReason = Literal["eos", "stop", "length"]
"""eos: the model ended; stop: a stop string; length: max_new_tokens reached."""
SourceFailure = Literal["error", "timeout", "busy"]
"""Why a draft source gave nothing this step: it raised, missed the deadline, or was still busy."""
FactCheckStatus = Literal["done", "pending", "skipped", "unavailable", "failed"]
FindingVerdict = Literal["supported", "contradicted", "not_found", "ambiguous", "unverified"]
"""supported: a source agrees; contradicted: a source or rule disagrees (wrong date, type,
figure, impossible date); not_found: no such entity; ambiguous: several entities match;
unverified: nothing applicable to check against (or the lookup failed)."""
Role = Literal["system", "user", "assistant"]
ROLES: tuple[str, ...] = ("system", "user", "assistant")

FLAGGING: frozenset[str] = frozenset({"contradicted", "not_found"})
"""Verdicts that flag a span: lossy acceptance policies never accept it leniently."""

MAX_TEMPERATURE = 100.0
"""Beyond this the softmax is uniform to float precision: a larger value is a client's mistake."""
MAX_TOP_K = 1_000_000
MAX_TREE_NODES = 1024
"""Most nodes one step's token tree may hold (a request's ``max_nodes`` and any builder stay below)."""
MAX_SOURCE_CAP = 256
"""Drafted tokens one source may contribute per step (no step verifies more)."""


class InvalidField(ValueError):
    """A request field breaks a rule; ``str()`` reads ``"<field>: <rule>"``. The router answers it
    with INVALID_ARGUMENT, the library raises it as the ``ValueError`` it is."""

    def __init__(self, field: str, rule: str) -> None:
        super().__init__(f"{field}: {rule}")
        self.field = field
        self.rule = rule


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# ---------------------------------------------------------------------- parameter groups
@dataclass(frozen=True)
class SamplingParams:
    """How the next token is drawn: the same law for plain and speculative decoding."""

    temperature: float = 0.0
    """0 means greedy (argmax); top_p/top_k are then ignored."""
    top_p: float = 1.0
    top_k: int = 0
    """0 disables top-k."""
    seed: int | None = None

    def __post_init__(self) -> None:
        t, p = self.temperature, self.top_p
        if not _is_number(t) or not math.isfinite(t) or not 0.0 <= t <= MAX_TEMPERATURE:
            raise InvalidField("temperature", f"must be a finite number in [0, {MAX_TEMPERATURE:g}], got {t!r}")
        if not _is_number(p) or not math.isfinite(p) or not 0.0 < p <= 1.0:
            raise InvalidField("top_p", f"must be in (0, 1], got {p!r}")
        if not _is_int(self.top_k) or not 0 <= self.top_k <= MAX_TOP_K:
            raise InvalidField("top_k", f"must be an integer in [0, {MAX_TOP_K}] (0 = off), got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            raise InvalidField("seed", f"must be a non-negative integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def generator(self):
        """A torch generator seeded with ``seed`` (or from the OS)."""
        import torch  # lazy: io_struct is imported where torch is not (the fact-check worker)

        gen = torch.Generator()
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(self.seed)
        return gen


@dataclass(frozen=True)
class SpeculationParams:
    """How a request may be sped up: which sources, how big a tree, which acceptance policy."""

    enabled: bool = True
    """False: plain decoding (the baseline)."""
    sources: tuple[str, ...] | None = None
    """Which of the engine's sources to ask (None: all of them)."""
    source_caps: Mapping[str, int] = field(default_factory=dict)
    """Per source, the most drafted tokens it may contribute per step."""
    max_nodes: int | None = None
    """Cap on tree nodes per step for this request (the builder's own cap still applies)."""
    policy: str = "exact"
    """Acceptance policy; anything but "exact" is a lossy opt-in."""
    policy_params: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.sources is not None:
            for i, name in enumerate(self.sources):
                if not isinstance(name, str) or not name:
                    raise InvalidField(f"speculation.sources[{i}]", "must be a non-empty source name")
                if name in self.sources[:i]:
                    raise InvalidField(f"speculation.sources[{i}]", f"draft source {name!r} is listed twice")
        for name, cap in self.source_caps.items():
            if not _is_int(cap) or not 0 <= cap <= MAX_SOURCE_CAP:
                raise InvalidField(f"speculation.source_caps[{name}]", f"must be an integer in [0, {MAX_SOURCE_CAP}], got {cap!r}")
        if self.max_nodes is not None and (not _is_int(self.max_nodes) or not 0 <= self.max_nodes <= MAX_TREE_NODES):
            raise InvalidField("speculation.max_nodes", f"must be an integer in [0, {MAX_TREE_NODES}], got {self.max_nodes!r}")
        if not isinstance(self.policy, str) or not self.policy:
            raise InvalidField("speculation.policy", "must name an acceptance policy")

    @property
    def lossless(self) -> bool:
        return self.policy == "exact"


@dataclass(frozen=True)
class FactCheckOptions:
    """Whether (and how long) a served request's output waits for its fact-check annotation."""

    enabled: bool = True
    """Annotate the output (when the mesh runs the fact-check service)."""
    wait_ms: int | None = None
    """How long the result may wait for the output's annotations (None: the server's default)."""


# ---------------------------------------------------------------------- requests
@dataclass(frozen=True)
class GenerationRequest:
    """What the decode loop runs: token ids and the request's parameters."""

    prompt_ids: tuple[int, ...]
    max_new_tokens: int = 128
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    speculation: SpeculationParams = SpeculationParams()
    request_id: str = ""
    session_id: str | None = None
    documents: tuple[str, ...] = ()
    tenant: str = "default"
    """Whose answer store the request reads and writes (its ids are already scoped by the router)."""
    reads_answers_of: tuple[str, ...] = ()
    """Other tenants sharing their answers with this one (used by exact requests only)."""


@dataclass(frozen=True)
class ServeRequest:
    """What the router sends a verifier replica (every field validated against the request
    rules; the replica checks what only the model knows and answers ``Rejected`` for that)."""

    request_id: str
    prompt: str | None = None
    """Raw text, no chat template. Exactly one of prompt and messages is set."""
    messages: tuple[tuple[str, str], ...] | None = None
    """(role, content) turns; the model's chat template is applied."""
    max_new_tokens: int = 256
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    session_id: str | None = None
    documents: tuple[str, ...] = ()
    speculation: SpeculationParams = SpeculationParams()
    factcheck_options: FactCheckOptions = FactCheckOptions()
    trace_context: Mapping[str, str] = field(default_factory=dict)
    """W3C trace headers of the router's span (Ray carries no trace context across a handle call)."""
    tenant: str = "default"
    """The caller's tenant; ``request_id`` and ``session_id`` are ``<tenant>/<id>`` (``draftmesh.tenancy``)."""
    reads_answers_of: tuple[str, ...] = ()

    def to_generation(self, prompt_ids: tuple[int, ...]) -> GenerationRequest:
        """The decode loop's request, once the replica has tokenized the prompt."""
        return GenerationRequest(
            prompt_ids=tuple(prompt_ids), max_new_tokens=self.max_new_tokens, sampling=self.sampling,
            stop=self.stop, speculation=self.speculation, request_id=self.request_id,
            session_id=self.session_id, documents=self.documents, tenant=self.tenant,
            reads_answers_of=self.reads_answers_of,
        )

    def with_trace_context(self, carrier: Mapping[str, str]) -> "ServeRequest":
        return dataclasses.replace(self, trace_context=dict(carrier))


@dataclass(frozen=True)
class Rejected:
    """The replica refused the request before decoding; ``message`` says why."""

    message: str
    reason: Literal["invalid", "busy"] = "invalid"
    """``invalid``: the request itself (INVALID_ARGUMENT); ``busy``: the replica's KV budget or queue
    is full now (RESOURCE_EXHAUSTED)."""


# ---------------------------------------------------------------------- steps and results
@dataclass(frozen=True)
class StepRecord:
    """What one step (one target forward) did, per source."""

    tree_size: int
    accepted: int
    """Drafted tokens accepted this step (the bonus/correction token not counted)."""
    emitted: int
    """Tokens committed this step: accepted + 1, less any cut by EOS/stop/budget."""
    draft_s: float
    verify_s: float
    proposed_by_source: Mapping[str, int] = field(default_factory=dict)
    """Proposals each source returned this step."""
    nodes_by_source: Mapping[str, int] = field(default_factory=dict)
    """Verified tree nodes each source proposed (a node can count for several)."""
    accepted_by_source: Mapping[str, int] = field(default_factory=dict)
    failed_sources: tuple[str, ...] = ()
    lenient: int = 0
    """Accepted tokens that only a lossy policy let through."""

    def plus(self, later: "StepRecord") -> "StepRecord":
        """What this step and ``later`` did together: counts and times summed, failed sources once each."""
        return StepRecord(
            tree_size=self.tree_size + later.tree_size,
            accepted=self.accepted + later.accepted,
            emitted=self.emitted + later.emitted,
            draft_s=self.draft_s + later.draft_s,
            verify_s=self.verify_s + later.verify_s,
            proposed_by_source=_summed(self.proposed_by_source, later.proposed_by_source),
            nodes_by_source=_summed(self.nodes_by_source, later.nodes_by_source),
            accepted_by_source=_summed(self.accepted_by_source, later.accepted_by_source),
            failed_sources=tuple(dict.fromkeys((*self.failed_sources, *later.failed_sources))),
            lenient=self.lenient + later.lenient,
        )


def _summed(a: Mapping[str, int], b: Mapping[str, int]) -> dict[str, int]:
    out = dict(a)
    for key, n in b.items():
        out[key] = out.get(key, 0) + n
    return out


@dataclass(frozen=True)
class StepEvent:
    """New tokens and the text safe to stream (possibly empty): one step's, or, once a replica
    coalesces them for a stream (``serve.stream_interval``), ``steps`` consecutive steps'."""

    token_ids: tuple[int, ...]
    text: str
    record: StepRecord
    steps: int = 1
    """Target forwards this event covers; ``record`` sums them."""

    def then(self, later: "StepEvent") -> "StepEvent":
        """This event followed by ``later``, as one."""
        return StepEvent(self.token_ids + later.token_ids, self.text + later.text, self.record.plus(later.record),
                         self.steps + later.steps)


@dataclass(frozen=True)
class GenerationResult:
    """The engine's answer to one ``GenerationRequest``."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason
    prompt_tokens: int
    steps: tuple[StepRecord, ...]
    seconds: float
    first_token_s: float
    policy: str = "exact"
    lossless: bool = True
    lenient_tokens: int = 0
    reused_tokens: int = 0
    """Prompt tokens whose KV came from the session's previous request (not prefilled)."""

    @property
    def mean_accepted_per_step(self) -> float:
        """Tokens committed per target forward (1.0 for plain decoding)."""
        return len(self.token_ids) / max(1, len(self.steps))

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.seconds if self.seconds > 0 else 0.0

    def source_stats(self) -> dict[str, dict[str, float]]:
        """Per source: tree nodes proposed, tokens accepted, acceptance rate, failed steps."""
        out: dict[str, dict[str, float]] = {}
        for step in self.steps:
            for name in {*step.nodes_by_source, *step.accepted_by_source, *step.failed_sources}:
                entry = out.setdefault(name, {"nodes": 0, "accepted": 0, "failed_steps": 0})
                entry["nodes"] += step.nodes_by_source.get(name, 0)
                entry["accepted"] += step.accepted_by_source.get(name, 0)
                entry["failed_steps"] += name in step.failed_sources
        for entry in out.values():
            entry["acceptance"] = entry["accepted"] / entry["nodes"] if entry["nodes"] else 0.0
        return out


@dataclass(frozen=True)
class Finding:
    """One check's verdict on one span of a text; travels as JSON through Redis and reaches the
    client in the ``Generate`` final message, so its fields are plain strings and ints."""

    check: str
    """Which check: "wikidata", "date" or "numeric"."""
    start: int
    end: int
    """Character offsets of the span in the checked text."""
    text: str
    verdict: FindingVerdict
    label: str = ""
    """The NER label of the span (PERSON, DATE, ...) or the kind of figure."""
    rule: str = ""
    """What was checked: "exists", "type", "birth_date", a numeric rule's name, ..."""
    entity_id: str = ""
    """The Wikidata id the span was linked to, if any."""
    evidence: str = ""
    """Why, for a human: the claim it was compared with, the rule's range, the parse error."""

    @property
    def flagged(self) -> bool:
        return self.verdict in FLAGGING

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Finding":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unknown finding fields: {', '.join(sorted(unknown))}")
        return cls(**data)


@dataclass(frozen=True)
class FactCheckReport:
    """What the client sees of a served output's fact-check (``GenerateResult.factcheck``)."""

    status: FactCheckStatus
    annotation_id: str = ""
    findings: tuple[Finding, ...] = ()
    error: str = ""
    drafts_submitted: int = 0
    drafts_skipped: int = 0
    flagged_steps: int = 0


@dataclass(frozen=True)
class ServedResult:
    """A served request's end: the engine's result, the replica that ran it, its fact-check."""

    result: GenerationResult
    replica: str
    factcheck_report: FactCheckReport | None = None
