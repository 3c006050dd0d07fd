"""A draft source hosted by a Ray Serve draft deployment, asked through its handle.

The verifier's step deadline (SourceCaller) bounds how long a step waits; the handle call
has its own timeout slightly above it so a hung deployment frees the caller's worker
thread soon after instead of holding it for good.
"""

from __future__ import annotations

import logging
from typing import Any

from draftmesh import tracing
from draftmesh.draft.base import DraftContext, Proposal
from draftmesh.draft.wire import context_to_proto, proposals_from_proto

log = logging.getLogger(__name__)


class ServeHandleSource:
    def __init__(self, name: str, handle: Any, *, tokenizer_name: str = "", timeout_s: float = 1.0) -> None:
        self.name = name
        self._handle = handle
        self._tokenizer_name = tokenizer_name
        self.timeout_s = timeout_s

    def propose(self, ctx: DraftContext) -> list[Proposal]:
        # Ray carries no trace context: the deployment's span gets the step's from this carrier.
        response = self._handle.Propose.remote(context_to_proto(ctx, self._tokenizer_name), tracing.inject())
        try:
            answer = response.result(timeout_s=self.timeout_s)
        except TimeoutError:
            response.cancel()
            raise
        # Draft deployments load the target's tokenizer, so their token ids are ours.
        return proposals_from_proto(answer, self.name, token_ids_ok=True)
