"""Bearer API-key check for the router's gRPC front door and ``draftmesh draft-serve``, and
which tenant a key belongs to.

Each key names a tenant (``serve.tenants.<name>.keys``, or a key file line ``<tenant> <key>``);
a bare key (``serve.api_keys``, a one-word key file line) belongs to ``DEFAULT_TENANT``, and so
does every request when auth is off, so local dev keeps one tenant, as before tenants existed.

Only SHA-256 digests of the configured keys are kept. A presented key is hashed and
compared with ``hmac.compare_digest`` against every configured digest, with no early
exit, so neither the key's length nor which key matched shows in the timing. Reasons
for a refusal never contain the presented or a configured key.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path
from typing import Iterable, Sequence

from draftmesh.config import DEFAULT_TENANT, ServeConfig, check_tenant_name

MISSING = "missing authorization metadata"
MALFORMED = "authorization must be 'Bearer <key>'"
INVALID = "invalid API key"


def read_key_file(path: str, what: str = "key file") -> list[str]:
    """The keys of a key file: one per line; blank lines and lines starting with '#' skipped.

    An unreadable or keyless file is a ValueError naming ``what`` and the path, never a key."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{what}={path}: cannot read the key file ({type(exc).__name__})") from None
    found = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    if not found:
        raise ValueError(f"{what}={path}: the key file holds no keys")
    return found


def read_tenant_key_file(path: str, what: str = "key file") -> list[tuple[str, str]]:
    """(tenant, key) pairs of a key file: ``<key>`` (the default tenant) or ``<tenant> <key>`` a line.

    A line of more than two words is a ValueError naming its line number (never its text)."""
    pairs = []
    for n, line in enumerate(read_key_file(path, what), start=1):
        words = line.split()
        if len(words) == 1:
            pairs.append((DEFAULT_TENANT, words[0]))
        elif len(words) == 2:
            pairs.append((check_tenant_name(words[0], f"{what}={path} key line {n}"), words[1]))
        else:
            raise ValueError(f"{what}={path}: key line {n} must be '<key>' or '<tenant> <key>'")
    return pairs


class Unauthenticated(Exception):
    """The request carries no valid key; ``str()`` is the reason (never a key)."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


class ApiKeyAuth:
    """Accepts requests whose ``authorization`` metadata is ``Bearer <one of the keys>``.

    ``keys`` None or empty (and no ``tenant_keys``): auth is off and every request is allowed,
    as the default tenant. ``keys`` belong to the default tenant; ``tenant_keys`` are
    (tenant, key) pairs. One key given to two tenants is a ValueError (which would it be?).
    """

    def __init__(self, keys: Sequence[str] | None, tenant_keys: Sequence[tuple[str, str]] = ()) -> None:
        digests: list[bytes] = []
        owners: list[str] = []
        pairs = [(DEFAULT_TENANT, key) for key in keys or ()] + list(tenant_keys)
        for i, (tenant, key) in enumerate(pairs):
            if not isinstance(key, str) or not key.strip():
                raise ValueError(f"API key #{i + 1} is empty or not a string")
            key = key.strip()
            # gRPC ASCII metadata is printable ASCII; a key a client cannot send is a config error.
            if any(not 0x21 <= ord(ch) <= 0x7E for ch in key):
                raise ValueError(f"API key #{i + 1} must be printable ASCII without whitespace")
            digest = _digest(key)
            if digest in digests and owners[digests.index(digest)] != tenant:
                raise ValueError(f"API key #{i + 1} is given to two tenants: {owners[digests.index(digest)]} and {tenant}")
            if digest not in digests:
                digests.append(digest)
                owners.append(tenant)
        self._digests: tuple[bytes, ...] = tuple(digests)
        self._owners: tuple[str, ...] = tuple(owners)

    @property
    def tenants(self) -> frozenset[str]:
        """The tenants that hold a key (only the default one when auth is off)."""
        return frozenset(self._owners) if self._owners else frozenset({DEFAULT_TENANT})

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def __repr__(self) -> str:
        return f"ApiKeyAuth(enabled={self.enabled}, keys={len(self._digests)})"

    @classmethod
    def from_config(cls, serve: ServeConfig) -> "ApiKeyAuth":
        """Keys from ``serve.api_keys`` (default tenant), ``serve.tenants.<name>.keys`` and
        ``serve.api_keys_file`` (DRAFTMESH_API_KEYS_FILE).

        The file holds one key per line, ``<key>`` or ``<tenant> <key>``; blank lines and lines
        starting with '#' are skipped. A set but unreadable or keyless file is an error (auth
        never silently off).
        """
        pairs = [(name, key) for name, tenant in serve.tenants.items() for key in tenant.keys or ()]
        if serve.api_keys_file:
            pairs += read_tenant_key_file(serve.api_keys_file, "serve.api_keys_file")
        return cls(list(serve.api_keys or ()), pairs)

    @classmethod
    def from_keys_and_file(cls, keys: Sequence[str] | None, path: str | None) -> "ApiKeyAuth":
        """``keys`` plus those in the key file ``path``, read as ``from_config`` reads it."""
        return cls.from_config(ServeConfig(api_keys=list(keys) if keys else None, api_keys_file=path))

    def check(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
        """None when the request may proceed, else a short reason (never containing a key)."""
        try:
            self.identify(metadata)
        except Unauthenticated as exc:
            return str(exc)
        return None

    def identify(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
        """The tenant whose key the request carries (the default tenant when auth is off);
        ``Unauthenticated`` with the reason otherwise."""
        if not self._digests:
            return DEFAULT_TENANT
        reason, tenant = self._match(metadata)
        if tenant is None:
            raise Unauthenticated(reason)
        return tenant

    def _match(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> tuple[str, str | None]:
        values = [v for k, v in (metadata or ()) if isinstance(k, str) and k.lower() == "authorization"]
        if not values:
            return MISSING, None
        if len(values) > 1:
            return MALFORMED, None
        value = values[0]
        if isinstance(value, (bytes, bytearray)):
            try:
                value = bytes(value).decode("ascii")
            except UnicodeDecodeError:
                return MALFORMED, None
        parts = value.split()
        if len(parts) != 2 or parts[0].lower() != "bearer":
            return MALFORMED, None
        presented = _digest(parts[1])
        found: str | None = None
        for digest, owner in zip(self._digests, self._owners):  # every key, no early exit
            if hmac.compare_digest(digest, presented):
                found = owner
        return ("", found) if found is not None else (INVALID, None)
