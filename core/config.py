"""One typed config for every command and deployment: a root of documented sections.

``DraftmeshConfig`` holds the sections ``engine`` (the target model), ``sources`` (the draft
sources, in the verifier and outside it), ``builder`` (the token-tree builder), ``limits`` (what a
request may ask for), ``serve`` (the mesh: ports, replicas, auth, TLS, Redis) and ``factcheck``
(the fact-check service; also the worker's own config). It is filled from, in order: the
defaults, a YAML file (``--config``; one mapping per section), the environment, the command line.

The dataclass fields are the single source of truth. Each generates its flag
(``--<section prefix><field>``: ``--model``, ``--grpc-port``, ``--builder-min-gain``,
``--factcheck-workers``), its environment variable (``DRAFTMESH_`` + the flag: ``DRAFTMESH_MODEL``,
``DRAFTMESH_FACTCHECK_WORKERS``) and its YAML key (``serve: {grpc_port: 9000}``), so an option is
added in exactly one place, with its help text and bounds.

The environment is read here and nowhere else (``load_config``): DRAFTMESH_* and ``REDIS_URL``,
the fallback of ``serve.redis_url`` and ``factcheck.redis_url``. Deployments hand their replicas
the resolved config as plain data (``to_dict``/``from_dict``); replicas read no environment.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Mapping, Sequence

import yaml

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR"]
NerBackendName = Literal["spacy", "flair"]
WikidataMode = Literal["off", "offline", "live"]

ENV_PREFIX = "DRAFTMESH_"
REDIS_URL_ENV = "REDIS_URL"


def option(default: Any = dataclasses.MISSING, *, help: str, default_factory: Any = dataclasses.MISSING,
           min: float | None = None, max: float | None = None, flag: str | None = None,
           mesh_only: bool = False, env_fallback: str | None = None, fallback_alone: bool = False) -> Any:
    """A config field: its help text, bounds (checked by ``check_fields``), and how it is named.

    ``flag`` replaces the generated flag name (without ``--``); ``mesh_only`` keeps a fact-check
    field out of the worker's own command line; ``env_fallback`` names a variable read when the
    field's own is unset (``REDIS_URL``), with ``fallback_alone`` only when its section is loaded
    alone (the worker: in the mesh, the fact-check Redis defaults to ``serve.redis_url``)."""
    meta = {"help": help, "min": min, "max": max, "flag": flag, "mesh_only": mesh_only, "env_fallback": env_fallback,
            "fallback_alone": fallback_alone}
    if default_factory is not dataclasses.MISSING:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


def section(cls: type, *, help: str, prefix: str) -> Any:
    """A section of the root: flags of its fields start with ``prefix``."""
    return field(default_factory=cls, metadata={"help": help, "prefix": prefix})


def check_fields(obj: Any) -> None:
    """Bounds and choices of every field of a section, from its metadata and type: a ValueError
    names the field as ``<section>.<field>``."""
    hints = typing.get_type_hints(type(obj))
    where = getattr(obj, "SECTION", type(obj).__name__)
    for f in dataclasses.fields(obj):
        value, tp = getattr(obj, f.name), hints[f.name]
        name = f"{where}.{f.name}"
        if value is None:
            continue
        choices = _literal_choices(tp)
        if choices and value not in choices:
            raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
        lo, hi = f.metadata.get("min"), f.metadata.get("max")
        if lo is None and hi is None:
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise ValueError(f"{name} must be a number, got {value!r}")
        if lo is not None and value < lo:
            raise ValueError(f"{name} must be >= {lo:g}, got {value}")
        if hi is not None and value > hi:
            raise ValueError(f"{name} must be <= {hi:g}, got {value}")


# ====================================================================== sections
@dataclass(frozen=True)
class EngineConfig:
    """The target model and how this process runs it."""

    SECTION: ClassVar[str] = "engine"

    model: str = option("smollm2-135m", help="model spec: smollm2-135m, gemma3-270m, a path or a hub id")
    device: str = option("cpu", help="torch device, e.g. cpu or cuda:0")
    dtype: Dtype = option("auto", help="auto = float32 on CPU, bfloat16 on CUDA")
    threads: int = option(0, min=0, help="torch CPU threads (0 = torch default)")
    trace_steps: int = option(
        256, min=0,
        help="traced steps per request: a span per step (draft, sources, verify) for the first N steps; 0: none, the "
             "request span keeps the totals (tracing is on only with OTEL_EXPORTER_OTLP_ENDPOINT)",
    )
    kv_budget_bytes: int = option(
        2 << 30, min=1 << 20,
        help="bytes of target KV per replica: the batch's slab and the pooled sessions' and prefixes' KV together; a request that does "
             "not fit waits, one that never could gets RESOURCE_EXHAUSTED",
    )
    prefix_cache_size: int = option(
        64, min=0,
        help="finished requests without a session whose KV a verifier keeps, so that a later request of the same "
             "tenant that begins with the same tokens (a system prompt, a document, a chat's history) prefills only "
             "the rest; within engine.kv_budget_bytes (0: off)",
    )
    max_batch_tokens: int = option(512, min=1, help="tokens per batched forward: roots, draft trees and prefill chunks")
    prefill_chunk: int = option(128, min=1, help="prompt tokens of one request prefilled per step (chunked prefill)")
    prefill_while_decoding: int = option(
        32, min=1, help="prompt tokens per step for a prompt longer than prefill_chunk while other requests decode (bounds their step time)")
    max_batch_rows: int = option(32, min=1, help="requests decoded together in one batch")
    max_waiting: int = option(256, min=0, help="requests waiting for room in the batch before RESOURCE_EXHAUSTED")
    cost_cache: str | None = option(
        None,
        help="directory where the forward's measured costs (~18 s of timing at start) are kept, and read back by the "
             "next start on this machine with the same weights, threads and code (at most 32 files of a few KB); "
             "unset: measured at every start",
    )

    def __post_init__(self) -> None:
        check_fields(self)

    def torch_dtype(self):
        # lazy: the config is read where torch is not needed (the fact-check worker, `draftmesh health`)
        import torch

        from draftmesh.models import default_dtype

        return default_dtype(self.device) if self.dtype == "auto" else getattr(torch, self.dtype)

    def apply_threads(self) -> None:
        if self.threads:
            from draftmesh import compute  # lazy: as in torch_dtype

            compute.set_threads(self.threads)


@dataclass(frozen=True)
class DeploymentResources:
    """A Serve draft deployment's replicas and the resources of each."""

    num_replicas: int = option(1, min=1, help="replicas of the deployment")
    num_cpus: float = option(1.0, min=0, help="CPUs per replica")
    num_gpus: float = option(0.0, min=0, help="GPUs per replica")

    SECTION: ClassVar[str] = "sources.remote.<name>.deployment"

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class RemoteSource:
    """A draft source outside the verifier: an external gRPC ``DraftSource`` at ``address``, or a
    Serve draft deployment of a built-in source (or of ``factory``, a user's own)."""

    SECTION: ClassVar[str] = "sources.remote.<name>"

    address: str | None = option(None, help="host:port of an external draftmesh.v1.DraftSource server")
    deployment: DeploymentResources | None = option(None, help="a Serve draft deployment with these resources")
    factory: str | None = option(None, help="package.module:callable building the deployment's source, (env, **options)")
    options: dict[str, Any] = option(default_factory=dict, help="the source's own options")
    timeout_ms: int | None = option(None, min=1, help="per-call timeout (default: the step deadline)")
    token_ids: bool = option(False, help="external source: it shares the target's tokenizer, so its token ids are used")
    secure: bool = option(False, help="external source: TLS to the server")
    root_certificates: str | None = option(None, help="external source: PEM file of the CA to trust (implies secure)")
    api_key_file: str | None = option(
        None, help="external source: a file holding the bearer key its server asks for (draft-serve --api-key)"
    )

    def __post_init__(self) -> None:
        check_fields(self)
        if self.address is not None:
            if self.deployment is not None or self.factory is not None:
                raise ValueError("an external address cannot also be a deployment")
            if ":" not in self.address:
                raise ValueError(f"address must be host:port, got {self.address!r}")
        elif self.deployment is None and self.factory is None:
            raise ValueError("give address (external gRPC) or deployment/factory (Serve)")
        elif self.token_ids or self.secure or self.root_certificates or self.api_key_file:
            raise ValueError("token_ids, secure, root_certificates and api_key_file apply to an external address only")
        if self.factory is not None and ":" not in self.factory:
            raise ValueError(f"factory must look like package.module:callable, got {self.factory!r}")

    @property
    def external(self) -> bool:
        return self.address is not None

    @property
    def resources(self) -> DeploymentResources:
        return self.deployment or DeploymentResources()


