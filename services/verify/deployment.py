"""The verifier pool: a Ray Serve deployment whose replicas each hold the target model.

A replica runs the whole speculation loop of its requests (``VerifierReplica``) with the
cheap sources in-process, so a step never crosses the network for them; remote sources
(draft deployments, external gRPC sources) are asked under the step deadline. Requests of
one session are routed to the replica holding its KV cache through Serve's multiplexing
(the session id is the "model id"); elsewhere they are recomputed from their token ids.
Each replica assembles its own decoder from the config (``draftmesh.verify.engine``).
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any, AsyncIterator, Mapping

from ray import serve

from draftmesh import tracing
from draftmesh.config import DraftmeshConfig
from draftmesh.factcheck.client import FactCheckClient
from draftmesh.io_struct import ServeRequest
from draftmesh.metrics import RayMetrics
from draftmesh.verify.decoder import SpeculativeDecoder
from draftmesh.verify.engine import decoder_from_config, load_target, remote_sources
from draftmesh.verify.factcheck_link import FactCheckLink
from draftmesh.verify.metrics import VerifierMetrics
from draftmesh.verify.replica import VerifierReplica

log = logging.getLogger(__name__)


class _Session:
    """What Serve's multiplexing "loads" per session: nothing but the routing affinity."""

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id


@serve.deployment(name="verifier", health_check_period_s=10, graceful_shutdown_timeout_s=5)
class VerifierPool:
    def __init__(self, config: dict, draft_handles: Mapping[str, Any]) -> None:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # replica output goes to the driver's console
        tracing.setup_tracing("verifier")
        cfg = DraftmeshConfig.from_dict(config)
        target = load_target(cfg.engine)
        self._cfg, self._target, self._handles = cfg, target, draft_handles
        context = serve.get_replica_context()
        name = f"{socket.gethostname()}/{context.replica_id.unique_id if context else os.getpid()}"
        self._metrics = VerifierMetrics(RayMetrics(), name)
        self.replica = VerifierReplica(self._new_decoder(), name=name, factcheck_link=self._factcheck_link,
                                       factcheck_wait_s=cfg.factcheck.wait_ms / 1000, metrics=self._metrics,
                                       stream_interval=cfg.serve.stream_interval)
        sources = ", ".join(s.name for s in self.replica.decoder.sources)
        log.info("verifier replica %s ready: model %s, sources %s", name, cfg.engine.model, sources)

    def _new_decoder(self) -> SpeculativeDecoder:
        cfg = self._cfg
        extra = remote_sources(cfg, self._handles, cfg.engine.model)
        self._factcheck_link = self._new_factcheck_link() if cfg.factcheck.enabled else None
        return decoder_from_config(self._target, cfg, extra_sources=extra, flag_provider=self._factcheck_link,
                                   batch_observer=getattr(self, "_metrics", None))

    def _new_factcheck_link(self) -> FactCheckLink:
        client = FactCheckClient(self._cfg.serve.redis_url, self._cfg.factcheck_config())
        return FactCheckLink(client, self._target.tokenizer)

    @serve.multiplexed(max_num_models_per_replica=1024)
    async def _session(self, session_id: str) -> _Session:
        return _Session(session_id)

    async def generate(self, request: ServeRequest) -> AsyncIterator[Any]:
        if request.session_id:
            await self._session(serve.get_multiplexed_model_id() or request.session_id)
        async for event in self.replica.run(request):
            yield event

    async def stats(self) -> dict:
        return self.replica.stats()

    async def reset_state(self) -> None:
        """Forget what this replica learned (builder statistics, in-memory stores, session KV),
        keeping the loaded model and its cost curve: benchmarks start each pass cold, like the
        in-process engine they are compared with. Only for an idle replica."""
        if self.replica.stats()["active"]:
            raise RuntimeError("reset_state needs an idle replica")
        old, self.replica.decoder = self.replica.decoder, self._new_decoder()
        self.replica.factcheck_link = self._factcheck_link
        old.close()
