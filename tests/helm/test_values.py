"""values.yaml and values.schema.json: wrong values fail at install time (Helm validates the schema
before rendering) with a message that names the key; the schema's vocabularies are the app's own
(draft source names, dtypes, log levels, DraftmeshConfig and FactCheckConfig fields); every key of
values.yaml is documented."""

from __future__ import annotations

import copy
import re
import typing

import pytest

from draftmesh.config import (
    IN_PROCESS_ONLY_SOURCES, DraftmeshConfig, Dtype, FactCheckConfig, LogLevel, NerBackendName, WikidataMode, leaves,
)
from draftmesh.draft.registry import DEFAULT_SOURCES, available
from helm.chart import CHART_DIR, NAMESPACE, RELEASE, chart

# Config fields the chart sets from its structured values (the rest go through meshConfig).
CHART_OWNED = {
    "engine.model", "engine.device", "engine.dtype", "sources.names", "sources.options", "sources.remote",
    "serve.grpc_port", "serve.http_port", "serve.metrics_port", "serve.verifier_replicas", "serve.verifier_num_gpus",
    "serve.verifier_num_cpus", "serve.verifier_max_ongoing", "serve.router_replicas", "serve.max_in_flight",
    "serve.redis_url", "serve.log_level", "serve.api_keys_file", "serve.tenants", "factcheck.enabled", "factcheck.workers",
} | {f"factcheck.{leaf.name}" for leaf in leaves(FactCheckConfig)}  # the workers' options (factcheck.options)
# Config fields that do not apply on Kubernetes (documented in values.yaml and helm/README.md).
NOT_APPLICABLE = {"serve.address", "serve.api_keys", "serve.tls_cert", "serve.tls_key", "factcheck.python",
                  "serve.max_streams", "serve.drain_s",  # `draftmesh serve`'s own gateway
                  "serve.redis_maxmemory_bytes"}  # the embedded redis-server's; the chart's Redis: redis.maxmemory


def schema_at(*path: str) -> dict:
    node = chart().schema
    for key in path:
        node = node["properties"][key]
    return node


def install_error(values: dict) -> str:
    """What `helm install` says about these values (schema, then templates), or "" if it renders."""
    import helm_python as helm

    try:
        chart().render(copy.deepcopy(values), name=RELEASE, namespace=NAMESPACE, is_install=True)
    except helm.HelmError as exc:
        return str(exc)
    return ""


# --------------------------------------------------------------------------- the schema rejects


@pytest.mark.parametrize("values, names", [
    ({"verifier": {"replicas": -1}}, ["/verifier/replicas", "-1"]),
    ({"verifier": {"replicas": 0}}, ["/verifier/replicas", "got 0"]),
    ({"router": {"replicas": -2}}, ["/router/replicas", "-2"]),
    ({"factcheck": {"replicas": -1}}, ["/factcheck/replicas", "-1"]),
    ({"rayService": {"cpuWorkers": {"replicas": -3}}}, ["/rayService/cpuWorkers/replicas", "-3"]),
    ({"sources": {"enabled": ["history", "telepathy"]}}, ["/sources/enabled/1", "'history'", "'rules'"]),
    ({"sources": {"deployments": {"telepathy": {"enabled": True, "replicas": 1, "numCpus": 1, "numGpus": 0}}}},
     ["invalid propertyName 'telepathy'", "'llm'"]),
    ({"sources": {"options": {"telepathy": {}}}}, ["invalid propertyName 'telepathy'", "'rag'"]),
    ({"verifier": {"dtype": "fp8"}}, ["/verifier/dtype", "'bfloat16'"]),
    ({"verifierr": {"replicas": 2}}, ["additional properties", "verifierr"]),
    ({"verifier": {"replica": 2}}, ["/verifier", "replica"]),
    ({"meshConfig": {"serve": {"api_keys": ["k"]}}}, ["/meshConfig/serve", "api_keys"]),
    ({"meshConfig": {"max_nodes": 4}}, ["/meshConfig", "max_nodes"]),
    ({"meshConfig": {"builder": {"max_nodes": -1}}}, ["/meshConfig/builder/max_nodes", "-1"]),
    ({"meshConfig": {"builder": {"prior": [1, 0]}}}, ["/meshConfig/builder/prior/1"]),
    ({"verifier": {"numGpus": 1.5}}, ["/verifier/numGpus"]),
    ({"verifier": {"numGpus": 1, "device": "cpu"}}, ["/verifier/device", "cuda"]),
    ({"auth": {"apiKeys": ["has space"]}}, ["/auth/apiKeys/0"]),
    ({"factcheck": {"options": {"ner": "regex"}}}, ["/factcheck/options/ner", "'spacy'"]),
    ({"factcheck": {"options": {"wikidata": "offline"}}}, ["/factcheck/options", "wikidata_dump"]),
    # null deletes a default key in Helm's coalescing: a container without a memory request.
    ({"rayService": {"head": {"resources": {"requests": {"memory": None}}}}},
     ["/rayService/head/resources/requests", "memory"]),
    ({"grpc": {"port": 70000}}, ["/grpc/port", "maximum"]),
    ({"tracing": {"otlpProtocol": "udp"}}, ["/tracing/otlpProtocol"]),
])
def test_wrong_values_fail_with_a_message_naming_them(values, names):
    import helm_python as helm

    with pytest.raises(helm.HelmValuesError) as caught:
        chart().validate_schema(copy.deepcopy(values))
    message = str(caught.value)
    for name in names:
        assert name in message, f"{name!r} not in {message!r}"
    assert install_error(values), "helm install must refuse them too"


