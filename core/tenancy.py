"""Tenants: who owns which shared state, what each may read of the others', and their quotas.

Every piece of state shared by name (sessions and their KV, the answer store, document
indexes, per-request draft state, output annotations) is keyed by a *scoped* id,
``<tenant>/<id>``, made once at the router (``scope``). A tenant name has no '/', so a scoped
id splits one way only and no client-chosen id can reach another tenant's names. The answer
store is the one place tenants may meet on purpose: a tenant listed in another's
``share_answers_with`` may draft from that one's answers, with exact (lossless) requests only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable

from draftmesh.config import DEFAULT_TENANT, ServeConfig
from draftmesh.io_struct import ServeRequest


def scope(tenant: str, ident: str) -> str:
    """``ident`` (a request or session id) in ``tenant``'s namespace."""
    return f"{tenant}/{ident}"


def scoped_request(req: ServeRequest) -> ServeRequest:
    """The request as the verifier gets it: its request and session ids in its tenant's namespace,
    so session KV, session turns, document indexes, per-request draft state and output
    annotation ids (all keyed by those ids below the router) are the tenant's own."""
    return dataclasses.replace(
        req, request_id=scope(req.tenant, req.request_id),
        session_id=None if req.session_id is None else scope(req.tenant, req.session_id),
    )


@dataclass(frozen=True)
class Tenant:
    name: str
    max_in_flight: int
    """0: unlimited."""
    tokens_per_minute: int
    """0: unlimited."""
    reads_answers_of: tuple[str, ...]
    """Tenants that share their answer store with this one (for its exact requests)."""
    in_flight_key: str = "serve.tenant_max_in_flight"
    """The config key ``max_in_flight`` came from, for refusals to name."""
    tokens_key: str = "serve.tenant_tokens_per_minute"


class Tenants:
    """The configured tenants (and those that only hold a key file line), with quotas resolved."""

    def __init__(self, serve: ServeConfig, names: Iterable[str] = ()) -> None:
        known = set(names) | set(serve.tenants) | {DEFAULT_TENANT}
        readers: dict[str, list[str]] = {}
        for owner, spec in sorted(serve.tenants.items()):
            unknown = sorted(set(spec.share_answers_with) - known)
            if unknown:
                raise ValueError(f"serve.tenants.{owner}.share_answers_with names unknown tenants: {', '.join(unknown)}")
            for reader in spec.share_answers_with:
                if reader != owner:
                    readers.setdefault(reader, []).append(owner)
        self._tenants: dict[str, Tenant] = {}
        for name in sorted(known):
            spec = serve.tenants.get(name)
            own_in_flight = spec is not None and spec.max_in_flight is not None
            own_tpm = spec is not None and spec.tokens_per_minute is not None
            self._tenants[name] = Tenant(
                name,
                spec.max_in_flight if own_in_flight else serve.tenant_max_in_flight,
                spec.tokens_per_minute if own_tpm else serve.tenant_tokens_per_minute,
                tuple(readers.get(name, ())),
                f"serve.tenants.{name}.max_in_flight" if own_in_flight else "serve.tenant_max_in_flight",
                f"serve.tenants.{name}.tokens_per_minute" if own_tpm else "serve.tenant_tokens_per_minute",
            )

    @property
    def names(self) -> tuple[str, ...]:
        """Every tenant name: the bounded label set of per-tenant metrics."""
        return tuple(self._tenants)

    def __getitem__(self, name: str) -> Tenant:
        return self._tenants[name]
