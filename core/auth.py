"""Bearer API-key check for the router's gRPC front door and ``draftmesh draft-serve``.

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

from draftmesh.config import ServeConfig

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


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


class ApiKeyAuth:
    """Accepts requests whose ``authorization`` metadata is ``Bearer <one of the keys>``.

    ``keys`` None or empty: auth is off and every request is allowed.
    """

    def __init__(self, keys: Sequence[str] | None) -> None:
        digests = []
        for i, key in enumerate(keys or ()):
            if not isinstance(key, str) or not key.strip():
                raise ValueError(f"API key #{i + 1} is empty or not a string")
            key = key.strip()
            # gRPC ASCII metadata is printable ASCII; a key a client cannot send is a config error.
            if any(not 0x21 <= ord(ch) <= 0x7E for ch in key):
                raise ValueError(f"API key #{i + 1} must be printable ASCII without whitespace")
            digests.append(_digest(key))
        self._digests: tuple[bytes, ...] = tuple(digests)

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def __repr__(self) -> str:
        return f"ApiKeyAuth(enabled={self.enabled}, keys={len(self._digests)})"

    @classmethod
    def from_config(cls, serve: ServeConfig) -> "ApiKeyAuth":
        """Keys from ``serve.api_keys`` plus those in ``serve.api_keys_file`` (DRAFTMESH_API_KEYS_FILE).

        The file holds one key per line; blank lines and lines starting with '#' are
        skipped. A set but unreadable or keyless file is an error (auth never silently off).
        """
        keys = list(serve.api_keys or ())
        if serve.api_keys_file:
            keys += read_key_file(serve.api_keys_file, "serve.api_keys_file")
        return cls(keys)

    @classmethod
    def from_keys_and_file(cls, keys: Sequence[str] | None, path: str | None) -> "ApiKeyAuth":
        """``keys`` plus those in the key file ``path``, read as ``from_config`` reads it."""
        return cls.from_config(ServeConfig(api_keys=list(keys) if keys else None, api_keys_file=path))

    def check(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
        """None when the request may proceed, else a short reason (never containing a key)."""
        if not self._digests:
            return None
        values = [v for k, v in (metadata or ()) if isinstance(k, str) and k.lower() == "authorization"]
        if not values:
            return MISSING
        if len(values) > 1:
            return MALFORMED
        value = values[0]
        if isinstance(value, (bytes, bytearray)):
            try:
                value = bytes(value).decode("ascii")
            except UnicodeDecodeError:
                return MALFORMED
        parts = value.split()
        if len(parts) != 2 or parts[0].lower() != "bearer":
            return MALFORMED
        presented = _digest(parts[1])
        ok = False
        for digest in self._digests:  # every key, no early exit
            ok |= hmac.compare_digest(digest, presented)
        return None if ok else INVALID
