"""One bench item through the mesh's HTTP face with the real ``openai`` client (``OpenAIRunner``).

Why the official client and not raw HTTP: the figure the bench reports is what a user of the OpenAI
API gets from draftmesh, client parsing included, and the same request through the gRPC face
(``MeshRunner``) is its reference (``draftmesh.bench.faces``).
"""

from __future__ import annotations

import time
from typing import Any

from draftmesh.bench.items import ItemRun, PreparedItem, SourceStats
from draftmesh.bench.mesh import MESH_TIMEOUT_S, MeshError


class OpenAIRunner:
    """A streaming ``/v1/chat/completions`` (an item with messages) or ``/v1/completions`` (a raw
    prompt) per item, with the same request the gRPC ``MeshRunner`` sends: the item's documents (ids
    "0", "1", ... as ``build_request`` numbers them), session, ``max_tokens``, greedy (the server's
    default on both faces), speculation off when ``speculate`` is False.

    Timing is client-side wall time around the whole stream; ``first_token_s`` the time to the first
    chunk that carries text; ``steps`` the ``draftmesh`` object's. The HTTP face returns text, not
    token ids, so ``token_ids`` stays empty: the faces are compared by text and by
    ``usage.completion_tokens`` (``completion_tokens`` on the run).
    """

    lossless = True

    def __init__(self, name: str, base_url: str, *, model: str, api_key: str | None = None, speculate: bool = True,
                 session_suffix: str = "", timeout_s: float = MESH_TIMEOUT_S) -> None:
        import openai  # lazy: a test/bench dependency, only this face needs it

        self.name = name
        self.base_url = base_url
        self.model = model
        self.speculate = speculate
        self.session_suffix = session_suffix
        self.client = openai.OpenAI(base_url=base_url, api_key=api_key or "none", max_retries=0, timeout=timeout_s)

    def close(self) -> None:
        self.client.close()

    def body(self, item: PreparedItem) -> tuple[str, dict[str, Any]]:
        """(endpoint, keyword arguments of the client call) for an item."""
        work = item.item
        extra: dict[str, Any] = {}
        if work.corpus:
            extra["documents"] = [{"id": str(i), "text": text} for i, text in enumerate(work.corpus)]
        if work.session:
            extra["session_id"] = f"{work.session}{self.session_suffix}"
        if not self.speculate:
            extra["speculation"] = {"enabled": False}
        kwargs: dict[str, Any] = {"model": self.model, "max_tokens": item.max_new_tokens, "stream": True,
                                  "stream_options": {"include_usage": True}, "extra_body": extra or None}
        if work.messages is not None:
            return "chat", {**kwargs, "messages": [dict(m) for m in work.messages]}
        return "completions", {**kwargs, "prompt": work.prompt}

    def run(self, item: PreparedItem) -> ItemRun:
        import openai

        endpoint, kwargs = self.body(item)
        create = self.client.chat.completions.create if endpoint == "chat" else self.client.completions.create
        parts: list[str] = []
        first_token_s = None
        usage = extra = None
        t0 = time.perf_counter()
        try:
            with create(**kwargs) as stream:
                for chunk in stream:
                    for choice in chunk.choices:
                        text = choice.delta.content if endpoint == "chat" else choice.text
                        if text:
                            if first_token_s is None:
                                first_token_s = time.perf_counter() - t0
                            parts.append(text)
                        if choice.finish_reason:
                            extra = (chunk.model_extra or {}).get("draftmesh")
                    if chunk.usage is not None:
                        usage = chunk.usage
            seconds = time.perf_counter() - t0
        except openai.APIError as exc:
            raise MeshError(f"{self.name}: item {item.id!r}: the HTTP face at {self.base_url} answered "
                            f"{getattr(exc, 'status_code', None) or type(exc).__name__}: {exc}") from None
        if usage is None:
            raise MeshError(f"{self.name}: item {item.id!r}: the stream ended without its usage chunk")
        if usage.prompt_tokens != len(item.prompt_ids):
            raise MeshError(f"{self.name}: item {item.id!r}: the HTTP face rendered the prompt to {usage.prompt_tokens} "
                            f"tokens, the bench to {len(item.prompt_ids)}: the mesh must serve the same model as --model")
        extra = extra or {}
        sources = {name: SourceStats(accepted_tokens=int(n)) for name, n in (extra.get("accepted_per_source") or {}).items()}
        cached = getattr(usage.prompt_tokens_details, "cached_tokens", None) if usage.prompt_tokens_details else None
        return ItemRun(item_id=item.id, kind=item.kind, method=self.name, token_ids=[], seconds=seconds,
                      steps=extra.get("steps"), sources=sources, text="".join(parts), prompt_tokens=int(usage.prompt_tokens),
                      first_token_s=first_token_s, cached_prompt_tokens=cached,
                      completion_tokens=int(usage.completion_tokens))
