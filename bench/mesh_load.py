"""The served mesh as a load target of the closed-loop concurrency bench (``draftmesh bench --target mesh
--concurrency ...``): each in-flight request is one streaming ``Generate`` through the gRPC face.

Why a separate load target and not the in-process decoder: the issue's targets hold "through the mesh
too", i.e. with the router, Serve's proxy and the verifier replica's scheduler between the clients and the
batch; ``draftmesh.bench.concurrency.run_pass`` drives this and ``EngineLoad`` alike.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator

import grpc

from draftmesh.bench.items import PreparedItem
from draftmesh.bench.mesh import MeshRunner
from draftmesh.router.app import APP_NAME


class MeshLoad:
    """One mesh method (``MeshRunner``: its client, request building and speculation switch) as a load
    target; ``batch_stats`` reads the verifier replica's batch counters (None when not visible: a mesh
    the bench did not start)."""

    def __init__(self, runner: MeshRunner, batch_stats: Callable[[], dict[str, Any] | None] | None = None) -> None:
        self.runner = runner
        self._batch_stats = batch_stats

    def warm(self, item: PreparedItem) -> None:
        short = dataclasses.replace(item, max_new_tokens=min(4, item.max_new_tokens))
        for _ in self.stream(short):
            pass

    def stream(self, item: PreparedItem) -> Iterator[tuple[str, Any]]:
        """("step", tokens of the step) per delta, then ("result", the output's token ids)."""
        try:
            for response in self.runner.client.generate(self.runner.request(item), timeout_s=self.runner.timeout_s):
                kind = response.WhichOneof("event")
                if kind == "delta":
                    yield "step", len(response.delta.token_ids)
                elif kind == "result":
                    yield "result", tuple(int(t) for t in response.result.token_ids)
        except grpc.RpcError as exc:  # reported like the single-stream mode's (MeshError: exit 2, no traceback)
            raise self.runner.error(item, exc) from None

    def batch_stats(self) -> dict[str, Any] | None:
        return self._batch_stats() if self._batch_stats is not None else None

    def close(self) -> None:
        """Nothing to free: the client and the mesh outlive the pass."""


def verifier_batch_stats(app_name: str | None = None) -> dict[str, Any]:
    """The batch counters of the verifier replica a handle call reaches (the bench's own mesh has one)."""
    from ray import serve  # lazy: Ray only for a mesh this process started

    handle = serve.get_deployment_handle("verifier", app_name=app_name or APP_NAME)
    return handle.stats.remote().result(timeout_s=30)["batch"]