IN_PROCESS_ONLY_SOURCES: tuple[str, ...] = ("recycle",)
"""Built-in sources the verifier feeds (``draftmesh.draft.base.SuccessorObserver``): never a Serve deployment."""


@dataclass(frozen=True)
class SourcesConfig:
    """The draft sources: which run inside the verifier, with what options, under what deadline,
    and which run outside it."""

    SECTION: ClassVar[str] = "sources"

    names: list[str] | None = option(None, flag="sources", help="in-verifier draft sources (default: all default sources)")
    deadline_ms: int = option(100, min=0, help="per-step deadline for draft sources (0 = none)")
    options: dict[str, dict[str, Any]] = option(
        default_factory=dict, help="per-source options, e.g. {rag: {paths: [docs/]}} (config file only)"
    )
    rag_budget_bytes: int = option(
        512 << 20, min=0,
        help="bytes of all live rag indexes of a replica together; a request whose documents do not fit drafts without them",
    )
    remote: dict[str, RemoteSource] = option(
        default_factory=dict,
        help="sources outside the verifier, by name: {address: host:port} for an external gRPC DraftSource, "
             "{deployment: {num_replicas, num_cpus, num_gpus}} for a Serve draft deployment of a built-in source, "
             "or {factory: module:callable} (config file only)",
    )

    def __post_init__(self) -> None:
        check_fields(self)
        for name, spec in self.remote.items():
            if name in IN_PROCESS_ONLY_SOURCES and spec.factory is None and not spec.external:
                raise ValueError(f"sources.remote.{name}: the {name} source learns from the verifier's own forwards, "
                                 "so it runs inside the verifier only: list it in sources.names")
        overlap = set(self.names or ()) & set(self.remote)
        if overlap:
            raise ValueError(f"sources {', '.join(sorted(overlap))} are listed both in-process (sources.names) "
                             "and remote (sources.remote)")

    @property
    def deadline_s(self) -> float | None:
        return self.deadline_ms / 1000 if self.deadline_ms else None


