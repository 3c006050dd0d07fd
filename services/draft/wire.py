"""DraftContext and Proposal to and from the DraftSource protos.

One conversion for every path a draft travels: a Ray Serve handle call to a draft
deployment, an external gRPC DraftSource, and the gRPC server that exposes a built-in
source. Token-id proposals only make sense with the target's tokenizer, so the request
names it and a source that does not share it answers in text.
"""

from __future__ import annotations

from typing import Sequence

from draftmesh.config import DEFAULT_TENANT
from draftmesh.draft.base import MAX_PROPOSALS_PER_SOURCE, TEXT_CHARS_PER_NODE, DraftContext, Proposal, bounded
from draftmesh.io_struct import MAX_TREE_NODES
from draftmesh.v1 import draft_source_pb2 as pb
from draftmesh.v1 import generation_pb2 as gen_pb


def context_to_proto(ctx: DraftContext, tokenizer: str = "") -> pb.ProposeRequest:
    return pb.ProposeRequest(
        request_id=ctx.request_id,
        session_id=ctx.session_id or "",
        tokenizer=tokenizer,
        token_ids=list(ctx.token_ids),
        prompt_len=ctx.prompt_len,
        text_tail=ctx.text_tail,
        documents=[gen_pb.Document(id=str(i), text=d) for i, d in enumerate(ctx.documents)],
        size_hint=ctx.size_hint,
        temperature=float(ctx.options.get("temperature") or 0.0),
    )


def tenant_of(request_id: str) -> str:
    """The tenant a scoped request id (``<tenant>/<id>``, made by the router) belongs to."""
    return request_id.split("/", 1)[0] if "/" in request_id else DEFAULT_TENANT


def context_from_proto(req: pb.ProposeRequest) -> DraftContext:
    """A remote source's context. The wire carries no policy, so a remote source drafts from
    its request's own tenant's answers only (never shared ones) and stores none."""
    if req.prompt_len > len(req.token_ids):
        raise ValueError(f"prompt_len {req.prompt_len} exceeds the {len(req.token_ids)} token ids")
    tenant = tenant_of(req.request_id)
    return DraftContext(
        token_ids=tuple(req.token_ids),
        prompt_len=req.prompt_len,
        text_tail=req.text_tail,
        documents=tuple(d.text for d in req.documents),
        session_id=req.session_id or None,
        request_id=req.request_id,
        size_hint=req.size_hint or 16,
        options={"temperature": req.temperature},
        tenant=tenant,
        answer_tenants=(tenant,),
        store_answer=False,
    )


def proposals_to_proto(source: str, proposals: Sequence[Proposal]) -> pb.ProposeResponse:
    """Token-id proposals travel as ids, text ones as text; draft distributions stay home
    (a remote draft is then treated as deterministic, which keeps sampling exact)."""
    out = pb.ProposeResponse(source=source)
    for p in proposals:
        msg = out.proposals.add(confidence=float(p.confidence), text_complete=p.text_complete)
        if p.token_ids is not None:
            msg.token_ids.extend(p.token_ids)
            if p.token_probs is not None:
                msg.token_probs.extend(p.token_probs)
        else:
            msg.text = p.text or ""
    return out


def proposals_from_proto(resp: pb.ProposeResponse, source: str, *, token_ids_ok: bool = True) -> list[Proposal]:
    """Proposals named after ``source`` (the name this deployment knows it by, not the one
    it claims). With ``token_ids_ok`` False, id proposals are dropped: the source does not
    share the target's tokenizer. What a remote source sends is bounded here first: at most
    ``MAX_PROPOSALS_PER_SOURCE`` proposals, each cut to a tree of ``MAX_TREE_NODES`` nodes,
    scores clamped to [0, 1] (``bounded``)."""
    out = []
    for msg in resp.proposals[:MAX_PROPOSALS_PER_SOURCE]:
        confidence = min(1.0, max(0.0, msg.confidence)) if msg.confidence == msg.confidence else 0.0
        if msg.token_ids:
            if not token_ids_ok:
                continue
            n = min(len(msg.token_ids), MAX_TREE_NODES)
            probs = tuple(msg.token_probs[:n]) if len(msg.token_probs) == len(msg.token_ids) else None
            out.append(bounded(Proposal(source, token_ids=tuple(msg.token_ids[:n]), token_probs=probs,
                                        confidence=confidence), MAX_TREE_NODES))
        elif msg.text:
            text = msg.text[: MAX_TREE_NODES * TEXT_CHARS_PER_NODE]
            out.append(Proposal(source, text=text, confidence=confidence,
                                text_complete=msg.text_complete and len(text) == len(msg.text)))
    return out
