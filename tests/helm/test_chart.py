"""The chart loads, lints and renders with Helm for every values set; every rendered object is
valid for Kubernetes (core kinds: kubernetes-validate, strict) and KubeRay (the RayService CRD's
openAPIV3Schema); names, labels and resources follow the conventions the chart promises."""

from __future__ import annotations

import copy
import functools
import re
import tomllib

import jsonschema
import kubernetes_validate
import pytest
import yaml

from helm.chart import (
    CHART_DIR,
    CRD_FILE,
    KUBE_VERSION,
    RAY_COMPONENTS,
    ROOT,
    VALUE_SETS,
    all_containers,
    all_pods,
    chart,
    matches,
    ray_pods,
    render,
)

CUSTOM_KINDS = {"RayService", "PodMonitor"}
STANDARD_LABELS = ("app.kubernetes.io/instance", "app.kubernetes.io/part-of", "app.kubernetes.io/component",
                   "app.kubernetes.io/managed-by", "helm.sh/chart")


@functools.cache
def crd_schema() -> dict:
    crd = yaml.safe_load(CRD_FILE.read_text(encoding="utf-8"))
    assert crd["kind"] == "CustomResourceDefinition" and crd["spec"]["names"]["kind"] == "RayService"
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    assert version["served"] and version["storage"]
    return version["schema"]["openAPIV3Schema"]


# --------------------------------------------------------------------------- chart metadata


def test_chart_metadata():
    meta = chart().metadata
    assert meta["apiVersion"] == "v2" and meta["name"] == "draftmesh" and meta["type"] == "application"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert meta["appVersion"] == project["version"], "the default image tags follow the package version"
    ray_pin = next(d for d in project["dependencies"] if d.startswith("ray[serve]=="))
    assert chart().values["rayService"]["rayVersion"] == ray_pin.split("==")[1]
    assert chart().schema is not None, "values.schema.json is part of the chart"


def test_the_schema_is_a_valid_draft7_schema_and_accepts_the_defaults():
    schema = chart().schema
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.Draft7Validator(schema).validate(chart().values)


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_lint_is_clean(name):
    import helm_python as helm

    report = helm.lint(CHART_DIR, copy.deepcopy(VALUE_SETS[name]), strict=True, namespace="ml",
                       kube_version=f"v{KUBE_VERSION}.0")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not report["errors"] and not problems, report


def test_every_template_renders_something_somewhere():
    """No dead template: each one produces an object for at least one values set."""
    used: set[str] = set()
    for name in VALUE_SETS:
        r = render(name)
        used |= {path for path, text in r.files.items()
                 if path.endswith("NOTES.txt") or any(doc for doc in yaml.safe_load_all(text))}
    templates = {t["name"] for t in chart().templates if not t["name"].endswith(".tpl")}
    assert {f"draftmesh/{t}" for t in templates} <= used


# --------------------------------------------------------------------------- validity


def test_core_kinds_are_valid_kubernetes(rendered):
    kinds = set()
    for obj in rendered.objects:
        kinds.add(obj["kind"])
        if obj["kind"] in CUSTOM_KINDS:
            continue
        try:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']}: {path}: {exc.message}")
    assert {"RayService", "NetworkPolicy", "PodDisruptionBudget"} <= kinds


def test_unknown_kinds_are_only_the_operator_ones(rendered):
    for obj in rendered.objects:
        if obj["kind"] in CUSTOM_KINDS:
            continue
        with_schema = True
        try:
            kubernetes_validate.validate(obj, KUBE_VERSION)
        except kubernetes_validate.SchemaNotFoundError:
            with_schema = False
        assert with_schema, f"{obj['kind']} ({obj['apiVersion']}) is not a Kubernetes {KUBE_VERSION} kind"


def test_the_rayservice_is_valid_against_the_kuberay_crd(rendered):
    rs = rendered.rayservice
    assert rs["apiVersion"] == "ray.io/v1"
    jsonschema.Draft7Validator(crd_schema()).validate(rs)


def test_the_crd_fixture_is_the_recorded_copy():
    import hashlib

    sources = (CRD_FILE.parent / "SOURCES.md").read_text(encoding="utf-8")
    digest = hashlib.sha256(CRD_FILE.read_bytes()).hexdigest()
    assert f"sha256 of `{CRD_FILE.name}`: `{digest}`" in sources
    assert "helm-chart/kuberay-operator/crds/ray.io_rayservices.yaml" in sources


def test_upgrade_strategy_passes_through(rendered):
    wanted = rendered.merged["rayService"]["upgradeStrategy"]
    spec = rendered.rayservice["spec"]
    assert spec.get("upgradeStrategy", {}).get("type", "") == wanted


def test_the_crd_check_catches_a_broken_rayservice():
    """The CRD schema is really applied (a string where KubeRay wants an integer fails)."""
    rs = render("default").rayservice
    rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["minReplicas"] = "one"
    with pytest.raises(jsonschema.ValidationError, match="'one' is not of type 'integer'"):
        jsonschema.Draft7Validator(crd_schema()).validate(rs)
    rs = render("default").rayservice
    del rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]
    with pytest.raises(jsonschema.ValidationError, match="'template' is a required property"):
        jsonschema.Draft7Validator(crd_schema()).validate(rs)


def test_the_ray_pod_templates_are_valid_kubernetes_pod_templates(rendered):
    """The CRD prunes unknown fields silently; a strict PodTemplate check catches typos in them."""
    for pod in ray_pods(rendered):
        obj = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": pod.template}
        try:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{pod.owner}: {'.'.join(str(p) for p in exc.path)}: {exc.message}")