@dataclass(frozen=True)
class BuilderConfig:
    """The cost-aware token-tree builder (``draftmesh.verify.tree_builder``)."""

    SECTION: ClassVar[str] = "builder"

    max_nodes: int = option(64, min=0, max=1024, flag="max-nodes",
                            help="upper bound on token-tree nodes per step (the cost curve decides below it)")
    prior: tuple[float, float] = option(
        (3.0, 2.0), help="Beta(accepted, rejected) prior at depth 1, its first term scaled by the proposal's confidence"
    )
    deep_prior: tuple[float, float] = option(
        (9.0, 1.0), help="prior for depth > 1 given the parent was accepted (a draft that has started to match "
                         "usually goes on matching: history drafts measured 0.87-0.96 at depths 2-8)"
    )
    source_priors: dict[str, tuple[float, float]] = option(
        default_factory=dict, help="per-source depth-1 priors, {source: [a, b]} (config file only)"
    )
    min_gain: float = option(1.02, min=0, help="speculate only when the expected speedup over a plain step is at least this")
    fallback_after: int = option(4, min=1, help="consecutive steps with a tree but no accepted token before a cool-down")
    cooldown_steps: int = option(8, min=0, help="plain steps of a cool-down, before probing again")
    rest_after: int = option(
        4, min=0, help="steps in a row in which nothing of a request's sources was verified (none proposed, or the "
                       "batch's budget kept none of it) before it rests them: its next steps decode plainly without "
                       "asking them (0 = ask at every step)"
    )
    max_rest: int = option(4, min=1, help="the longest rest, in steps; rests grow 1, 2, 4, ... up to it, one probe step "
                                          "between two, and a probe whose draft is verified ends them")
    rest_min_rows: int = option(
        3, min=1, help="requests in a step's batch from which its requests rest: in a smaller batch asking costs a "
                       "row ~0.5 ms and the trees pay the most, so every step asks"
    )
    asking_probe_every: int = option(
        8, min=0, help="from rest_min_rows requests, the steps measure whether asking the sources pays at each batch "
                       "size (tokens per second of steps that asked against steps that asked nobody): where it does "
                       "not, one step in this many asks; where it does, one in twice this many asks nobody (0 = every "
                       "step asks, as the rests allow)"
    )
    calibration_halflife: float = option(
        64.0, min=1, help="verified trees over which the realized / predicted accepted-token ratio that scales "
                          "every node's score halves its weight (the budget's back-off from optimistic estimates)"
    )

    def __post_init__(self) -> None:
        check_fields(self)
        for name, pair in {"prior": self.prior, "deep_prior": self.deep_prior, **self.source_priors}.items():
            if len(pair) != 2 or not all(isinstance(x, (int, float)) and x > 0 for x in pair):
                raise ValueError(f"builder: the Beta prior for {name!r} must be two positive numbers, got {pair!r}")


