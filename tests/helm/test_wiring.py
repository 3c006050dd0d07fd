"""How the rendered objects connect: Redis and OTLP URLs reach the right Service and port, the
API keys travel only through the Secret, the fact-check workers agree with the mesh on Redis and
the streams, the NetworkPolicies let through exactly what the chart promises, and KubeRay's
login shell finds the image's virtualenv."""

from __future__ import annotations

import base64
import dataclasses
import shutil
import subprocess
from urllib.parse import urlsplit

import pytest
from deploy.deploy_files import MESH_DOCKERFILE, WORKER_DOCKERFILE, Dockerfile, dispatch
from helm.chart import (
    NAMESPACE,
    RAY_COMPONENTS,
    Pod,
    Rendered,
    Source,
    all_pods,
    component,
    env_of,
    ingress_allowed,
    isolated,
    ray_pods,
    render,
    service_matches,
    workload_pods,
)

from draftmesh.config import DraftmeshConfig, FactCheckConfig, config_from_args
from draftmesh.router.auth import INVALID, ApiKeyAuth

OTEL_ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"


def ray_containers(r: Rendered) -> list[tuple[Pod, dict]]:
    return [(pod, pod.containers[0]) for pod in ray_pods(r)]


def worker_pod(r: Rendered) -> Pod | None:
    found = [p for p in workload_pods(r) if component(p) == "factcheck"]
    return found[0] if found else None


def service_backends(r: Rendered, svc: dict, port_name: str | None = None) -> list[tuple[Pod, int]]:
    """(pod, container port) pairs a Service port reaches."""
    (port,) = [p for p in svc["spec"]["ports"] if port_name is None or p["name"] == port_name]
    out = []
    for pod in all_pods(r):
        if service_matches(svc["spec"]["selector"], pod.labels):
            resolved = pod.container_port(port.get("targetPort", port["port"]))
            assert resolved is not None, f"{svc['metadata']['name']}: targetPort {port.get('targetPort')} not on {pod.owner}"
            out.append((pod, resolved))
    return out


def find_service(r: Rendered, host: str) -> dict:
    name = host.split(".")[0]
    (svc,) = [s for s in r.of_kind("Service") if s["metadata"]["name"] == name]
    if "." in host:
        assert host.split(".")[1] == NAMESPACE
    return svc


# --------------------------------------------------------------------------- Redis


def test_redis_url_reaches_the_redis_pod(rendered):
    url = DraftmeshConfig.from_dict(rendered.mesh_args).serve.redis_url
    external = rendered.merged["redis"]["external"]["url"]
    envs = [env_of(c)["REDIS_URL"] for _, c in ray_containers(rendered)]
    assert envs and set(envs) == {url}, "REDIS_URL on every Ray container equals the app's redis_url"
    if external:
        assert url == external
        assert not rendered.of_kind("StatefulSet"), "no in-chart Redis with an external one"
        assert not [s for s in rendered.of_kind("Service") if "redis" in s["metadata"]["name"]]
        return
    parts = urlsplit(url)
    assert parts.scheme == "redis"
    svc = find_service(rendered, parts.hostname)
    assert svc["spec"].get("clusterIP") != "None"
    (port,) = [p for p in svc["spec"]["ports"] if p["port"] == parts.port]
    backends = service_backends(rendered, svc, port["name"])
    assert [(component(p), cp) for p, cp in backends] == [("redis", 6379)]
    (sts,) = rendered.of_kind("StatefulSet")
    redis = sts["spec"]["template"]["spec"]["containers"][0]
    assert redis["image"].startswith("redis:")
    persistence = rendered.merged["redis"]["persistence"]["enabled"]
    assert ("--appendonly" in redis["args"] and redis["args"][redis["args"].index("--appendonly") + 1]) == (
        "yes" if persistence else "no")
    assert bool(sts["spec"].get("volumeClaimTemplates")) == persistence


