"""The router's bearer API-key check: ``draftmesh.auth`` (in the base layer, so that
``draft-serve`` checks the same keys the same way)."""

from draftmesh.auth import INVALID, MALFORMED, MISSING, ApiKeyAuth

__all__ = ["ApiKeyAuth", "INVALID", "MALFORMED", "MISSING"]
