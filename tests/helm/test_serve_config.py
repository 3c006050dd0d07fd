"""serveConfigV2 deploys the same application as `draftmesh serve` with the same settings.

The expected config is derived from the values (the chart's documented mapping onto the config's
sections), written to a YAML file and loaded by the real `draftmesh serve --config` path; the
rendered args must give an equal DraftmeshConfig. Ray Serve's own schema validates the Serve config,
and build_app (no Ray started) shows what the deployments get."""

from __future__ import annotations

import math
from typing import Any

import pytest
import yaml

from deploy.deploy_files import dispatch
from draftmesh.config import DraftmeshConfig, config_from_args
from draftmesh.cli.health import DEFAULT_APPLICATION
from draftmesh.router.app import APP_NAME, GRPC_SERVICER_FUNCTIONS
from helm.chart import Rendered, render


def expected_redis_url(r: Rendered) -> str:
    """The external URL, else the in-chart Redis Service (found by what it selects, not by name)."""
    external = r.merged["redis"]["external"]["url"]
    if external:
        return external
    (sts,) = [o for o in r.of_kind("StatefulSet") if o["metadata"]["labels"]["app.kubernetes.io/component"] == "redis"]
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    (svc,) = [s for s in r.of_kind("Service") if s["spec"].get("clusterIP") != "None"
              and s["spec"]["selector"] and all(pod_labels.get(k) == v for k, v in s["spec"]["selector"].items())]
    (port,) = svc["spec"]["ports"]
    return f"redis://{svc['metadata']['name']}:{port['port']}/0"


def expected_settings(r: Rendered) -> dict[str, Any]:
    """What a `draftmesh serve --config` file holds for these values (the mapping values.yaml documents)."""
    v = r.merged
    head_params = r.rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]
    auth = v["auth"]
    settings: dict[str, Any] = {
        "engine": {"model": v["verifier"]["model"], "device": v["verifier"]["device"], "dtype": v["verifier"]["dtype"]},
        "sources": {"names": v["sources"]["enabled"]},
        "serve": {
            "verifier_replicas": v["verifier"]["replicas"],
            "verifier_num_gpus": v["verifier"]["numGpus"],
            "verifier_num_cpus": v["verifier"]["numCpus"],
            "verifier_max_ongoing": v["verifier"]["maxOngoingRequests"],
            "router_replicas": v["router"]["replicas"],
            "max_in_flight": v["router"]["maxInFlight"],
            "grpc_port": v["grpc"]["port"],
            # Serve's HTTP proxy is on 8000 either way (KubeRay probes it); 0: the API is off.
            "http_port": 8000 if v["http"]["enabled"] else 0,
            # On an existing cluster, metrics_port documents the nodes' own metrics export port.
            "metrics_port": int(head_params["metrics-export-port"]),
            "redis_url": expected_redis_url(r),
            "log_level": v["rayService"]["logLevel"],
        },
        # the workers are their own Deployment; their options are the mesh's too
        "factcheck": {"enabled": v["factcheck"]["enabled"], "workers": 0, **v["factcheck"]["options"]},
    }
    if auth["apiKeys"] or auth["existingSecret"]:
        settings["serve"]["api_keys_file"] = f"{auth['mountPath'].rstrip('/')}/{auth['secretKey']}"
    if v["sources"]["options"]:
        settings["sources"]["options"] = v["sources"]["options"]
    remote = {}
    for name, d in v["sources"]["deployments"].items():
        if d["enabled"]:
            spec = {"deployment": {"num_replicas": d["replicas"], "num_cpus": d["numCpus"], "num_gpus": d["numGpus"]}}
            if d.get("options"):
                spec["options"] = d["options"]
            if d.get("timeoutMs") is not None:
                spec["timeout_ms"] = d["timeoutMs"]
            remote[name] = spec
    for name, e in v["sources"]["external"].items():
        remote[name] = {"address": e["address"], **({"timeout_ms": e["timeoutMs"]} if e.get("timeoutMs") else {})}
    if remote:
        settings["sources"]["remote"] = remote
    for section, fields in v["meshConfig"].items():
        settings.setdefault(section, {}).update(fields)
    return settings


def serve_cli_config(settings: dict[str, Any], tmp_path, monkeypatch) -> DraftmeshConfig:
    """The config `draftmesh serve --config <file>` builds (the real CLI parser and loader)."""
    path = tmp_path / "mesh.yaml"
    path.write_text(yaml.safe_dump(settings), encoding="utf-8")
    command, args = dispatch(["serve", "--config", str(path)], monkeypatch)
    assert command == "serve"
    return config_from_args(args)


# --------------------------------------------------------------------------- the Serve config


def test_serve_config_is_valid_for_ray_serve(rendered):
    from ray.serve.schema import ServeDeploySchema

    config = ServeDeploySchema.model_validate(rendered.serve_config)
    (app,) = config.applications
    assert app.import_path == "draftmesh.router.app:build_app"
    assert app.name == APP_NAME == DEFAULT_APPLICATION, "`draftmesh health` looks for this application"
    assert app.route_prefix == "/"