@dataclass(frozen=True)
class LimitsConfig:
    """What one request may ask for at the front door (the router checks every field against
    these; sampling and speculation bounds are the request's own, in ``draftmesh.io_struct``)."""

    SECTION: ClassVar[str] = "limits"

    default_max_new_tokens: int = option(256, min=1, help="max_new_tokens when a request leaves it unset")
    max_new_tokens_cap: int = option(8192, min=1, help="largest max_new_tokens a request may ask for")
    max_prompt_bytes: int = option(65536, min=1, help="largest prompt (all messages together), in UTF-8 bytes")
    max_messages: int = option(1024, min=1, help="most chat messages per request")
    max_documents: int = option(16, min=0, help="most inline documents per request")
    max_document_bytes: int = option(262144, min=1, help="largest inline document, in UTF-8 bytes")
    max_document_total_bytes: int = option(1 << 20, min=1, help="all inline documents of a request together, in UTF-8 bytes")
    max_document_tokens: int = option(
        65536, min=1, help="all inline documents of a request together, in target tokens (the rag index takes ~0.5 KB a token)"
    )
    max_stop_strings: int = option(8, min=1, help="most stop strings per request")
    max_stop_bytes: int = option(256, min=1, help="longest stop string, in UTF-8 bytes")
    max_id_chars: int = option(128, min=1, help="longest request_id, session_id or document id")
    max_policy_params: int = option(16, min=0, help="most acceptance-policy parameters per request")
    max_policy_key_chars: int = option(64, min=1, help="longest policy parameter name")
    max_policy_value_chars: int = option(256, min=1, help="longest policy parameter value")
    max_factcheck_wait_ms: int = option(60000, min=0, help="longest fact-check wait a request may ask for")
    max_body_bytes: int = option(8 * 1024 * 1024, min=1024,
                                 help="largest HTTP request body and gRPC message, in bytes (beyond: HTTP 413, "
                                      "gRPC RESOURCE_EXHAUSTED at the gateway)")

    def __post_init__(self) -> None:
        check_fields(self)
        if self.default_max_new_tokens > self.max_new_tokens_cap:
            raise ValueError(f"limits.default_max_new_tokens ({self.default_max_new_tokens}) exceeds "
                             f"limits.max_new_tokens_cap ({self.max_new_tokens_cap})")


DEFAULT_TENANT = "default"
"""The tenant of bare keys (a key file line without a name, ``serve.api_keys``) and of every
request when auth is off."""
TENANT_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")


def check_tenant_name(name: Any, where: str) -> str:
    """A tenant name: 1-64 of [A-Za-z0-9_.-]. No '/', so ``<tenant>/<id>`` splits one way only."""
    if not isinstance(name, str) or not 1 <= len(name) <= 64 or not set(name) <= TENANT_NAME_CHARS:
        raise ValueError(f"{where}: tenant name {name!r} must be 1-64 characters of A-Z a-z 0-9 _ . -")
    return name


@dataclass(frozen=True)
class TenantConfig:
    """One tenant: its bearer keys, quotas and whom it shares its answer store with."""

    SECTION: ClassVar[str] = "serve.tenants.<name>"

    keys: list[str] | None = option(None, help="bearer keys of this tenant (more may come from the key file's "
                                               "'<tenant> <key>' lines)")
    max_in_flight: int | None = option(None, min=0, help="requests in flight at once (default: serve.tenant_max_in_flight; "
                                                         "0: unlimited)")
    tokens_per_minute: int | None = option(
        None, min=0, help="generated tokens per sliding minute (default: serve.tenant_tokens_per_minute; 0: unlimited)")
    share_answers_with: list[str] = option(
        default_factory=list, help="tenants whose exact (lossless) requests may draft from this tenant's answer store")

    def __post_init__(self) -> None:
        check_fields(self)
        for other in self.share_answers_with:
            check_tenant_name(other, f"{self.SECTION}.share_answers_with")


