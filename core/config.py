"""One typed engine config, filled from defaults < YAML file < DRAFTMESH_* env < CLI flags.

The dataclass is the single source of truth: its fields generate the CLI flags and the
env names, so a new option is added in exactly one place.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping

import yaml

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR"]


@dataclass
class EngineConfig:
    model: str = field(default="smollm2-135m", metadata={"help": "model spec: smollm2-135m, gemma3-270m, a path or a hub id"})
    device: str = field(default="cpu", metadata={"help": "torch device, e.g. cpu or cuda:0"})
    dtype: Dtype = field(default="auto", metadata={"help": "auto = float32 on CPU, bfloat16 on CUDA"})
    threads: int = field(default=0, metadata={"help": "torch CPU threads (0 = torch default)"})
    sources: list[str] | None = field(default=None, metadata={"help": "draft sources (default: all default sources)"})
    source_deadline_ms: int = field(default=100, metadata={"help": "per-step deadline for draft sources (0 = none)"})
    source_options: dict[str, dict[str, Any]] | None = field(
        default=None, metadata={"help": "per-source options, e.g. {rag: {paths: [docs/]}} (config file only)"}
    )
    max_nodes: int = field(default=64, metadata={"help": "upper bound on token-tree nodes per step (the cost curve decides below it)"})
    trace_steps: int = field(
        default=256,
        metadata={"help": "traced steps per request: a span per step (draft, sources, verify) for the first N steps; "
                          "0: none, the request span keeps the totals (tracing is on only with OTEL_EXPORTER_OTLP_ENDPOINT)"},
    )

    def __post_init__(self) -> None:
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0, got {self.threads}")
        if self.source_deadline_ms < 0:
            raise ValueError(f"source_deadline_ms must be >= 0, got {self.source_deadline_ms}")
        if self.max_nodes < 0:
            raise ValueError(f"max_nodes must be >= 0, got {self.max_nodes}")
        if self.trace_steps < 0:
            raise ValueError(f"trace_steps must be >= 0, got {self.trace_steps}")
        if self.dtype not in typing.get_args(Dtype):
            raise ValueError(f"dtype must be one of {', '.join(typing.get_args(Dtype))}, got {self.dtype!r}")

    def torch_dtype(self):
        import torch

        from draftmesh.models import default_dtype

        return default_dtype(self.device) if self.dtype == "auto" else getattr(torch, self.dtype)

    @property
    def source_deadline_s(self) -> float | None:
        return self.source_deadline_ms / 1000 if self.source_deadline_ms else None

    def apply_threads(self) -> None:
        if self.threads:
            import torch

            torch.set_num_threads(self.threads)


@dataclass
class MeshConfig(EngineConfig):
    """The engine config plus what the served mesh needs (``draftmesh serve``, the Helm chart)."""

    grpc_port: int = field(default=9000, metadata={"help": "public gRPC port"})
    metrics_port: int = field(
        default=0,
        metadata={"help": "Prometheus metrics port (/metrics) of the local Ray cluster `serve` starts (0: a free port, "
                          "logged); on an existing cluster (--address) its nodes' own metrics export port"},
    )
    address: str | None = field(default=None, metadata={"help": "Ray cluster address (default: start a local Ray)"})
    verifier_replicas: int = field(default=1, metadata={"help": "verifier pool replicas (each holds the target model)"})
    verifier_num_gpus: float = field(default=0.0, metadata={"help": "GPUs per verifier replica"})
    verifier_num_cpus: float = field(default=1.0, metadata={"help": "CPUs reserved per verifier replica"})
    verifier_max_ongoing: int = field(default=4, metadata={"help": "requests one verifier replica runs at once (steps interleave)"})
    router_replicas: int = field(default=1, metadata={"help": "router (ingress) replicas"})
    max_in_flight: int = field(default=32, metadata={"help": "requests a router replica admits at once; beyond: RESOURCE_EXHAUSTED"})
    remote_sources: dict[str, dict[str, Any]] | None = field(
        default=None,
        metadata={"help": "sources outside the verifier: {name: {address: host:port}} for an external gRPC "
                          "DraftSource, {name: {deployment: {num_replicas, num_cpus, num_gpus}}} for a Serve "
                          "draft deployment of a built-in source or {factory: module:callable} (config file only)"},
    )
    api_keys: list[str] | None = field(default=None, metadata={"help": "bearer tokens accepted by the router (unset: no auth)"})
    tls_cert: str | None = field(default=None, metadata={"help": "PEM certificate for the gRPC port (with --tls-key)"})
    tls_key: str | None = field(default=None, metadata={"help": "PEM private key for the gRPC port"})
    redis_url: str | None = field(default=None, metadata={"help": "answer-store Redis (default: REDIS_URL, else an embedded redis-server)"})
    default_max_new_tokens: int = field(default=256, metadata={"help": "max_new_tokens when a request leaves it unset"})
    max_prompt_bytes: int = field(default=65536, metadata={"help": "largest prompt (all messages together), in UTF-8 bytes"})
    max_documents: int = field(default=16, metadata={"help": "most inline documents per request"})
    max_document_bytes: int = field(default=262144, metadata={"help": "largest inline document, in UTF-8 bytes"})
    max_stop_strings: int = field(default=8, metadata={"help": "most stop strings per request"})
    session_cache_size: int = field(default=64, metadata={"help": "sessions whose KV cache a verifier replica keeps"})
    log_level: LogLevel = field(default="INFO", metadata={"help": "Ray Serve log level of the mesh's deployments and proxy"})
    factcheck: bool = field(default=True, metadata={"help": "annotate outputs (and the drafts of lossy requests) with the fact-check service"})
    factcheck_workers: int = field(default=1, metadata={"help": "fact-check workers `serve` starts on this machine (0: they run elsewhere)"})
    factcheck_python: str | None = field(
        default=None,
        metadata={"help": "Python of the workers' own environment (default: DRAFTMESH_FACTCHECK_PYTHON, else a "
                          ".venv-factcheck beside this venv, else this interpreter)"},
    )
    factcheck_wait_ms: int = field(default=2000, metadata={"help": "how long a final message waits for its output's annotations"})
    factcheck_options: dict[str, Any] | None = field(
        default=None, metadata={"help": "the workers' and streams' settings: FactCheckConfig fields (config file only)"}
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("verifier_replicas", "router_replicas", "max_in_flight", "verifier_max_ongoing",
                     "default_max_new_tokens", "max_prompt_bytes", "max_document_bytes", "max_stop_strings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("verifier_num_gpus", "verifier_num_cpus", "max_documents", "session_cache_size"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 < self.grpc_port < 65536:
            raise ValueError(f"grpc_port must be in 1..65535, got {self.grpc_port}")
        if not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in 0..65535, got {self.metrics_port}")
        if self.log_level not in typing.get_args(LogLevel):
            raise ValueError(f"log_level must be one of {', '.join(typing.get_args(LogLevel))}, got {self.log_level!r}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key must be given together")
        for name, spec in (self.remote_sources or {}).items():
            if not isinstance(spec, dict) or len({"address", "deployment", "factory"} & set(spec)) == 0:
                raise ValueError(f"remote_sources.{name}: give address (external gRPC) or deployment/factory (Serve)")
            unknown = set(spec) - {"address", "deployment", "factory", "options", "timeout_ms",
                                   "token_ids", "secure", "root_certificates"}
            if unknown:
                raise ValueError(f"remote_sources.{name}: unknown keys {', '.join(sorted(unknown))}")
            if "address" in spec and ({"deployment", "factory"} & set(spec)):
                raise ValueError(f"remote_sources.{name}: an external address cannot also be a deployment")
        if self.factcheck_workers < 0 or self.factcheck_wait_ms < 0:
            raise ValueError("factcheck_workers and factcheck_wait_ms must be >= 0")
        known = {f.name for f in dataclasses.fields(FactCheckConfig)}
        unknown = sorted(set(self.factcheck_options or {}) - known)
        if unknown:
            raise ValueError(f"factcheck_options: unknown keys {', '.join(unknown)}")
        try:
            self.factcheck_config()
        except ValueError as exc:
            raise ValueError(f"factcheck_options: {exc}") from None
        overlap = set(self.sources or ()) & set(self.remote_sources or {})
        if overlap:
            raise ValueError(f"sources {', '.join(sorted(overlap))} are listed both in-process and remote")

    def to_dict(self) -> dict[str, Any]:
        """Plain data for Ray Serve's deployment args and the Helm chart's serveConfigV2."""
        return dataclasses.asdict(self)

    def factcheck_config(self) -> "FactCheckConfig":
        """The workers' config; its Redis defaults to the mesh's, so producers and workers meet."""
        options = dict(self.factcheck_options or {})
        options["redis_url"] = options.get("redis_url") or self.redis_url
        return FactCheckConfig(**options)


NerBackendName = Literal["spacy", "flair"]
WikidataMode = Literal["off", "offline", "live"]


@dataclass
class FactCheckConfig:
    """The fact-check worker's config (``draftmesh factcheck-worker``; env DRAFTMESH_FACTCHECK_*).

    The verifier and the router read the stream settings from the same object, so producer
    and workers always agree on names and bounds."""

    ENV_PREFIX = "DRAFTMESH_FACTCHECK_"

    redis_url: str | None = field(default=None, metadata={"help": "Redis holding the streams and annotations (default: REDIS_URL)"})
    concurrency: int = field(default=1, metadata={"help": "spans a worker annotates at once"})
    ner: NerBackendName = field(default="spacy", metadata={"help": "NER backend: spacy (packaged, offline) or flair"})
    ner_model: str | None = field(default=None, metadata={"help": "spaCy package/path, or flair tagger path/hub name (default: the packaged spaCy pipeline)"})
    wikidata: WikidataMode = field(default="off", metadata={"help": "entity checks: off, offline (dump files) or live (the API)"})
    wikidata_dump: list[str] | None = field(default=None, metadata={"help": "dump-format JSON files for the offline entity store"})
    wikidata_api: str = field(default="https://www.wikidata.org/w/api.php", metadata={"help": "Wikidata API endpoint (live mode)"})
    wikidata_user_agent: str | None = field(
        default=None, metadata={"help": "User-Agent for the Wikidata API: name/version (contact URL or email), as Wikimedia asks"}
    )
    wikidata_timeout_s: float = field(default=5.0, metadata={"help": "per-call timeout of the Wikidata API"})
    wikidata_cache_ttl_s: int = field(default=86400, metadata={"help": "how long Wikidata answers stay cached in Redis"})
    numeric_rules: str | None = field(default=None, metadata={"help": "YAML numeric rules (default: the packaged rules)"})
    stream_prefix: str = field(default="draftmesh:factcheck", metadata={"help": "prefix of the stream, group and key names"})
    maxlen: int = field(default=10000, metadata={"help": "approximate bound on the span stream's length (MAXLEN ~)"})
    max_lag: int = field(default=1000, metadata={"help": "entries not yet read by the workers beyond which producers skip annotation"})
    claim_idle_ms: int = field(default=30000, metadata={"help": "a pending entry idle this long is reclaimed from its (dead) worker"})
    max_deliveries: int = field(default=3, metadata={"help": "deliveries after which an entry goes to the dead-letter stream"})
    annotation_ttl_s: int = field(default=3600, metadata={"help": "lifetime of an annotation key"})
    block_ms: int = field(default=1000, metadata={"help": "how long one XREADGROUP waits for entries"})

    def __post_init__(self) -> None:
        for name in ("concurrency", "maxlen", "max_lag", "max_deliveries", "annotation_ttl_s", "block_ms"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.claim_idle_ms < 0 or self.wikidata_timeout_s <= 0 or self.wikidata_cache_ttl_s < 0:
            raise ValueError("claim_idle_ms and wikidata_cache_ttl_s must be >= 0, wikidata_timeout_s > 0")
        if self.ner not in typing.get_args(NerBackendName):
            raise ValueError(f"ner must be one of {', '.join(typing.get_args(NerBackendName))}, got {self.ner!r}")
        if self.wikidata not in typing.get_args(WikidataMode):
            raise ValueError(f"wikidata must be one of {', '.join(typing.get_args(WikidataMode))}, got {self.wikidata!r}")
        if self.wikidata == "offline" and not self.wikidata_dump:
            raise ValueError("wikidata=offline needs wikidata_dump (dump-format JSON files)")
        if not self.stream_prefix:
            raise ValueError("stream_prefix must not be empty")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _is_list(tp: Any) -> bool:
    return any(typing.get_origin(a) is list for a in (tp, *typing.get_args(tp)))


def add_config_arguments(parser: argparse.ArgumentParser, cls: type = EngineConfig) -> None:
    """Add a flag per config field (defaults left as None so unset flags do not override)."""
    parser.add_argument("--config", type=Path, default=None, help="YAML config file")
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if any(typing.get_origin(a) is dict for a in (tp, *typing.get_args(tp))):
            continue  # structured options come from the config file
        kwargs: dict[str, Any] = {"default": None, "help": f.metadata.get("help", "")}
        if _is_list(tp):
            kwargs["type"] = lambda s: [x for x in s.split(",") if x]
            kwargs["metavar"] = "A,B,..."
        elif typing.get_origin(tp) is Literal:
            kwargs["choices"] = typing.get_args(tp)
        elif tp in (int, float, str):
            kwargs["type"] = tp
        elif any(a in (int, float) for a in typing.get_args(tp)):
            kwargs["type"] = next(a for a in typing.get_args(tp) if a in (int, float))
        parser.add_argument(_flag(f.name), dest=f.name, **kwargs)


def load_config(
    cls: type = EngineConfig,
    *,
    file: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
):
    """Build ``cls`` from its defaults, a YAML file, DRAFTMESH_<FIELD> env vars and overrides."""
    values: dict[str, Any] = {}
    names = {f.name for f in dataclasses.fields(cls)}
    if file is not None:
        data = yaml.safe_load(Path(file).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"config file {file} must hold a mapping")
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"config file {file}: unknown keys {', '.join(unknown)}")
        values.update(data)
    hints = typing.get_type_hints(cls)
    env = os.environ if env is None else env
    prefix = getattr(cls, "ENV_PREFIX", "DRAFTMESH_")
    for name in names:
        var = f"{prefix}{name.upper()}"
        raw = env.get(var)
        if raw is not None and any(typing.get_origin(a) is dict for a in (hints[name], *typing.get_args(hints[name]))):
            raise ValueError(f"{var}: {name} can only be set in the config file")
        if raw is not None:
            values[name] = _parse_env(raw, hints[name], var)
    values.update({k: v for k, v in (overrides or {}).items() if v is not None and k in names})
    return cls(**values)


def config_from_args(args: argparse.Namespace, cls: type = EngineConfig):
    overrides = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(cls)}
    return load_config(cls, file=getattr(args, "config", None), overrides=overrides)


def _parse_env(raw: str, tp: Any, var: str) -> Any:
    if _is_list(tp):
        return [x for x in raw.split(",") if x]
    for kind, word in ((int, "an integer"), (float, "a number")):
        if tp is kind or kind in typing.get_args(tp) and str not in typing.get_args(tp):
            try:
                return kind(raw)
            except ValueError:
                raise ValueError(f"{var} must be {word}, got {raw!r}") from None
    return raw
