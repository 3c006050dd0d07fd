"""Render helm/draftmesh offline with the real Helm library (PyPI helm-python-sdk, Helm v4 through
its C ABI; no helm binary, no cluster) and read the result the way Kubernetes and KubeRay would.

- ``render(name)``: one of the VALUE_SETS rendered once per test session (Helm's own values
  coalescing, schema validation and template engine), split into objects.
- ``matches``: a Kubernetes label selector (matchLabels, matchExpressions) against labels.
- ``ray_pods``: the pods KubeRay creates from the RayService's group templates, with the labels
  KubeRay adds (ray.io/*, app.kubernetes.io/name=kuberay unless the template overrides it).
- ``ingress_allowed``: NetworkPolicy ingress semantics (isolation, peers, ports, named ports).

Nothing here copies an expected manifest: tests derive what must hold from the values and the
application's own code.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = ROOT / "helm" / "draftmesh"
CRD_FILE = ROOT / "tests" / "fixtures" / "schemas" / "ray.io_rayservices.yaml"
RELEASE = "dm"
NAMESPACE = "ml"
KUBE_VERSION = "1.37"
"""Newest Kubernetes whose schemas kubernetes-validate==1.37.0 ships."""

RAY_COMPONENTS = ("ray-head", "ray-worker-gpu", "ray-worker-cpu")

VALUE_SETS: dict[str, dict[str, Any]] = {
    "default": {},
    # A verifier pool of 4 on 2-GPU nodes, bf16, pinned to a GPU product.
    "gpu-pool-4": {
        "verifier": {"replicas": 4, "dtype": "bfloat16"},
        "rayService": {"gpuWorkers": {
            "gpusPerPod": 2,
            "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
            "image": {"tag": "cuda"},
        }},
    },
    "external-redis": {"redis": {"external": {"url": "redis://redis-master.data.svc.cluster.local:6379/2"}}},
    "tracing": {
        "tracing": {"enabled": True},
        "jaeger": {"enabled": True},
        "monitoring": {"enabled": True, "labels": {"release": "prometheus"}},
    },
    "factcheck-off": {"factcheck": {"enabled": False}},
    "http-off": {"http": {"enabled": False}},
    # Most knobs at once: autoscaling, keys from values, a draft LLM deployment on a GPU
    # fraction, an external gRPC source, worker options, extra config fields by section, an external
    # collector over OTLP/HTTP, Redis persistence.
    "full": {
        "verifier": {"model": "gemma3-270m", "replicas": 2, "dtype": "float16", "numGpus": 0.5,
                     "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 7, "targetOngoingRequests": 3}},
        "router": {"replicas": 2, "maxInFlight": 64},
        "auth": {"apiKeys": ["k-alpha-123", "k-beta-456"]},
        "sources": {
            "enabled": ["history", "rules", "prompt_lookup"],
            "options": {"rules": {"path": "/etc/draftmesh/rules.yaml"}},
            "deployments": {"llm": {"enabled": True, "replicas": 2, "numCpus": 1, "numGpus": 0.25,
                                    "timeoutMs": 250, "options": {"device": "cuda:0"}}},
            "external": {"kb": {"address": "kb-drafts.search:9100", "timeoutMs": 80}},
        },
        "meshConfig": {"builder": {"max_nodes": 48, "min_gain": 1.1, "prior": [4, 1]}, "engine": {"trace_steps": 32},
                       "limits": {"default_max_new_tokens": 512, "max_stop_strings": 4},
                       "serve": {"session_cache_size": 128}, "factcheck": {"wait_ms": 500}},
        "factcheck": {"replicas": 3, "options": {"concurrency": 2, "max_lag": 2000, "stream_prefix": "dm:fc",
                                                 "wikidata": "offline", "wikidata_dump": ["/data/a.json", "/data/b.json"]}},
        "tracing": {"enabled": True, "otlpEndpoint": "http://otel-collector.observability:4318",
                    "otlpProtocol": "http/protobuf"},
        "redis": {"persistence": {"enabled": True, "size": "5Gi"}},
        "rayService": {"logLevel": "DEBUG"},
    },
    # A CPU-only mesh with API keys from an existing Secret.
    "cpu-existing-secret": {
        "auth": {"existingSecret": "team-keys", "secretKey": "tokens"},
        "verifier": {"numGpus": 0, "device": "cpu", "dtype": "float32"},
        "rayService": {"gpuWorkers": {"enabled": False}, "upgradeStrategy": "None"},
    },
}


@dataclass
class Rendered:
    name: str
    values: dict[str, Any]
    """What the test passed."""
    merged: dict[str, Any]
    """The chart's defaults coalesced with ``values`` by Helm (what the templates saw)."""
    files: dict[str, str]
    """Template path -> rendered text (NOTES.txt included)."""
    objects: list[dict[str, Any]] = field(default_factory=list)

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def one(self, kind: str, component: str | None = None) -> dict[str, Any]:
        found = [o for o in self.of_kind(kind)
                 if component is None or o["metadata"]["labels"].get("app.kubernetes.io/component") == component]
        assert len(found) == 1, f"{self.name}: expected one {kind} {component or ''}, found {len(found)}"
        return found[0]

    def maybe(self, kind: str, component: str) -> dict[str, Any] | None:
        found = [o for o in self.of_kind(kind) if o["metadata"]["labels"].get("app.kubernetes.io/component") == component]
        assert len(found) <= 1
        return found[0] if found else None

    @property
    def rayservice(self) -> dict[str, Any]:
        return self.one("RayService")

    @property
    def serve_config(self) -> dict[str, Any]:
        return yaml.safe_load(self.rayservice["spec"]["serveConfigV2"])

    @property
    def mesh_args(self) -> dict[str, Any]:
        (app,) = self.serve_config["applications"]
        return app["args"]

    @property
    def notes(self) -> str:
        return next(text for path, text in self.files.items() if path.endswith("NOTES.txt"))