@dataclass(frozen=True)
class ServeConfig:
    """The served mesh (``draftmesh serve``, the Helm chart): ports, replicas, auth, TLS, Redis."""

    SECTION: ClassVar[str] = "serve"

    grpc_port: int = option(9000, min=1, max=65535, help="public gRPC port")
    http_port: int = option(
        8000, min=0, max=65535,
        help="public HTTP port of the OpenAI-compatible API (/v1/chat/completions, /v1/completions; 0: off, "
             "Serve's HTTP proxy then listens on loopback only)",
    )
    metrics_port: int = option(
        0, min=0, max=65535,
        help="Prometheus metrics port (/metrics) of the local Ray cluster `serve` starts (0: a free port, logged); "
             "on an existing cluster (--address) its nodes' own metrics export port",
    )
    address: str | None = option(None, help="Ray cluster address (default: start a local Ray)")
    verifier_replicas: int = option(1, min=1, help="verifier pool replicas (each holds the target model)")
    verifier_num_gpus: float = option(0.0, min=0, help="GPUs per verifier replica")
    verifier_num_cpus: float = option(1.0, min=0, help="CPUs reserved per verifier replica")
    verifier_max_ongoing: int = option(
        32, min=1, help="requests Serve routes to one verifier replica at once: up to engine.max_batch_rows of them "
                        "decode together in its batch, the rest wait in its queue (engine.max_waiting)")
    session_cache_size: int = option(64, min=0, help="sessions whose KV cache a verifier replica keeps")
    router_replicas: int = option(1, min=1, help="router (ingress) replicas")
    max_in_flight: int = option(32, min=1, help="requests a router replica admits at once; beyond: RESOURCE_EXHAUSTED")
    max_streams: int = option(
        256, min=1, help="gRPC calls the front door (gateway) serves at once; beyond: RESOURCE_EXHAUSTED"
    )
    drain_s: float = option(
        10.0, min=0, help="on Ctrl-C/SIGTERM, seconds in-flight calls get to finish before they are cancelled "
                          "and the mesh is stopped hard"
    )
    api_keys: list[str] | None = option(None, help="bearer tokens accepted by the router (unset: no auth)")
    api_keys_file: str | None = option(
        None, help="a file of bearer tokens, one per line (e.g. a mounted Kubernetes Secret), added to api_keys"
    )
    tenants: dict[str, TenantConfig] = option(
        default_factory=dict,
        help="tenants by name: {keys: [...], max_in_flight, tokens_per_minute, share_answers_with: [names]}; "
             "sessions, session KV, answers, document indexes and output annotations are scoped by tenant "
             "(config file only)",
    )
    tenant_max_in_flight: int = option(0, min=0, help="default per-tenant requests in flight (0: unlimited)")
    tenant_tokens_per_minute: int = option(
        0, min=0, help="default per-tenant generated tokens per sliding minute, max_new_tokens counted at admission "
                       "and corrected to the tokens generated (0: unlimited)")
    tls_cert: str | None = option(None, help="PEM certificate for the gRPC port (with --tls-key)")
    tls_key: str | None = option(None, help="PEM private key for the gRPC port")
    redis_url: str | None = option(
        None, env_fallback=REDIS_URL_ENV,
        help="the answer store's and fact-check streams' Redis (default: REDIS_URL, else an embedded redis-server)",
    )
    answer_store_max_bytes: int = option(
        256 << 20, min=0,
        help="bytes of answers and session turns the Redis answer store keeps (oldest evicted first; 0: no byte bound)",
    )
    redis_maxmemory_bytes: int = option(
        1 << 30, min=0,
        help="maxmemory of the embedded redis-server (policy volatile-lru: only keys with a TTL are evicted; 0: none)",
    )
    log_level: LogLevel = option("INFO", help="Ray Serve log level of the mesh's deployments and proxy")
    stream_interval: int = option(
        1, min=1, max=256,
        help="tokens a streamed delta carries at least: a verifier replica merges a request's steps until "
             "this many are ready (its first tokens and its last are sent at once). Each delta costs every "
             "hop (replica, router, proxy, gateway) CPU; under load, 2-8 leaves more of it to the forward",
    )

    def __post_init__(self) -> None:
        check_fields(self)
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("serve.tls_cert and serve.tls_key must be given together")
        for name in self.tenants:
            check_tenant_name(name, "serve.tenants")


@dataclass(frozen=True)
class FactCheckConfig:
    """The fact-check service: whether and how the mesh uses it, and the workers' own settings
    (``draftmesh factcheck-worker`` reads this section alone; env DRAFTMESH_FACTCHECK_*). The
    verifier and the router read the stream settings from the same object, so producers and
    workers always agree on names and bounds."""

    SECTION: ClassVar[str] = "factcheck"
    ENV_PREFIX: ClassVar[str] = "DRAFTMESH_FACTCHECK_"

    enabled: bool = option(True, flag="factcheck", mesh_only=True,
                           help="annotate outputs (and the drafts of lossy requests) with the fact-check service")
    workers: int = option(1, min=0, mesh_only=True,
                          help="fact-check workers `serve` starts on this machine (0: they run elsewhere)")
    python: str | None = option(
        None, mesh_only=True,
        help="Python of the workers' own environment (default: a .venv-factcheck beside this venv, else this interpreter)",
    )
    wait_ms: int = option(2000, min=0, mesh_only=True, help="how long a final message waits for its output's annotations")
    redis_url: str | None = option(None, env_fallback=REDIS_URL_ENV, fallback_alone=True,
                                   help="Redis of the streams and annotations (default: serve.redis_url; for a worker, "
                                        "REDIS_URL)")
    concurrency: int = option(1, min=1, help="spans a worker annotates at once")
    ner: NerBackendName = option("spacy", help="NER backend: spacy (packaged, offline) or flair")
    ner_model: str | None = option(None, help="spaCy package/path, or flair tagger path/hub name (default: the packaged spaCy pipeline)")
    wikidata: WikidataMode = option("off", help="entity checks: off, offline (dump files) or live (the API)")
    wikidata_dump: list[str] | None = option(None, help="dump-format JSON files for the offline entity store")
    wikidata_api: str = option("https://www.wikidata.org/w/api.php", help="Wikidata API endpoint (live mode)")
    wikidata_user_agent: str | None = option(
        None, help="User-Agent for the Wikidata API: name/version (contact URL or email), as Wikimedia asks"
    )
    wikidata_timeout_s: float = option(5.0, min=0.001, help="per-call timeout of the Wikidata API")
    wikidata_cache_ttl_s: int = option(86400, min=0, help="how long Wikidata answers stay cached in Redis")
    numeric_rules: str | None = option(None, help="YAML numeric rules (default: the packaged rules)")
    stream_prefix: str = option("draftmesh:factcheck", help="prefix of the stream, group and key names")
    maxlen: int = option(10000, min=1, help="approximate bound on the span stream's length (MAXLEN ~)")
    max_lag: int = option(1000, min=1, help="entries not yet read by the workers beyond which producers skip annotation")
    claim_idle_ms: int = option(30000, min=0, help="a pending entry idle this long is reclaimed from its (dead) worker")
    max_deliveries: int = option(3, min=1, help="deliveries after which an entry goes to the dead-letter stream")
    annotation_ttl_s: int = option(3600, min=1, help="lifetime of an annotation key")
    failed_ttl_s: int = option(
        60, min=1,
        help="lifetime of a 'failed' annotation of a content-keyed id (drafts, queries), after which the same "
             "text is checked again (outputs' keep annotation_ttl_s)",
    )
    annotate_timeout_s: float = option(
        60.0, min=0.001,
        help="longest one annotation may take; past it the entry is failed (retried, then dead-lettered) and "
             "its heartbeat stops",
    )
    max_waiters: int = option(
        4, min=1, mesh_only=True,
        help="FactCheck calls a router replica lets wait for an annotation at once; beyond: RESOURCE_EXHAUSTED "
             "(keep it under the router's 8 slots of headroom above serve.max_in_flight)",
    )
    max_wait_ms: int = option(10000, min=0, mesh_only=True, help="longest a FactCheck call waits, whatever it asks")
    block_ms: int = option(1000, min=1, help="how long one XREADGROUP waits for entries")

    def __post_init__(self) -> None:
        check_fields(self)
        if self.wikidata == "offline" and not self.wikidata_dump:
            raise ValueError("factcheck.wikidata=offline needs factcheck.wikidata_dump (dump-format JSON files)")
        if not self.stream_prefix:
            raise ValueError("factcheck.stream_prefix must not be empty")

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)