@pytest.mark.parametrize("values, message", [
    ({"sources": {"deployments": {"llm": {"enabled": True}}, "enabled": ["history", "llm"]}},
     "sources.deployments.llm is enabled and llm is also in sources.enabled"),
    ({"sources": {"external": {"rules": {"address": "x:1"}}}}, "sources.external.rules: rules is also in sources.enabled"),
    ({"verifier": {"numGpus": 1}, "rayService": {"gpuWorkers": {"enabled": False}}}, "no pod would have a GPU"),
    ({"verifier": {"numGpus": 0, "device": "cpu"}}, "nothing asks for a GPU"),
    ({"verifier": {"numGpus": 2}}, "a replica must fit in one pod"),
    ({"verifier": {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}}, "minReplicas (5) is above maxReplicas (2)"),
    ({"verifier": {"maxOngoingRequests": 8, "autoscaling": {"enabled": True, "targetOngoingRequests": 9}}}, "Serve would never scale up"),
    ({"auth": {"existingSecret": "s", "apiKeys": ["k"]}}, "either existingSecret or apiKeys"),
    ({"factcheck": {"options": {"redis_url": "redis://x"}}}, "redis_url"),
])
def test_contradictions_fail_at_install(values, message):
    assert message in install_error(values)


def test_the_rejections_are_not_blanket():
    """Near misses of the wrong values above are accepted."""
    for values in ({"verifier": {"replicas": 1, "dtype": "float16", "numGpus": 0.5}},
                   {"sources": {"enabled": ["history", "prompt_lookup"]}},
                   {"meshConfig": {"builder": {"max_nodes": 0}, "engine": {"threads": 2}}},
                   {"factcheck": {"options": {"ner": "flair", "wikidata": "offline", "wikidata_dump": ["/d.json"]}}}):
        chart().validate_schema(copy.deepcopy(values))
        assert install_error(values) == ""


# --------------------------------------------------------------------------- vocabularies


def test_source_names_are_the_registrys():
    names = set(available())
    assert set(schema_at("sources", "enabled")["items"]["enum"]) == names
    assert set(schema_at("sources", "options")["propertyNames"]["enum"]) == names
    # a source the verifier feeds cannot run apart from it (config.IN_PROCESS_ONLY_SOURCES)
    assert set(schema_at("sources", "deployments")["propertyNames"]["enum"]) == names - set(IN_PROCESS_ONLY_SOURCES)
    assert tuple(chart().values["sources"]["enabled"]) == DEFAULT_SOURCES, "the chart's default is the app's"
    assert set(chart().values["sources"]["deployments"]) <= names


def test_a_verifier_replica_is_routed_a_full_batch_by_default():
    """The chart's default is the app's: as many requests as a replica's batch holds."""
    assert chart().values["verifier"]["maxOngoingRequests"] == DraftmeshConfig().serve.verifier_max_ongoing


def test_an_autoscaled_verifier_scales_out_at_half_a_batch():
    """Serve's generic target (2 ongoing requests) would add a GPU replica while a batching one
    still had most of its rows free."""
    verifier = chart().values["verifier"]
    assert verifier["autoscaling"]["targetOngoingRequests"] * 2 == verifier["maxOngoingRequests"]


def test_enums_are_the_apps():
    assert schema_at("verifier", "dtype")["enum"] == list(typing.get_args(Dtype))
    assert schema_at("rayService", "logLevel")["enum"] == list(typing.get_args(LogLevel))
    fc = schema_at("factcheck", "options")["properties"]
    assert fc["ner"]["enum"] == list(typing.get_args(NerBackendName))
    assert fc["wikidata"]["enum"] == list(typing.get_args(WikidataMode))


def _passthrough() -> dict[str, dict]:
    """meshConfig's schema: {"section.field": its schema node}."""
    return {f"{section}.{name}": spec for section, node in schema_at("meshConfig")["properties"].items()
            for name, spec in node["properties"].items()}


def test_every_config_field_is_placed():
    """A new config field must be given a place in the chart (or declared not applicable)."""
    fields = {leaf.name for leaf in leaves()}
    passthrough = set(_passthrough())
    assert passthrough <= fields
    assert not passthrough & CHART_OWNED and not passthrough & NOT_APPLICABLE
    assert passthrough | CHART_OWNED | NOT_APPLICABLE == fields