def test_grpc_options_are_the_launchers(rendered):
    """`draftmesh serve` starts Serve with gRPCOptions(port=cfg.grpc_port, GRPC_SERVICER_FUNCTIONS)."""
    grpc = rendered.serve_config["grpc_options"]
    cfg = DraftmeshConfig.from_dict(rendered.mesh_args)
    assert grpc["port"] == cfg.serve.grpc_port == rendered.merged["grpc"]["port"]
    assert grpc["grpc_servicer_functions"] == GRPC_SERVICER_FUNCTIONS
    assert rendered.serve_config["proxy_location"] == "EveryNode", "a proxy beside every replica"
    assert rendered.serve_config["logging_config"]["log_level"] == cfg.serve.log_level


def test_args_equal_what_draftmesh_serve_loads(rendered, tmp_path, monkeypatch, clean_env):
    clean_env({})
    from_chart = DraftmeshConfig.from_dict(rendered.mesh_args)
    from_cli = serve_cli_config(expected_settings(rendered), tmp_path, monkeypatch)
    assert from_chart == from_cli
    assert from_chart == DraftmeshConfig.from_dict(from_chart.to_dict())


def test_the_comparison_notices_a_wrong_value(tmp_path, monkeypatch, clean_env):
    """Guard for the test above: a changed setting gives a different config."""
    clean_env({})
    r = render("gpu-pool-4")
    settings = expected_settings(r)
    settings["serve"]["verifier_replicas"] += 1
    assert DraftmeshConfig.from_dict(r.mesh_args) != serve_cli_config(settings, tmp_path, monkeypatch)


def test_the_verifier_follows_the_values(rendered):
    cfg = DraftmeshConfig.from_dict(rendered.mesh_args)
    v = rendered.merged["verifier"]
    assert (cfg.serve.verifier_replicas, cfg.serve.verifier_num_gpus, cfg.engine.device, cfg.engine.dtype,
            cfg.engine.model) == (
        v["replicas"], v["numGpus"], v["device"], v["dtype"], v["model"])
    # ... and the values are the ones the test passed, not only the chart's defaults.
    for key, value in rendered.values.get("verifier", {}).items():
        if key != "autoscaling":
            assert v[key] == value


def test_no_secret_or_unsupported_field_reaches_the_app_config(rendered):
    cfg = DraftmeshConfig.from_dict(rendered.mesh_args)
    assert cfg.serve.api_keys is None, "keys come from the mounted Secret, never from serveConfigV2"
    assert cfg.serve.tls_cert is None and cfg.serve.tls_key is None and cfg.serve.address is None
    assert cfg.factcheck.workers == 0 and cfg.factcheck.python is None


@pytest.mark.parametrize("name", ["default", "gpu-pool-4", "full"])
def test_build_app_deploys_what_the_values_say(name, no_ray_autostart):
    """The deployments build_app makes from the chart's args (as Serve's controller would build them)."""
    from ray.serve._private.build_app import build_app as serve_build

    from draftmesh.router.app import build_app

    r = render(name)
    v = r.merged
    built = serve_build(build_app(r.mesh_args), name=APP_NAME)
    deployments = {d.name: d for d in built.deployments}
    assert built.ingress_deployment_name == "router"
    verifier = deployments["verifier"]
    assert verifier._deployment_config.num_replicas == v["verifier"]["replicas"]
    assert verifier.ray_actor_options["num_gpus"] == v["verifier"]["numGpus"]
    assert verifier.ray_actor_options["num_cpus"] == v["verifier"]["numCpus"]
    assert verifier._deployment_config.max_ongoing_requests == v["verifier"]["maxOngoingRequests"]
    assert deployments["router"]._deployment_config.num_replicas == v["router"]["replicas"]
    drafts = {n: d for n, d in v["sources"]["deployments"].items() if d["enabled"]}
    assert {n for n in deployments if n.startswith("draft-")} == {f"draft-{n}" for n in drafts}
    for n, d in drafts.items():
        dep = deployments[f"draft-{n}"]
        assert dep._deployment_config.num_replicas == d["replicas"]
        assert dep.ray_actor_options == {"num_cpus": d["numCpus"], "num_gpus": d["numGpus"]}
    # Serve rejects a config override naming a deployment the app does not have.
    for override in r.serve_config["applications"][0].get("deployments", []):
        assert override["name"] in deployments