# ====================================================================== the root
@dataclass(frozen=True)
class DraftmeshConfig:
    """Every setting of draftmesh, by section (see the module docstring)."""

    engine: EngineConfig = section(EngineConfig, prefix="", help="the target model")
    sources: SourcesConfig = section(SourcesConfig, prefix="source-", help="the draft sources")
    builder: BuilderConfig = section(BuilderConfig, prefix="builder-", help="the token-tree builder")
    limits: LimitsConfig = section(LimitsConfig, prefix="", help="request limits at the front door")
    serve: ServeConfig = section(ServeConfig, prefix="", help="the served mesh")
    factcheck: FactCheckConfig = section(FactCheckConfig, prefix="factcheck-", help="the fact-check service")

    def to_dict(self) -> dict[str, Any]:
        """Plain data (nested by section) for Ray Serve's deployment args and the Helm chart's serveConfigV2."""
        return to_dict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> "DraftmeshConfig":
        """The config ``to_dict`` gave (or any subset of it: missing keys take their defaults)."""
        return from_dict(cls, data or {})

    def factcheck_config(self) -> FactCheckConfig:
        """The workers' config; its Redis defaults to the mesh's, so producers and workers meet."""
        if self.factcheck.redis_url or not self.serve.redis_url:
            return self.factcheck
        return dataclasses.replace(self.factcheck, redis_url=self.serve.redis_url)

    def replace(self, **sections: Mapping[str, Any]) -> "DraftmeshConfig":
        """A copy with some fields of some sections changed: ``cfg.replace(serve={"redis_url": url})``."""
        changes = {}
        for name, values in sections.items():
            current = getattr(self, name)
            changes[name] = dataclasses.replace(current, **values)
        return dataclasses.replace(self, **changes)


# ====================================================================== plain data
def to_dict(obj: Any) -> Any:
    """A config (or section) as plain YAML/JSON data: dataclasses to mappings, tuples to lists."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    return obj


def from_dict(cls: type, data: Mapping[str, Any], where: str = "") -> Any:
    """Build ``cls`` from plain data, converting nested sections, typed specs and pairs; an unknown
    key or a value of the wrong shape is a ValueError naming its path."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{where or cls.__name__} must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(_unknown_keys(cls, unknown, where))
    values = {name: _convert(hints[name], value, f"{where}{name}") for name, value in data.items()}
    place = where.rstrip(".")
    try:
        return cls(**values)
    except TypeError as exc:
        raise ValueError(f"{place or cls.__name__}: {exc}") from None
    except ValueError as exc:
        if place and not str(exc).startswith(place):  # a typed spec's own check: say which entry
            raise ValueError(f"{place}: {exc}") from None
        raise


