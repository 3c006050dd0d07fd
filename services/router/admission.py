"""Per-tenant quotas at the router's door: requests in flight and generated tokens per minute.

Tokens are counted on a sliding 60-second window (a log of admissions, pruned as it is
read): a request is charged its ``max_new_tokens`` when admitted, since what it will cost
is not known yet, and its charge is corrected to the tokens it actually generated when it
ends (a request that fails or is cancelled without a result keeps its full charge, so
cancelling cannot be used to escape the quota). A sliding log rather than a fixed window:
no burst of twice the quota across a window boundary, and a tenant's log holds at most one
entry per request admitted in the last minute, which its in-flight and token quotas bound.

Quotas are per router replica, like ``serve.max_in_flight``. A refusal is ``QuotaExceeded``
naming the config key of the quota; the router answers it RESOURCE_EXHAUSTED (HTTP 429).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from draftmesh.tenancy import Tenant, Tenants

WINDOW_S = 60.0


class QuotaExceeded(Exception):
    """A tenant's quota refuses the request; ``key`` is the quota's config key."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(key, message)
        self.key = key
        self.message = message

    def __str__(self) -> str:
        return self.message


@dataclass
class _Charge:
    at: float
    tokens: int


@dataclass
class _TenantState:
    in_flight: int = 0
    window: deque[_Charge] = field(default_factory=deque)


@dataclass
class Ticket:
    """An admitted request's hold on its tenant's quotas; give it back with ``release``."""

    tenant: str
    charge: _Charge
    released: bool = False


class TenantAdmission:
    def __init__(self, tenants: Tenants, *, window_s: float = WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.tenants = tenants
        self.window_s = window_s
        self.clock = clock
        self._state = {name: _TenantState() for name in tenants.names}
        self._lock = threading.Lock()

    def admit(self, tenant: str, max_new_tokens: int) -> Ticket:
        """Hold one in-flight slot and ``max_new_tokens`` of the minute's tokens, or ``QuotaExceeded``."""
        spec = self.tenants[tenant]
        now = self.clock()
        if spec.tokens_per_minute and max_new_tokens > spec.tokens_per_minute:  # never admissible: say so first
            raise QuotaExceeded(spec.tokens_key, f"tenant {tenant!r}: quota {spec.tokens_key} exceeded: max_new_tokens "
                                f"{max_new_tokens} is over the limit of {spec.tokens_per_minute} tokens per minute; ask for fewer")
        with self._lock:
            state = self._state[tenant]
            if spec.max_in_flight and state.in_flight >= spec.max_in_flight:
                raise QuotaExceeded(spec.in_flight_key, f"tenant {tenant!r}: quota {spec.in_flight_key} exceeded: "
                                    f"{state.in_flight} requests in flight (limit {spec.max_in_flight}); retry later")
            if spec.tokens_per_minute:
                self._check_tokens(spec, state, max_new_tokens, now)
            charge = _Charge(now, max_new_tokens)
            state.window.append(charge)
            state.in_flight += 1
        return Ticket(tenant, charge)

    def _check_tokens(self, spec: Tenant, state: _TenantState, asked: int, now: float) -> None:
        limit, key = spec.tokens_per_minute, spec.tokens_key
        while state.window and state.window[0].at <= now - self.window_s:
            state.window.popleft()
        used = sum(c.tokens for c in state.window)
        if used + asked <= limit:
            return
        freed, wait = used + asked - limit, self.window_s
        for c in state.window:  # the oldest charges leave the window first
            freed -= c.tokens
            if freed <= 0:
                wait = c.at + self.window_s - now
                break
        raise QuotaExceeded(key, f"tenant {spec.name!r}: quota {key} exceeded: {used} of {limit} tokens used in the "
                            f"last {self.window_s:g} s and {asked} asked; retry in {math.ceil(max(wait, 0.0))} s")

    def release(self, ticket: Ticket, generated_tokens: int | None) -> None:
        """The request ended; ``generated_tokens`` corrects its charge (None: no result, the charge stays)."""
        with self._lock:
            if ticket.released:
                return
            ticket.released = True
            self._state[ticket.tenant].in_flight -= 1
            if generated_tokens is not None:
                ticket.charge.tokens = max(0, int(generated_tokens))

    def in_flight(self, tenant: str) -> int:
        return self._state[tenant].in_flight

    def tokens_used(self, tenant: str) -> int:
        """Tokens charged to ``tenant`` in the current window."""
        now = self.clock()
        with self._lock:
            return sum(c.tokens for c in self._state[tenant].window if c.at > now - self.window_s)