def test_workers_agree_with_the_mesh(rendered, monkeypatch, clean_env):
    """The worker's FactCheckConfig (its image's entrypoint + the pod env, through the real CLI)
    equals the one the mesh's producers derive from its config: same Redis, same streams."""
    from draftmesh.factcheck.worker import build_parser

    pod = worker_pod(rendered)
    mesh = DraftmeshConfig.from_dict(rendered.mesh_args)
    if not rendered.merged["factcheck"]["enabled"]:
        assert pod is None and mesh.factcheck.enabled is False
        return
    container = pod.containers[0]
    assert "command" not in container and "args" not in container, "the image's entrypoint runs"
    clean_env(env_of(container))
    entry, cmd = Dockerfile.load(WORKER_DOCKERFILE).entrypoint_and_cmd()
    assert entry[0] == "draftmesh"
    command, worker_argv = dispatch(entry[1:] + cmd, monkeypatch)
    assert command == "factcheck-worker"
    args = build_parser().parse_args(worker_argv)
    worker_cfg = config_from_args(args, FactCheckConfig)
    # the mesh-only knobs (enabled, workers, wait_ms) are not the worker's: they keep its defaults
    mesh_side = dataclasses.replace(mesh.factcheck_config(), enabled=True, workers=1, python=None, wait_ms=2000)
    assert worker_cfg == mesh_side
    assert worker_cfg.redis_url == mesh.serve.redis_url
    # Readiness is the file the entrypoint writes, on a volume that does not outlive the pod.
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["exec"]["command"] == ["test", "-f", args.ready_file]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod.spec["volumes"]}
    tmp = next(path for path in mounts if args.ready_file.startswith(path.rstrip("/") + "/"))
    assert volumes[mounts[tmp]]["emptyDir"].get("medium") == "Memory"
    assert pod.template["spec"]["terminationGracePeriodSeconds"] >= 30
    assert rendered.one("Deployment", "factcheck")["spec"]["replicas"] == rendered.merged["factcheck"]["replicas"]


# --------------------------------------------------------------------------- tracing


def test_otlp_endpoint_only_when_tracing_is_on(rendered):
    tracing = rendered.merged["tracing"]
    pods_env = [env_of(c) for _, c in ray_containers(rendered)]
    worker = worker_pod(rendered)
    if worker:
        pods_env.append(env_of(worker.containers[0]))
    if not tracing["enabled"]:
        for env in pods_env:
            assert not [k for k in env if k.startswith("OTEL_")], env
        return
    endpoints = {env[OTEL_ENDPOINT] for env in pods_env}
    protocols = {env["OTEL_EXPORTER_OTLP_PROTOCOL"] for env in pods_env}
    assert len(endpoints) == 1 and protocols == {tracing["otlpProtocol"]}
    (endpoint,) = endpoints
    if tracing["otlpEndpoint"]:
        assert endpoint == tracing["otlpEndpoint"]
        return
    # The in-chart Jaeger: the URL's host:port reaches Jaeger's OTLP receiver for that protocol.
    parts = urlsplit(endpoint)
    svc = find_service(rendered, parts.hostname)
    (port,) = [p for p in svc["spec"]["ports"] if p["port"] == parts.port]
    backends = service_backends(rendered, svc, port["name"])
    want = {"grpc": 4317, "http/protobuf": 4318}[tracing["otlpProtocol"]]
    assert [(component(p), cp) for p, cp in backends] == [("jaeger", want)]
    jaeger = rendered.one("Deployment", "jaeger")["spec"]["template"]["spec"]["containers"][0]
    assert jaeger["image"] == "jaegertracing/jaeger:2.15.0", "the image docker-compose.yml runs"
    assert env_of(jaeger)["JAEGER_LISTEN_HOST"] == "0.0.0.0"


def test_tracing_needs_a_collector():
    import helm_python as helm
    from helm.chart import chart

    with pytest.raises(helm.HelmError, match="tracing.enabled needs a collector"):
        chart().render({"tracing": {"enabled": True}}, name="dm", namespace=NAMESPACE)


# --------------------------------------------------------------------------- API keys


