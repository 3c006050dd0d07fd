"""The Ray Serve application: router ingress, verifier pool and draft deployments.

``build_app(config)`` takes the plain dict of a ``MeshConfig`` so that `draftmesh serve`
and a KubeRay ``serveConfigV2`` (import_path ``draftmesh.router.app:build_app`` with the
same dict as ``args``) deploy exactly the same app.
"""

from __future__ import annotations

from typing import Any, Mapping

from draftmesh.config import MeshConfig

APP_NAME = "draftmesh"
GRPC_SERVICER_FUNCTIONS = ["draftmesh.v1.generation_pb2_grpc.add_GenerationServicer_to_server"]


def build_app(config: Mapping[str, Any] | MeshConfig):
    from draftmesh.draft.deployment import DraftDeployment
    from draftmesh.router.ingress import Router
    from draftmesh.verify.deployment import VerifierPool

    cfg = config if isinstance(config, MeshConfig) else MeshConfig(**dict(config))
    plain = cfg.to_dict()
    drafts = {}
    for name, spec in (cfg.remote_sources or {}).items():
        if "address" in spec:
            continue  # an external gRPC source: the verifier dials it directly
        resources = dict(spec.get("deployment") or {})
        drafts[name] = DraftDeployment.options(
            name=f"draft-{name}",
            num_replicas=int(resources.get("num_replicas", 1)),
            ray_actor_options={"num_cpus": float(resources.get("num_cpus", 1)), "num_gpus": float(resources.get("num_gpus", 0))},
        ).bind(name, cfg.model, spec, cfg.redis_url)
    verifier = VerifierPool.options(
        num_replicas=cfg.verifier_replicas,
        max_ongoing_requests=cfg.verifier_max_ongoing,
        ray_actor_options={"num_cpus": cfg.verifier_num_cpus, "num_gpus": cfg.verifier_num_gpus},
    ).bind(plain, drafts)
    return Router.options(
        num_replicas=cfg.router_replicas,
        # Above max_in_flight so the router's own admission answers RESOURCE_EXHAUSTED,
        # and a bounded queue in front of it.
        max_ongoing_requests=cfg.max_in_flight + 8,
        max_queued_requests=cfg.max_in_flight,
        ray_actor_options={"num_cpus": 0.1},
    ).bind(plain, verifier)