def check_keys(cls: type, data: Any, where: str = "") -> None:
    """Unknown keys anywhere in plain config data (sections, typed specs), named by path."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{where.rstrip('.') or cls.__name__} must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(_unknown_keys(cls, unknown, where))
    for name, value in data.items():
        tp = _strip_optional(hints[name])
        if dataclasses.is_dataclass(tp) and isinstance(value, Mapping):
            check_keys(tp, value, f"{where}{name}.")
        elif typing.get_origin(tp) is dict and isinstance(value, Mapping):
            inner = _strip_optional(typing.get_args(tp)[1])
            if dataclasses.is_dataclass(inner):
                for key, spec in value.items():
                    check_keys(inner, spec, f"{where}{name}.{key}.")


def _convert(tp: Any, value: Any, where: str) -> Any:
    if value is None:
        return None
    tp = _strip_optional(tp)
    if dataclasses.is_dataclass(tp):
        if dataclasses.is_dataclass(value):
            return value
        return from_dict(tp, value, f"{where}.")
    origin = typing.get_origin(tp)
    if origin is dict:
        key_tp, value_tp = typing.get_args(tp)
        if not isinstance(value, Mapping):
            raise ValueError(f"{where} must be a mapping, got {type(value).__name__}")
        return {k: _convert(value_tp, v, f"{where}.{k}") for k, v in value.items()}
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{where} must be a list, got {value!r}")
        return tuple(value)
    if origin is list:
        if isinstance(value, str):
            return [x for x in value.split(",") if x]
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{where} must be a list, got {value!r}")
        return list(value)
    return value


def _unknown_keys(cls: type, unknown: Sequence[str], where: str) -> str:
    """Say which keys are unknown, and where each belongs when it is a field of another section
    (a flat pre-sections config file: ``grpc_port`` is ``serve.grpc_port``)."""
    hints = []
    if cls is DraftmeshConfig:
        for key in unknown:
            homes = [f"{s.name}.{key}" for s in dataclasses.fields(DraftmeshConfig)
                     if key in {f.name for f in dataclasses.fields(s.default_factory)}]
            hints.append(f"{key} (did you mean {' or '.join(homes)}?)" if homes else key)
    else:
        hints = list(unknown)
    place = where.rstrip(".") or ("the config" if cls is DraftmeshConfig else cls.__name__)
    return f"{place}: unknown keys {', '.join(hints)}"


# ====================================================================== flags and environment
@dataclass(frozen=True)
class Leaf:
    """One settable field: its path in the root, its flag, environment variable and argparse dest."""

    path: tuple[str, ...]
    field: dataclasses.Field
    type: Any
    flag: str
    env: str
    fallback: str | None = None
    """A second variable read when ``env`` is unset (and nothing else set the field)."""

    @property
    def dest(self) -> str:
        return self.flag.replace("-", "_")

    @property
    def name(self) -> str:
        return ".".join(self.path)

    @property
    def file_only(self) -> bool:
        """Mappings and typed specs are too structured for a flag: only the config file sets them."""
        return _has_origin(self.type, dict)


def leaves(cls: type = None, sections: Sequence[str] | None = None) -> list[Leaf]:
    """Every settable field of ``cls`` (the root by default; a section class alone, e.g. the
    fact-check worker's ``FactCheckConfig``, uses its own names and ``ENV_PREFIX``)."""
    cls = cls or DraftmeshConfig
    out: list[Leaf] = []
    if cls is DraftmeshConfig:
        for sec in dataclasses.fields(cls):
            if sections is not None and sec.name not in sections:
                continue
            out += _section_leaves(sec.default_factory, (sec.name,), sec.metadata["prefix"], None, root=True)
        return out
    return _section_leaves(cls, (), "", getattr(cls, "ENV_PREFIX", None), root=False)


def _section_leaves(cls: type, path: tuple[str, ...], prefix: str, env_prefix: str | None, *, root: bool) -> list[Leaf]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if not root and f.metadata.get("mesh_only"):
            continue
        flag = (f.metadata.get("flag") if root else None) or prefix + f.name.replace("_", "-")
        env = f"{env_prefix}{f.name.upper()}" if env_prefix else ENV_PREFIX + flag.upper().replace("-", "_")
        fallback = f.metadata.get("env_fallback") if not (root and f.metadata.get("fallback_alone")) else None
        out.append(Leaf(path + (f.name,), f, hints[f.name], flag, env, fallback))
    return out


def add_config_arguments(parser: argparse.ArgumentParser, cls: type = None,
                         sections: Sequence[str] | None = None) -> None:
    """``--config FILE`` and a flag per field of ``sections`` (default: all), grouped by section.
    Defaults are left as None so that unset flags do not override the file or the environment."""
    parser.add_argument("--config", type=Path, default=None, help="YAML config file (a mapping per section)")
    groups: dict[str, Any] = {}
    for leaf in leaves(cls, sections):
        if leaf.file_only:
            continue
        key = leaf.path[0] if len(leaf.path) > 1 else ""
        if key not in groups:
            groups[key] = parser.add_argument_group(f"{key} config" if key else "config") if key else parser
        kwargs: dict[str, Any] = {"default": None, "dest": leaf.dest,
                                  "help": f"{leaf.field.metadata.get('help', '')} [{leaf.name}; env {leaf.env}]"}
        tp = _strip_optional(leaf.type)
        if tp is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif _has_origin(tp, list):
            kwargs["type"] = lambda s: [x for x in s.split(",") if x]
            kwargs["metavar"] = "A,B,..."
        elif _has_origin(tp, tuple):
            kwargs["type"] = _float_pair(leaf.flag)
            kwargs["metavar"] = "A,B"
        elif _literal_choices(tp):
            kwargs["choices"] = _literal_choices(tp)
        elif tp in (int, float, str):
            kwargs["type"] = tp
        groups[key].add_argument("--" + leaf.flag, **kwargs)


def load_config(
    cls: type = None,
    *,
    file: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
):
    """Build ``cls`` (the root by default) from its defaults, a YAML file, the environment and
    ``overrides`` (by dotted path, ``{"serve.grpc_port": 9001}``; None values are skipped).

    This is the one place that reads the environment."""
    cls = cls or DraftmeshConfig
    data: dict[str, Any] = {}
    if file is not None:
        loaded = yaml.safe_load(Path(file).read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"config file {file} must hold a mapping")
        try:
            check_keys(cls, loaded)
        except ValueError as exc:
            raise ValueError(f"config file {file}: {exc}") from None
        data = loaded
    env = os.environ if env is None else env
    by_path = {leaf.name: leaf for leaf in leaves(cls)}
    for leaf in by_path.values():
        raw = env.get(leaf.env)
        if raw is not None and leaf.file_only:
            raise ValueError(f"{leaf.env}: {leaf.name} can only be set in the config file")
        if raw is None and leaf.fallback and _get(data, leaf.path) is None:
            raw = env.get(leaf.fallback)
        if raw is not None:
            _set(data, leaf.path, _parse_text(raw, leaf.type, leaf.env))
    for name, value in (overrides or {}).items():
        if value is None:
            continue
        if name not in by_path:
            raise ValueError(f"unknown config field {name!r}")
        _set(data, by_path[name].path, value)
    return from_dict(cls, data)


def config_from_args(args: argparse.Namespace, cls: type = None):
    """The config a command line asks for: ``--config``, the environment, then the flags."""
    overrides = {leaf.name: getattr(args, leaf.dest, None) for leaf in leaves(cls) if not leaf.file_only}
    return load_config(cls, file=getattr(args, "config", None), overrides=overrides)


# ====================================================================== helpers
def _strip_optional(tp: Any) -> Any:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, getattr(__import__("types"), "UnionType", None)) and len(args) == 1:
        return args[0]
    return tp


