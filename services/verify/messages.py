"""Plain dataclasses that travel between the router and a verifier replica (pickled by Ray).

The router has validated every field against the request rules; the replica still checks
what only the model knows (token counts against the context, policy parameters) and
answers ``Rejected`` for those, which the router turns into INVALID_ARGUMENT.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping


@dataclass(frozen=True)
class ServeRequest:
    request_id: str
    prompt: str | None = None
    """Raw text, no chat template. Exactly one of prompt and messages is set."""
    messages: tuple[tuple[str, str], ...] | None = None
    """(role, content) turns; the model's chat template is applied."""
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    session_id: str | None = None
    documents: tuple[str, ...] = ()
    speculate: bool = True
    sources: tuple[str, ...] | None = None
    source_caps: Mapping[str, int] = field(default_factory=dict)
    max_nodes: int | None = None
    policy: str = "exact"
    policy_params: Mapping[str, Any] = field(default_factory=dict)
    factcheck: bool = True
    """Annotate the output (when the mesh runs the fact-check service)."""
    factcheck_wait_ms: int | None = None
    """How long the result may wait for the output's annotations (None: the server's default)."""
    trace_context: Mapping[str, str] = field(default_factory=dict)
    """W3C trace headers of the router's span (Ray carries no trace context across a handle call)."""


@dataclass(frozen=True)
class Rejected:
    """The replica refused the request before decoding; ``message`` says why."""

    message: str
