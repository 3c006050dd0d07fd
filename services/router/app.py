"""The Ray Serve application: router ingress, verifier pool and draft deployments.

``build_app(config)`` takes the plain dict of a ``DraftmeshConfig`` so that `draftmesh serve`
and a KubeRay ``serveConfigV2`` (import_path ``draftmesh.router.app:build_app`` with the
same dict as ``args``) deploy exactly the same app.
"""

from __future__ import annotations

from typing import Any, Mapping

from draftmesh.config import DraftmeshConfig
from draftmesh.draft.deployment import DraftDeployment
from draftmesh.router.ingress import Router
from draftmesh.verify.deployment import VerifierPool

APP_NAME = "draftmesh"
GRPC_SERVICER_FUNCTIONS = ["draftmesh.v1.generation_pb2_grpc.add_GenerationServicer_to_server"]


def build_app(config: Mapping[str, Any] | DraftmeshConfig):
    cfg = config if isinstance(config, DraftmeshConfig) else DraftmeshConfig.from_dict(config)
    plain = cfg.to_dict()
    drafts = {}
    for name, spec in cfg.sources.remote.items():
        if spec.external:
            continue  # an external gRPC source: the verifier dials it directly
        resources = spec.resources
        drafts[name] = DraftDeployment.options(
            name=f"draft-{name}",
            num_replicas=resources.num_replicas,
            ray_actor_options={"num_cpus": float(resources.num_cpus), "num_gpus": float(resources.num_gpus)},
        ).bind(name, cfg.engine.model, spec, cfg.serve.redis_url, cfg.serve.answer_store_max_bytes)
    serve = cfg.serve
    verifier = VerifierPool.options(
        num_replicas=serve.verifier_replicas,
        max_ongoing_requests=serve.verifier_max_ongoing,
        ray_actor_options={"num_cpus": serve.verifier_num_cpus, "num_gpus": serve.verifier_num_gpus},
    ).bind(plain, drafts)
    return Router.options(
        num_replicas=serve.router_replicas,
        # Above max_in_flight so the router's own admission answers RESOURCE_EXHAUSTED,
        # and a bounded queue in front of it.
        max_ongoing_requests=serve.max_in_flight + 8,
        max_queued_requests=serve.max_in_flight,
        ray_actor_options={"num_cpus": 0.1},
    ).bind(plain, verifier)