def _has_origin(tp: Any, origin: type) -> bool:
    return any(typing.get_origin(a) is origin for a in (tp, *typing.get_args(tp)))


def _literal_choices(tp: Any) -> tuple[str, ...]:
    tp = _strip_optional(tp)
    return typing.get_args(tp) if typing.get_origin(tp) is Literal else ()


def _float_pair(name: str):
    def parse(text: str) -> tuple[float, float]:
        parts = [x.strip() for x in text.split(",")]
        try:
            pair = tuple(float(x) for x in parts)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--{name}: expected two numbers A,B, got {text!r}") from None
        if len(pair) != 2:
            raise argparse.ArgumentTypeError(f"--{name}: expected two numbers A,B, got {text!r}")
        return pair

    return parse


def _parse_text(raw: str, tp: Any, var: str) -> Any:
    """An environment value as the field's type."""
    tp = _strip_optional(tp)
    if tp is bool:
        lowered = raw.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{var} must be true or false, got {raw!r}")
    if _has_origin(tp, list):
        return [x for x in raw.split(",") if x]
    if _has_origin(tp, tuple):
        try:
            return _float_pair(var)(raw)
        except argparse.ArgumentTypeError as exc:
            raise ValueError(str(exc)) from None
    for kind, word in ((int, "an integer"), (float, "a number")):
        if tp is kind:
            try:
                return kind(raw)
            except ValueError:
                raise ValueError(f"{var} must be {word}, got {raw!r}") from None
    return raw


def _get(data: Mapping[str, Any], path: Sequence[str]) -> Any:
    for key in path:
        if not isinstance(data, Mapping) or key not in data:
            return None
        data = data[key]
    return data


def _set(data: dict[str, Any], path: Sequence[str], value: Any) -> None:
    for key in path[:-1]:
        data = data.setdefault(key, {})
    data[path[-1]] = value


DEFAULT_SOURCE_DEADLINE_S = SourcesConfig().deadline_s
"""The step's source deadline of a decoder built without a config (``sources.deadline_ms``'s default)."""