def test_autoscaling_overrides_the_verifier_by_name():
    """Serve config overrides code options by deployment name; num_replicas "auto" makes Serve
    drop the code's fixed count and use autoscaling_config (application_state.override_deployment_info)."""
    r = render("full")
    auto = r.merged["verifier"]["autoscaling"]
    (override,) = r.serve_config["applications"][0]["deployments"]
    assert override["name"] == "verifier" and override["num_replicas"] == "auto"
    cfg = override["autoscaling_config"]
    assert (cfg["min_replicas"], cfg["max_replicas"], cfg["target_ongoing_requests"]) == (
        auto["minReplicas"], auto["maxReplicas"], auto["targetOngoingRequests"])
    assert cfg["target_ongoing_requests"] <= r.merged["verifier"]["maxOngoingRequests"]
    assert r.rayservice["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is True
    assert "deployments" not in render("default").serve_config["applications"][0]
    assert render("default").rayservice["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is False


# --------------------------------------------------------------------------- the Ray cluster


def _gpu_group(r: Rendered) -> dict[str, Any] | None:
    groups = r.rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    found = [g for g in groups if "nvidia.com/gpu" in g["template"]["spec"]["containers"][0]["resources"]["limits"]]
    assert len(found) <= 1
    return found[0] if found else None


def _fits(actors: list[float], pods: int, gpus_per_pod: int) -> bool:
    """First-fit-decreasing of Ray GPU requests onto pods of whole GPUs (a fraction stays on one GPU,
    a whole number takes that many GPUs of one pod)."""
    free = [[1.0] * gpus_per_pod for _ in range(pods)]
    for need in sorted(actors, reverse=True):
        placed = False
        for pod in free:
            if need >= 1:
                whole = [i for i, f in enumerate(pod) if f == 1.0]
                if len(whole) >= need:
                    for i in whole[: int(need)]:
                        pod[i] = 0.0
                    placed = True
            else:
                for i, f in enumerate(pod):
                    if f + 1e-9 >= need:
                        pod[i] = f - need
                        placed = True
                        break
            if placed:
                break
        if not placed:
            return False
    return True


def _gpu_actors(v: dict[str, Any], verifier_replicas: int) -> list[float]:
    actors = [float(v["verifier"]["numGpus"])] * verifier_replicas
    for d in v["sources"]["deployments"].values():
        if d["enabled"] and d["numGpus"]:
            actors += [float(d["numGpus"])] * d["replicas"]
    return [a for a in actors if a > 0]


def test_the_gpu_group_holds_the_verifier_pool(rendered):
    v = rendered.merged
    group = _gpu_group(rendered)
    if not _gpu_actors(v, v["verifier"]["replicas"]):
        assert group is None or not v["rayService"]["gpuWorkers"]["enabled"]
        return
    assert group is not None
    container = group["template"]["spec"]["containers"][0]
    res = container["resources"]
    gpus = int(res["limits"]["nvidia.com/gpu"])
    assert gpus == int(res["requests"]["nvidia.com/gpu"]) == v["rayService"]["gpuWorkers"]["gpusPerPod"]
    auto = v["verifier"]["autoscaling"]
    if auto["enabled"]:
        assert _fits(_gpu_actors(v, auto["minReplicas"]), group["minReplicas"], gpus)
        assert _fits(_gpu_actors(v, auto["maxReplicas"]), group["maxReplicas"], gpus)
    else:
        assert group["minReplicas"] == group["replicas"] == group["maxReplicas"]
    assert _fits(_gpu_actors(v, v["verifier"]["replicas"]), group["replicas"], gpus)
    if not any(d["enabled"] and d["numGpus"] for d in v["sources"]["deployments"].values()) and not auto["enabled"]:
        assert not _fits(_gpu_actors(v, v["verifier"]["replicas"]), group["replicas"] - 1, gpus), "no idle GPU pod"
    # Scheduling onto GPU nodes comes from the values.
    spec = group["template"]["spec"]
    assert spec.get("nodeSelector", {}) == v["rayService"]["gpuWorkers"]["nodeSelector"]
    assert spec.get("tolerations", []) == v["rayService"]["gpuWorkers"]["tolerations"]


def test_gpu_pool_of_4():
    r = render("gpu-pool-4")
    group = _gpu_group(r)
    assert group["replicas"] * int(group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]) >= 4
    assert group["replicas"] == math.ceil(4 / 2)
    assert group["template"]["spec"]["containers"][0]["image"].endswith(":cuda")
    assert DraftmeshConfig.from_dict(r.mesh_args).engine.dtype == "bfloat16"


def test_the_fit_check_is_not_trivial():
    assert _fits([1.0] * 4, 2, 2) and not _fits([1.0] * 4, 1, 2)
    assert not _fits([0.6] * 3, 1, 2) and _fits([0.5] * 4, 1, 2)


def test_the_head_runs_no_replicas_and_serves_grpc(rendered):
    head = rendered.rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    ports = {p["name"]: p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]}
    cfg = DraftmeshConfig.from_dict(rendered.mesh_args)
    assert ports["serve-grpc"] == cfg.serve.grpc_port, "KubeRay's serve Service takes the port named serve-grpc"
    assert ports["serve"] == rendered.serve_config["http_options"]["port"], "KubeRay requires a port named serve"
    assert ports["dashboard"] == 8265 and ports["gcs-server"] == 6379


def test_worker_readiness_checks_the_serve_proxy(rendered):
    """A worker pod without a healthy Serve proxy must not receive gRPC traffic."""
    for group in rendered.rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        container = group["template"]["spec"]["containers"][0]
        probe = container["readinessProbe"]["httpGet"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert probe["path"] == "/-/healthz"
        assert ports[probe["port"]] == rendered.serve_config["http_options"]["port"]
        assert rendered.serve_config["http_options"]["host"] == "0.0.0.0", "kubelet probes the pod IP"