# --------------------------------------------------------------------------- conventions


def test_names_fit_kubernetes_and_kuberay_limits(rendered):
    for obj in rendered.objects:
        name = obj["metadata"]["name"]
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 63, name
    # KubeRay: a RayService name of at most 47 characters (it appends -xxxxx, then -serve-svc).
    assert len(rendered.rayservice["metadata"]["name"]) <= 47


def test_a_long_release_name_is_cut_for_kuberay():
    values = {}
    files = chart().render(values, name="a-very-long-release-name-for-a-draftmesh-install", namespace="ml")
    rs = next(d for d in yaml.safe_load_all(files["draftmesh/templates/rayservice.yaml"]) if d)
    assert len(rs["metadata"]["name"]) <= 47 and not rs["metadata"]["name"].endswith("-")


def test_standard_labels_everywhere(rendered):
    for obj in rendered.objects:
        labels = obj["metadata"].get("labels") or {}
        for key in STANDARD_LABELS:
            assert labels.get(key), f"{obj['kind']}/{obj['metadata']['name']} lacks {key}"
        assert labels["app.kubernetes.io/instance"] == "dm"
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
    for pod in all_pods(rendered):
        for key in ("app.kubernetes.io/instance", "app.kubernetes.io/part-of", "app.kubernetes.io/component"):
            assert pod.labels.get(key), f"{pod.owner} pods lack {key}"


def test_ray_templates_leave_kuberays_labels_alone(rendered):
    """KubeRay selects its head Service on app.kubernetes.io/name=kuberay and owns ray.io/*."""
    for pod in ray_pods(rendered):
        template_labels = pod.template["metadata"]["labels"]
        assert "app.kubernetes.io/name" not in template_labels, pod.owner
        assert not [k for k in template_labels if k.startswith("ray.io/")], pod.owner
        assert pod.labels["app.kubernetes.io/component"] in RAY_COMPONENTS


def test_a_chart_only_upgrade_does_not_roll_the_ray_cluster(tmp_path):
    """Any change to rayClusterConfig makes KubeRay start a second RayCluster (GPUs included):
    a new chart version with the same values and images must leave it unchanged."""
    import shutil

    import helm_python as helm

    copy_dir = tmp_path / "draftmesh"
    shutil.copytree(CHART_DIR, copy_dir)
    meta = (copy_dir / "Chart.yaml").read_text(encoding="utf-8")
    version = chart().metadata["version"]
    (copy_dir / "Chart.yaml").write_text(meta.replace(f"version: {version}", "version: 99.0.0"), encoding="utf-8")
    bumped = helm.Chart.load(copy_dir)
    assert bumped.metadata["version"] == "99.0.0"
    def rayservice(c) -> dict:
        files = c.render(copy.deepcopy(VALUE_SETS["full"]), name="dm", namespace="ml")
        return next(d for d in yaml.safe_load_all(files["draftmesh/templates/rayservice.yaml"]) if d)

    before, after = rayservice(chart()), rayservice(bumped)
    assert before["metadata"]["labels"]["helm.sh/chart"] != after["metadata"]["labels"]["helm.sh/chart"]
    assert before["spec"] == after["spec"]


def test_requests_and_limits_on_every_container(rendered):
    for pod, container in all_containers(rendered):
        res = container.get("resources") or {}
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(res.get(kind) or {}), f"{pod.owner}/{container['name']}: {kind} {res}"


def test_ray_containers_keep_kuberays_command(rendered):
    """KubeRay generates `ray start`; a command or args on the Ray container would change it."""
    for pod in ray_pods(rendered):
        ray_container = pod.containers[0]
        assert "command" not in ray_container and "args" not in ray_container, pod.owner


def test_pdbs_cover_each_component_exactly(rendered):
    pdbs = rendered.of_kind("PodDisruptionBudget")
    pods = all_pods(rendered)
    covered = {}
    for pdb in pdbs:
        selected = [p for p in pods if matches(pdb["spec"]["selector"], p.labels)]
        assert selected, f"{pdb['metadata']['name']} selects no pod"
        assert len({p.labels["app.kubernetes.io/component"] for p in selected}) == 1, pdb["metadata"]["name"]
        for p in selected:
            assert p.owner not in covered, f"{p.owner}: two PDBs ({covered.get(p.owner)}, {pdb['metadata']['name']})"
            covered[p.owner] = pdb["metadata"]["name"]
    for p in pods:
        if p.labels["app.kubernetes.io/component"] != "jaeger":  # in-memory, a tool: no budget
            assert p.owner in covered, f"{p.owner} has no PodDisruptionBudget"


def test_podmonitor_scrapes_every_ray_pod_on_the_metrics_export_port():
    r = render("tracing")
    (pm,) = r.of_kind("PodMonitor")
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    assert pm["metadata"]["labels"]["release"] == "prometheus", "monitoring.labels reach the PodMonitor"
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    rs = r.rayservice["spec"]["rayClusterConfig"]
    groups = [rs["headGroupSpec"]] + rs["workerGroupSpecs"]
    for pod, group in zip(ray_pods(r), groups):
        assert matches(pm["spec"]["selector"], pod.labels), pod.owner
        port = pod.container_port(endpoint["port"])
        assert port == int(group["rayStartParams"]["metrics-export-port"]) == 8080, pod.owner
    for pod in all_pods(r):
        if pod.labels["app.kubernetes.io/component"] not in RAY_COMPONENTS:
            assert not matches(pm["spec"]["selector"], pod.labels), pod.owner
    assert not render("default").of_kind("PodMonitor"), "monitoring is off by default"
