"""docker-compose.yml: valid against the Compose JSON schema, and wired the way the code expects
(commands parse with the real CLI into valid configs, URLs point at the right services and ports,
health checks probe what the services really expose)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml

from deploy.deploy_files import (
    COMPOSE_FILE,
    ROOT,
    Dockerfile,
    compose_environment,
    dispatch,
    effective_argv,
    parse_duration,
    parse_port,
)
from draftmesh.config import DraftmeshConfig, FactCheckConfig, config_from_args

SCHEMA = ROOT / "tests" / "fixtures" / "schemas" / "compose-spec.json"
# Which service plays which part; the tests find them by what they run, and check these names.
MESH, WORKER, REDIS, JAEGER = "mesh", "factcheck", "redis", "jaeger"
OTLP_PORTS = {"grpc": 4317, "http/protobuf": 4318}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def services(compose) -> dict:
    return compose["services"]


def _dockerfile(service: dict) -> Dockerfile:
    build = service["build"]
    context = ROOT / (build if isinstance(build, str) else build.get("context", "."))
    name = "Dockerfile" if isinstance(build, str) else build.get("dockerfile", "Dockerfile")
    return Dockerfile.load(context / name)


def _hostnames(services: dict, name: str) -> set[str]:
    """Names under which other services reach ``name`` on the default network."""
    svc = services[name]
    names = {name}
    for key in ("hostname", "container_name"):
        if svc.get(key):
            names.add(svc[key])
    networks = svc.get("networks")
    if isinstance(networks, dict):
        for net in networks.values():
            names.update((net or {}).get("aliases") or [])
    return names


def _dispatched(services, name: str, subcommand: str, monkeypatch, clean_env):
    """What ``draftmesh <subcommand>`` receives in the service's container (its environment only)."""
    svc = services[name]
    clean_env(compose_environment(svc))
    argv = effective_argv(svc, _dockerfile(svc))
    assert argv[0] == "draftmesh"
    command, args = dispatch(argv[1:], monkeypatch)
    assert command == subcommand
    return args


def _mesh_config(services, monkeypatch, clean_env) -> DraftmeshConfig:
    return config_from_args(_dispatched(services, MESH, "serve", monkeypatch, clean_env))


def _worker_config(services, monkeypatch, clean_env) -> tuple[FactCheckConfig, object]:
    from draftmesh.factcheck.worker import build_parser

    args = build_parser().parse_args(_dispatched(services, WORKER, "factcheck-worker", monkeypatch, clean_env))
    return config_from_args(args, FactCheckConfig), args


# --------------------------------------------------------------------------- schema


def test_valid_against_the_compose_schema(compose):
    schema = json.loads(SCHEMA.read_text(encoding="utf-8"))
    draft = re.search(r"draft-0?(\d+)", schema["$schema"])
    assert draft and draft.group(1) == "7", schema["$schema"]
    validator_cls = jsonschema.Draft7Validator
    validator_cls.check_schema(schema)
    errors = sorted(validator_cls(schema).iter_errors(compose), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)


def test_the_schema_catches_a_broken_file(compose):
    """The validation above can fail: a misspelt key and a wrong type are errors."""
    schema = json.loads(SCHEMA.read_text(encoding="utf-8"))
    broken = json.loads(json.dumps(compose))
    broken["services"][MESH]["healthcheck"]["retry"] = 5
    broken["services"][REDIS]["ports"] = "6379"
    assert len(list(jsonschema.Draft7Validator(schema).iter_errors(broken))) >= 2


def test_expected_services(services):
    assert {MESH, WORKER, REDIS, JAEGER} <= set(services)


# --------------------------------------------------------------------------- structure


def test_depends_on_targets_exist_and_can_become_healthy(services):
    for name, svc in services.items():
        deps = svc.get("depends_on") or {}
        deps = {d: {"condition": "service_started"} for d in deps} if isinstance(deps, list) else deps
        for target, spec in deps.items():
            assert target in services, f"{name} depends on unknown service {target}"
            assert target != name
            if spec.get("condition") == "service_healthy":
                has_check = "healthcheck" in services[target] and not services[target]["healthcheck"].get("disable")
                if not has_check and "build" in services[target]:
                    has_check = _dockerfile(services[target]).healthcheck() is not None
                assert has_check, f"{name} waits for {target} to be healthy, but {target} has no health check"
    assert services[MESH]["depends_on"][REDIS]["condition"] == "service_healthy"
    assert services[WORKER]["depends_on"][REDIS]["condition"] == "service_healthy"
    assert services[MESH]["depends_on"][JAEGER]["condition"] == "service_started"