@functools.cache
def chart():
    import helm_python as helm

    return helm.Chart.load(CHART_DIR)


@functools.cache
def _render(name: str) -> Rendered:
    values = copy.deepcopy(VALUE_SETS[name])
    files = chart().render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    out = Rendered(name, values, chart().merge_values(copy.deepcopy(values)), files)
    for path, text in sorted(files.items()):
        if not path.endswith((".yaml", ".yml")):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                doc.setdefault("metadata", {}).setdefault("namespace", NAMESPACE)
                out.objects.append(doc)
    return out


def render(name: str) -> Rendered:
    """Rendered once per session; tests get a deep copy they may mutate."""
    return copy.deepcopy(_render(name))


# --------------------------------------------------------------------------- selectors


def matches(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """A LabelSelector against labels ({} or None selects everything)."""
    selector = selector or {}
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, vals = expr["key"], expr["operator"], expr.get("values") or []
        if op == "In" and labels.get(key) not in vals:
            return False
        if op == "NotIn" and key in labels and labels[key] in vals:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
        if op not in ("In", "NotIn", "Exists", "DoesNotExist"):
            raise ValueError(f"unknown selector operator {op}")
    return True


def service_matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    """A Service's equality selector (an empty one selects no pods: endpoints are manual)."""
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


# --------------------------------------------------------------------------- pods


@dataclass
class Pod:
    """A pod as it will exist in the cluster: labels, namespace, its containers."""

    owner: str
    """e.g. StatefulSet/dm-draftmesh-redis, RayService/dm-draftmesh:gpu."""
    labels: dict[str, str]
    namespace: str
    spec: dict[str, Any]
    template: dict[str, Any] | None = None

    @property
    def containers(self) -> list[dict[str, Any]]:
        return self.spec["containers"]

    def container_port(self, port: int | str) -> int | None:
        """Resolve a Service targetPort / NetworkPolicy port (number or name) on this pod."""
        for c in self.containers:
            for p in c.get("ports") or []:
                if (isinstance(port, str) and p.get("name") == port) or p["containerPort"] == port:
                    return p["containerPort"]
        return port if isinstance(port, int) else None


def ray_cluster_name(rendered: Rendered) -> str:
    return rendered.rayservice["metadata"]["name"] + "-x7k2q"  # KubeRay appends 5 random characters


def ray_pods(rendered: Rendered, *, serving: bool = True) -> list[Pod]:
    """The head and one pod per worker group, labelled as KubeRay labels them (pod.go labelPod,
    BuildPod): its own keys win over the template's for ray.io/node-type, group and cluster; the
    rest of the template's labels override its defaults."""
    rs = rendered.rayservice
    cluster = rs["spec"]["rayClusterConfig"]
    groups = [("head", "headgroup", cluster["headGroupSpec"])]
    groups += [("worker", g["groupName"], g) for g in cluster.get("workerGroupSpecs") or []]
    pods = []
    for node_type, group, spec in groups:
        template = spec["template"]
        labels = {
            "ray.io/is-ray-node": "yes",
            "ray.io/identifier": f"{ray_cluster_name(rendered)}-{node_type}",
            "app.kubernetes.io/name": "kuberay",
            "app.kubernetes.io/created-by": "kuberay-operator",
        }
        for key, value in (template["metadata"].get("labels") or {}).items():
            if key not in ("ray.io/node-type", "ray.io/group", "ray.io/cluster"):
                labels[key] = value
        labels.update({"ray.io/node-type": node_type, "ray.io/group": group, "ray.io/cluster": ray_cluster_name(rendered)})
        labels["ray.io/serve"] = "true" if serving else "false"
        pods.append(Pod(f"RayService/{rs['metadata']['name']}:{group}", labels, NAMESPACE, template["spec"], template))
    return pods


def workload_pods(rendered: Rendered) -> list[Pod]:
    pods = []
    for obj in rendered.objects:
        if obj["kind"] in ("Deployment", "StatefulSet", "DaemonSet"):
            template = obj["spec"]["template"]
            pods.append(Pod(f"{obj['kind']}/{obj['metadata']['name']}", dict(template["metadata"]["labels"]),
                            NAMESPACE, template["spec"], template))
    return pods


def all_pods(rendered: Rendered) -> list[Pod]:
    return ray_pods(rendered) + workload_pods(rendered)


def component(pod: Pod) -> str:
    return pod.labels.get("app.kubernetes.io/component", "")


def all_containers(rendered: Rendered) -> Iterable[tuple[Pod, dict[str, Any]]]:
    for pod in all_pods(rendered):
        for c in pod.spec.get("initContainers", []) + pod.containers:
            yield pod, c


def env_of(container: dict[str, Any]) -> dict[str, str]:
    env = {}
    for item in container.get("env") or []:
        assert "value" in item, f"{item['name']}: only literal env values are expected here"
        env[item["name"]] = item["value"]
    return env


# --------------------------------------------------------------------------- NetworkPolicy


@dataclass(frozen=True)
class Source:
    """Where a connection comes from."""

    labels: tuple[tuple[str, str], ...]
    namespace: str
    namespace_labels: tuple[tuple[str, str], ...]

    @classmethod
    def pod(cls, labels: dict[str, str], namespace: str = NAMESPACE) -> "Source":
        return cls(tuple(sorted(labels.items())), namespace,
                   (("kubernetes.io/metadata.name", namespace),))


def _peer_allows(peer: dict[str, Any], policy_ns: str, src: Source) -> bool:
    if "ipBlock" in peer:
        return True  # treated as "anyone" for these checks (the chart renders none)
    ns_sel = peer.get("namespaceSelector")
    pod_sel = peer.get("podSelector")
    if ns_sel is None:
        if src.namespace != policy_ns:
            return False
    elif not matches(ns_sel, dict(src.namespace_labels)):
        return False
    return pod_sel is None or matches(pod_sel, dict(src.labels))


def ingress_allowed(policies: list[dict[str, Any]], target: Pod, src: Source, port: int) -> bool:
    """Kubernetes NetworkPolicy ingress: a pod selected by no Ingress policy accepts everything;
    otherwise some rule of a selecting policy must allow both the source and the port."""
    selecting = [p for p in policies
                 if p["metadata"]["namespace"] == target.namespace
                 and matches(p["spec"]["podSelector"], target.labels)
                 and "Ingress" in (p["spec"].get("policyTypes") or ["Ingress"])]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress") or []:
            peers = rule.get("from")
            if peers and not any(_peer_allows(peer, policy["metadata"]["namespace"], src) for peer in peers):
                continue
            ports = rule.get("ports")
            if not ports:
                return True
            for p in ports:
                if p.get("protocol", "TCP") != "TCP":
                    continue
                resolved = target.container_port(p["port"]) if "port" in p else None
                if "port" not in p or resolved == port or (
                        "endPort" in p and isinstance(resolved, int) and resolved <= port <= p["endPort"]):
                    return True
    return False


def isolated(policies: list[dict[str, Any]], target: Pod) -> bool:
    return any(matches(p["spec"]["podSelector"], target.labels) and "Ingress" in p["spec"].get("policyTypes", [])
               for p in policies)