def test_factcheck_options_are_the_workers_fields():
    fields = {leaf.name for leaf in leaves(FactCheckConfig)}
    assert set(schema_at("factcheck", "options")["properties"]) == fields - {"redis_url"}


def test_meshconfig_passthrough_bounds_are_the_apps():
    """Every bound the schema puts on meshConfig is the field's own (its metadata, which its section
    enforces), and every field's bound is in the schema."""
    by_name = {leaf.name: leaf for leaf in leaves()}
    for name, spec in _passthrough().items():
        meta = by_name[name].field.metadata
        assert spec.get("minimum") == meta.get("min") and spec.get("maximum") == meta.get("max"), name
        section, field = name.split(".")
        if "minimum" in spec and spec["type"] == "integer":
            low = int(spec["minimum"])
            others = {"default_max_new_tokens": 1} if field == "max_new_tokens_cap" else {}
            DraftmeshConfig.from_dict({section: {field: low, **others}})  # the schema's lowest value is valid
            with pytest.raises(ValueError, match=name):
                DraftmeshConfig.from_dict({section: {field: low - 1, **others}})


# --------------------------------------------------------------------------- values.yaml


# Keys whose value is a Kubernetes (or Ray, or app) object taken verbatim: their own comment
# documents them; the keys inside are the API's.
VERBATIM = {"resources", "podSecurityContext", "securityContext", "nodeSelector", "tolerations", "affinity",
            "rayStartParams", "options", "annotations", "labels", "podSelector", "namespaceSelector",
            "metricsFrom", "grpcFrom", "jaegerUiFrom", "extraEnv", "imagePullSecrets"}


def test_every_values_key_is_documented():
    """Each key of values.yaml has a comment line right above it, except inside verbatim objects."""
    lines = (CHART_DIR / "values.yaml").read_text(encoding="utf-8").splitlines()
    undocumented, stack = [], []  # stack: (indent, key) of the enclosing keys
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)(- )?([A-Za-z0-9_.\-/]+):(\s|$)", line)
        if not m:
            continue
        indent = len(m.group(1)) + (2 if m.group(2) else 0)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        inside_verbatim = any(key in VERBATIM for _, key in stack)
        stack.append((indent, m.group(3)))
        if inside_verbatim or m.group(2):
            continue
        if not lines[i - 1].strip().startswith("#"):
            undocumented.append(f"{i + 1}: {line.strip()}")
    assert not undocumented, "undocumented keys:\n" + "\n".join(undocumented)
    assert len(stack) > 0


def test_tenants_render_into_the_config_and_their_keys_into_the_secret(tmp_path):
    """auth.tenants: quotas and sharing in serve.tenants (no key in the RayService), keys as
    "<tenant> <key>" lines of the chart's Secret, which the router reads as those tenants."""
    import base64

    import yaml

    from draftmesh.auth import ApiKeyAuth

    values = {"auth": {"apiKeys": ["k-bare-1"], "tenants": {
        "team-a": {"apiKeys": ["k-a-1", "k-a-2"], "maxInFlight": 2, "shareAnswersWith": ["team-b"]},
        "team-b": {"apiKeys": ["k-b-1"], "tokensPerMinute": 1000}}},
        "meshConfig": {"serve": {"tenant_tokens_per_minute": 5000}}}
    files = chart().render(copy.deepcopy(values), name="t", namespace="ns", is_install=True)
    docs = [d for path, text in files.items() if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d]
    (rs,) = [d for d in docs if d.get("kind") == "RayService"]
    assert "k-a-1" not in yaml.safe_dump(rs)
    (app,) = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"]
    cfg = DraftmeshConfig.from_dict(app["args"])
    assert cfg.serve.tenants["team-a"].max_in_flight == 2 and cfg.serve.tenants["team-a"].share_answers_with == ["team-b"]
    assert cfg.serve.tenants["team-b"].tokens_per_minute == 1000 and cfg.serve.tenant_tokens_per_minute == 5000
    (secret,) = [d for d in docs if d.get("kind") == "Secret" and "api-keys" in d["data"]]
    keys = tmp_path / "keys"
    keys.write_bytes(base64.b64decode(secret["data"]["api-keys"]))
    auth = ApiKeyAuth.from_config(DraftmeshConfig.from_dict({"serve": {"api_keys_file": str(keys)}}).serve)
    who = {k: auth.identify([("authorization", f"Bearer {k}")]) for k in ("k-bare-1", "k-a-1", "k-a-2", "k-b-1")}
    assert who == {"k-bare-1": "default", "k-a-1": "team-a", "k-a-2": "team-a", "k-b-1": "team-b"}
    assert "existingSecret or apiKeys" in install_error({"auth": {"existingSecret": "s", "tenants": {"x": {"apiKeys": ["k"]}}}})
    assert install_error({"auth": {"tenants": {"a/b": {}}}}) != ""