def test_build_contexts_and_dockerfiles_exist(services):
    built = 0
    for name, svc in services.items():
        if "build" not in svc:
            assert svc.get("image"), f"{name} has neither build nor image"
            continue
        build = svc["build"]
        context = ROOT / (build if isinstance(build, str) else build.get("context", "."))
        assert context.is_dir(), f"{name}: build context {context} does not exist"
        dockerfile = context / ("Dockerfile" if isinstance(build, str) else build.get("dockerfile", "Dockerfile"))
        assert dockerfile.is_file(), f"{name}: {dockerfile} does not exist"
        built += 1
    assert {p for p in (_dockerfile(services[MESH]).path, _dockerfile(services[WORKER]).path)} == \
           {ROOT / "Dockerfile", ROOT / "services" / "factcheck" / "Dockerfile"}
    assert built == 2


def test_named_volumes_are_declared(compose, services):
    declared = set(compose.get("volumes") or {})
    for name, svc in services.items():
        for vol in svc.get("volumes") or []:
            source = vol.get("source") if isinstance(vol, dict) else str(vol).split(":")[0]
            kind = vol.get("type", "volume") if isinstance(vol, dict) else None
            if kind == "volume" or (kind is None and not source.startswith((".", "/", "~"))):
                assert source in declared, f"{name} mounts undeclared volume {source!r}"


def test_model_cache_volume_is_where_the_image_keeps_the_models(services):
    svc = services[MESH]
    image_env = _dockerfile(svc).env(_dockerfile(svc).final_stage())
    cache = compose_environment(svc).get("DRAFTMESH_CACHE", image_env["DRAFTMESH_CACHE"])
    mounts = {}
    for vol in svc.get("volumes") or []:
        if isinstance(vol, dict):
            mounts[vol["target"]] = vol.get("source")
        else:
            source, target = str(vol).split(":")[:2]
            mounts[target] = source
    assert cache in mounts, f"nothing is mounted at the model cache {cache}"


def test_redis_keeps_no_data(services):
    command = services[REDIS]["command"]
    assert command[0] == "redis-server"
    opts = dict(zip(command[1::2], command[2::2]))
    assert opts.get("--save") == "" and opts.get("--appendonly") == "no"
    assert "--port" not in opts, "the URLs below assume the default port 6379"


def test_long_running_services_restart(services):
    for name in (MESH, WORKER):
        assert services[name].get("restart") in ("always", "unless-stopped", "on-failure"), name


# --------------------------------------------------------------------------- the mesh


def test_mesh_command_is_a_valid_mesh_config(services, monkeypatch, clean_env):
    cfg = _mesh_config(services, monkeypatch, clean_env)
    assert cfg.factcheck.enabled, "the mesh must produce fact-check spans for the worker service"
    assert cfg.factcheck.workers == 0, "the worker runs in its own service; the mesh must not start more"
    assert cfg.serve.address is None and cfg.serve.tls_cert is None


def test_mesh_ports_match_its_config_and_image(services, monkeypatch, clean_env):
    cfg = _mesh_config(services, monkeypatch, clean_env)
    ports = [parse_port(p) for p in services[MESH]["ports"]]
    targets = {target for _, _, target, _ in ports}
    assert targets == {cfg.serve.grpc_port, cfg.serve.http_port, cfg.serve.metrics_port}
    assert all(published == target for _, published, target, _ in ports), "the documented host ports"
    assert cfg.serve.metrics_port != 0
    assert targets <= _dockerfile(services[MESH]).exposed_ports()


def test_mesh_healthcheck_probes_its_grpc_port(services, monkeypatch, clean_env):
    cfg = _mesh_config(services, monkeypatch, clean_env)
    check = services[MESH]["healthcheck"]
    test = check["test"]
    assert test[0] == "CMD" and test[1] == "draftmesh"
    command, args = dispatch(test[2:], monkeypatch)
    assert command == "health"
    host, _, port = args.addr.rpartition(":")
    assert host in ("localhost", "127.0.0.1") and int(port) == cfg.serve.grpc_port
    assert args.timeout < parse_duration(check["timeout"]), "the probe must finish before Docker gives up on it"
    assert parse_duration(check["start_period"]) >= 60, "Ray, Serve and the models need time to start"