def _keys_file_contents(rendered: Rendered, pod: Pod, container: dict) -> tuple[str, str]:
    """(the Secret name and key that lands at the path the app's serve.api_keys_file names)."""
    path = DraftmeshConfig.from_dict(rendered.mesh_args).serve.api_keys_file
    (mount,) = [m for m in container["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert mount.get("readOnly") is True
    volume = next(v for v in pod.spec["volumes"] if v["name"] == mount["name"])
    secret = volume["secret"]
    rel = path[len(mount["mountPath"].rstrip("/")) + 1:]
    (item,) = [i for i in secret["items"] if i["path"] == rel]
    return secret["secretName"], item["key"]


def test_api_keys_come_only_from_the_secret(rendered, tmp_path):
    auth = rendered.merged["auth"]
    text = "\n".join(rendered.files.values())
    containers = ray_containers(rendered)
    if not auth["apiKeys"] and not auth["existingSecret"]:
        assert DraftmeshConfig.from_dict(rendered.mesh_args).serve.api_keys_file is None
        assert not rendered.of_kind("Secret")
        assert "Auth is OFF" in rendered.notes
        return
    for key in auth["apiKeys"]:
        assert key not in text.replace(_secret_data_blob(rendered), ""), "a key outside the Secret"
        assert key not in rendered.rayservice["spec"]["serveConfigV2"]
    wanted = {_keys_file_contents(rendered, pod, c) for pod, c in containers}
    assert len(wanted) == 1
    ((secret_name, secret_key),) = wanted
    if auth["existingSecret"]:
        assert (secret_name, secret_key) == (auth["existingSecret"], auth["secretKey"])
        assert not rendered.of_kind("Secret"), "an existing Secret is not managed by the chart"
        return
    (secret,) = rendered.of_kind("Secret")
    assert secret["metadata"]["name"] == secret_name
    content = base64.b64decode(secret["data"][secret_key]).decode()
    keys_file = tmp_path / "keys"
    keys_file.write_text(content, encoding="utf-8")
    serve = DraftmeshConfig.from_dict(rendered.mesh_args).serve
    router_auth = ApiKeyAuth.from_config(dataclasses.replace(serve, api_keys_file=str(keys_file)))
    assert len(router_auth) == len(auth["apiKeys"])
    for key in auth["apiKeys"]:
        assert router_auth.check([("authorization", f"Bearer {key}")]) is None
    assert router_auth.check([("authorization", "Bearer not-a-key")]) == INVALID
    # New keys roll the Ray pods (the router reads the file when a replica starts).
    for pod in ray_pods(rendered):
        assert "checksum/api-keys" in pod.template["metadata"].get("annotations", {}), pod.owner


def _secret_data_blob(rendered: Rendered) -> str:
    return "".join(v for s in rendered.of_kind("Secret") for v in s.get("data", {}).values())


# --------------------------------------------------------------------------- NetworkPolicies


OUTSIDER = Source.pod({"app": "curl"}, namespace="other")
OTHER_RELEASE = Source.pod({"app.kubernetes.io/instance": "other", "app.kubernetes.io/part-of": "draftmesh",
                            "app.kubernetes.io/component": "ray-head"})
OPERATOR = Source.pod({"app.kubernetes.io/name": "kuberay-operator"}, namespace="ray-system")
PROMETHEUS = Source.pod({"app.kubernetes.io/name": "prometheus"}, namespace="monitoring")
RAY_INTERNAL_PORTS = (6379, 8265, 10001, 8000, 8080, 52365, 10002)


def test_network_policies_isolate_the_release(rendered):
    policies = rendered.of_kind("NetworkPolicy")
    pods = all_pods(rendered)
    serve = DraftmeshConfig.from_dict(rendered.mesh_args).serve
    grpc_port, http_on = serve.grpc_port, rendered.merged["http"]["enabled"]
    assert serve.http_port == (8000 if http_on else 0)
    internal = [p for p in RAY_INTERNAL_PORTS if not (http_on and p == 8000)]
    for pod in pods:
        assert isolated(policies, pod), f"{pod.owner} accepts anything: no NetworkPolicy selects it"
    for pod in pods:
        comp = component(pod)
        # Another pod of the same release.
        own = Source.pod(next(p.labels for p in pods if component(p) != comp))
        if comp in RAY_COMPONENTS:
            assert ingress_allowed(policies, pod, OUTSIDER, grpc_port), f"{pod.owner}: gRPC must be reachable"
            assert ingress_allowed(policies, pod, OUTSIDER, 8000) == http_on, f"{pod.owner}: the HTTP API"
            assert ingress_allowed(policies, pod, own, 8000)
            for port in internal:
                assert not ingress_allowed(policies, pod, OUTSIDER, port), f"{pod.owner}:{port} open to outsiders"
                assert not ingress_allowed(policies, pod, OTHER_RELEASE, port), f"{pod.owner}:{port} open to another release"
                assert ingress_allowed(policies, pod, own, port), f"{pod.owner}:{port} closed to the release's pods"
            assert ingress_allowed(policies, pod, OPERATOR, 8265) and ingress_allowed(policies, pod, OPERATOR, 52365)
            assert not ingress_allowed(policies, pod, OPERATOR, 6379)
            assert ingress_allowed(policies, pod, PROMETHEUS, 8080) == rendered.merged["monitoring"]["enabled"]
        elif comp == "redis":
            assert ingress_allowed(policies, pod, own, 6379)
            assert not ingress_allowed(policies, pod, OUTSIDER, 6379)
            assert not ingress_allowed(policies, pod, OTHER_RELEASE, 6379)
        elif comp == "factcheck":
            for src in (own, OUTSIDER, OTHER_RELEASE):
                assert not ingress_allowed(policies, pod, src, 8080), "the worker serves nothing"
        elif comp == "jaeger":
            assert ingress_allowed(policies, pod, own, 4317) and ingress_allowed(policies, pod, own, 4318)
            for port in (4317, 4318, 16686):
                assert not ingress_allowed(policies, pod, OUTSIDER, port)
        else:
            pytest.fail(f"unexpected component {comp}")


def test_every_release_pod_reaches_redis():
    r = render("default")
    policies = r.of_kind("NetworkPolicy")
    (redis,) = [p for p in all_pods(r) if component(p) == "redis"]
    for pod in all_pods(r):
        assert ingress_allowed(policies, redis, Source.pod(pod.labels), 6379), pod.owner


def test_the_policy_check_is_not_trivial():
    """Without the policies everything is open; a policy for Ray pods changes that."""
    r = render("default")
    head = ray_pods(r)[0]
    assert ingress_allowed([], head, OUTSIDER, 6379)
    assert not ingress_allowed(r.of_kind("NetworkPolicy"), head, OUTSIDER, 6379)


def test_the_grpc_service_reaches_the_serving_ray_pods(rendered):
    svc = rendered.one("Service", "grpc")
    grpc_port = DraftmeshConfig.from_dict(rendered.mesh_args).serve.grpc_port
    backends = service_backends(rendered, svc)
    assert backends and {component(p) for p, _ in backends} <= set(RAY_COMPONENTS)
    assert {port for _, port in backends} == {grpc_port}
    if rendered.merged["grpc"]["service"]["servingPodsOnly"]:
        # Pods whose proxy KubeRay has not marked healthy get no traffic.
        for pod in ray_pods(rendered, serving=False):
            assert not service_matches(svc["spec"]["selector"], pod.labels)


def test_the_http_service_reaches_the_serving_ray_pods_when_the_api_is_on(rendered):
    services = [s for s in rendered.of_kind("Service") if s["metadata"]["name"].endswith("-http")]
    if not rendered.merged["http"]["enabled"]:
        assert not services
        return
    (svc,) = services
    backends = service_backends(rendered, svc)
    assert backends and {component(p) for p, _ in backends} <= set(RAY_COMPONENTS)
    assert {port for _, port in backends} == {8000}  # Serve's HTTP proxy (http_options in serveConfigV2)
    assert rendered.serve_config["http_options"]["port"] == 8000


# --------------------------------------------------------------------------- KubeRay's login shell


def test_login_shell_finds_the_images_virtualenv(rendered, tmp_path):
    """KubeRay runs `ray start` under `bash -l`; Debian's /etc/profile resets PATH for non-root
    users, then sources /etc/profile.d/*.sh: the chart's script must put the venv first again."""
    venv_bin = rendered.merged["rayService"]["loginShellPath"]
    image_path = Dockerfile.load(MESH_DOCKERFILE).env(Dockerfile.load(MESH_DOCKERFILE).final_stage())["PATH"]
    assert image_path.split(":")[0] == venv_bin, "the chart's venv is the image's"
    (cm,) = [c for c in rendered.of_kind("ConfigMap") if c["metadata"]["name"].endswith("-ray-env")]
    for pod, container in ray_containers(rendered):
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"].startswith("/etc/profile.d/")]
        assert mount["mountPath"].endswith(".sh"), "/etc/profile only sources *.sh"
        volume = next(v for v in pod.spec["volumes"] if v["name"] == mount["name"])
        assert volume["configMap"]["name"] == cm["metadata"]["name"] and mount["subPath"] in cm["data"]
    script = tmp_path / "draftmesh-path.sh"
    (content,) = cm["data"].values()
    script.write_text(content, encoding="utf-8")
    bash = shutil.which("bash")
    if bash is None:  # pragma: no cover
        pytest.skip("no bash")
    for start in ("/usr/local/bin:/usr/bin:/bin", f"{venv_bin}:/usr/bin"):
        out = subprocess.run([bash, "-c", f'PATH="{start}"; . "{script}"; . "{script}"; echo "$PATH"'],
                             capture_output=True, text=True, check=True).stdout.strip()
        assert out.split(":")[0] == venv_bin and out.split(":").count(venv_bin) == 1, out
    if rendered.merged["verifier"]["autoscaling"]["enabled"]:
        opts = rendered.rayservice["spec"]["rayClusterConfig"]["autoscalerOptions"]
        assert [m["mountPath"] for m in opts["volumeMounts"]] == [mount["mountPath"]]


def test_ray_probes_use_rays_http_endpoints(rendered):
    """KubeRay's injected probes call wget, which the python:3.11-slim based image lacks."""
    for pod, container in ray_containers(rendered):
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        for probe in ("readinessProbe", "livenessProbe"):
            get = container[probe]["httpGet"]
            assert get["port"] in ports, f"{pod.owner} {probe}: unknown port {get['port']}"
        assert container["livenessProbe"]["httpGet"] == {"path": "/api/local_raylet_healthz", "port": "dashboard-agent"}
        assert ports["dashboard-agent"] == 52365