def test_redis_urls_point_at_the_redis_service(services, monkeypatch, clean_env):
    cfg = _mesh_config(services, monkeypatch, clean_env)
    mesh_url = cfg.serve.redis_url  # REDIS_URL already read by the config loader
    assert mesh_url, "without a Redis URL the mesh would start its own embedded redis-server"
    worker_cfg, _ = _worker_config(services, monkeypatch, clean_env)
    worker_url = worker_cfg.redis_url
    for url in (mesh_url, worker_url):
        parts = urlsplit(url)
        assert parts.scheme == "redis" and parts.hostname in _hostnames(services, REDIS), url
        assert (parts.port or 6379) == 6379, url
    assert mesh_url == worker_url, "producers (mesh) and consumers (worker) must use the same Redis and database"
    # ...and the same stream names
    produced = cfg.factcheck_config()
    assert produced.redis_url == worker_url
    assert produced.stream_prefix == worker_cfg.stream_prefix


def test_otlp_endpoints_point_at_jaeger(services):
    jaeger = services[JAEGER]
    m = re.fullmatch(r"(?:[\w.-]+(?::\d+)?/)?jaegertracing/jaeger:(\d+)\.(\d+)\.(\d+)", jaeger["image"])
    assert m, f"{jaeger['image']} is not a pinned Jaeger v2 image (jaegertracing/jaeger:2.x.y)"
    assert (int(m.group(1)), int(m.group(2))) >= (2, 1), "JAEGER_LISTEN_HOST exists from Jaeger 2.1"
    assert int(m.group(1)) == 2
    listen = compose_environment(jaeger).get("JAEGER_LISTEN_HOST", "0.0.0.0")
    assert listen in ("0.0.0.0", "::"), "OTLP must listen on all interfaces to be reachable from other services"
    traced = [name for name, svc in services.items() if "OTEL_EXPORTER_OTLP_ENDPOINT" in compose_environment(svc)]
    assert {MESH, WORKER} <= set(traced)
    for name in traced:
        env = compose_environment(services[name])
        protocol = env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
        assert protocol in OTLP_PORTS, f"{name}: unknown OTLP protocol {protocol}"
        endpoint = urlsplit(env["OTEL_EXPORTER_OTLP_ENDPOINT"])
        assert endpoint.scheme == "http", f"{name}: Jaeger's OTLP receivers are plaintext"
        assert endpoint.hostname in _hostnames(services, JAEGER), f"{name}: {endpoint.hostname} is not the jaeger service"
        assert endpoint.port == OTLP_PORTS[protocol], f"{name}: OTLP/{protocol} is on port {OTLP_PORTS[protocol]}"
        assert endpoint.path in ("", "/"), f"{name}: an OTLP/gRPC endpoint has no path"


def test_jaeger_ui_and_healthcheck(services):
    jaeger = services[JAEGER]
    targets = {parse_port(p)[2] for p in jaeger.get("ports", [])}
    assert {16686, 4317, 4318} <= targets
    test = jaeger["healthcheck"]["test"]
    assert test[0] == "CMD"
    url = urlsplit(test[-1])
    assert url.hostname in ("localhost", "127.0.0.1") and url.port == 13133 and url.path == "/status"


def test_mesh_shared_memory_and_signals(services):
    svc = services[MESH]
    size = str(svc["shm_size"]).lower()
    m = re.fullmatch(r"(\d+)\s*([kmg]?)b?", size)
    assert m and int(m.group(1)) * {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}[m.group(2)] >= 512 * 2**20
    assert svc.get("init") is True
    assert parse_duration(svc["stop_grace_period"]) >= 10


# --------------------------------------------------------------------------- the worker


def test_worker_command_is_a_valid_factcheck_config(services, monkeypatch, clean_env):
    cfg, args = _worker_config(services, monkeypatch, clean_env)
    assert cfg.redis_url, "the worker needs DRAFTMESH_FACTCHECK_REDIS_URL (or --redis-url)"
    assert args.ready_file


def test_worker_healthcheck_tests_its_ready_file_on_a_fresh_tmpfs(services, monkeypatch, clean_env):
    _, args = _worker_config(services, monkeypatch, clean_env)
    test = services[WORKER]["healthcheck"]["test"]
    assert test == ["CMD", "test", "-f", args.ready_file]
    tmpfs = services[WORKER].get("tmpfs") or []
    tmpfs = [tmpfs] if isinstance(tmpfs, str) else tmpfs
    mounts = [t.split(":")[0].rstrip("/") for t in tmpfs]
    parent = str(Path(args.ready_file).parent)
    assert any(parent == m or parent.startswith(m + "/") for m in mounts), \
        f"{args.ready_file} must be on a tmpfs so that a killed worker's file does not survive a restart"
