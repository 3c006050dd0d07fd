"""The one served mesh of a test session: real Ray Serve, real gRPC and HTTP faces, real Redis, real
SmolLM2 on CPU, a fact-check worker, traces to an in-process OTLP receiver.

Why one: starting a mesh costs ~15 s here and far more in CI, and a process holds one Ray/Serve
instance anyway; tests/router/test_mesh.py (gRPC) and tests/router/test_http.py (the OpenAI face)
used to start one each. The fixtures are registered for the whole session by tests/conftest.py
(``pytest_plugins``), so every module gets the SAME mesh; conftest's collection hook runs the tests
that use it after all others (the mesh is started late and not held during unrelated tests), and
those marked ``breaks_mesh`` (a lost replica, Redis stopped) after every other mesh user.

The mesh runs the default in-process sources plus four remote ones: two Serve draft deployments that
raise or hang, an external gRPC DraftSource served by this test process, and an external address
where nothing listens.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import grpc
import pytest

from draftmesh.config import DraftmeshConfig
from draftmesh.net import free_port
from draftmesh.v1 import generation_pb2 as pb
from draftmesh.v1 import generation_pb2_grpc as pb_grpc

API_KEY = "test-key-0123456789"
AUTH = (("authorization", f"Bearer {API_KEY}"),)
MODEL = "smollm2-135m"
MAX_IN_FLIGHT = 8
TESTS_DIR = Path(__file__).resolve().parent
WIKIDATA = TESTS_DIR / "fixtures" / "wikidata"
COPY_PROMPT = (
    "Copy this sentence exactly, then stop: The quick brown fox jumps over the lazy dog "
    "while the cat sleeps on the warm windowsill."
)
TRACING_ENV = {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_BSP_SCHEDULE_DELAY": "200"}


def mesh_users_last(items: list) -> list:
    """Tests on the served mesh after all others, and those that break it (``breaks_mesh``: a lost
    replica, Redis stopped) after every other test on it; otherwise collection order (a stable sort).

    The mesh starts at its first user, so it is neither started nor held while unrelated tests run
    (CPU-bound ones beside a running mesh, or the CLI and bench tests that start a Ray of their own)."""
    def rank(item) -> int:
        if not uses_served_mesh(item):
            return 0
        return 2 if item.get_closest_marker("breaks_mesh") else 1

    return sorted(items, key=rank)


def uses_served_mesh(item) -> bool:
    """Whether a test's ``mesh`` is this module's (a module may define a ``mesh`` fixture of its own)."""
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.get("mesh", ()) if info is not None else ()
    return bool(defs) and getattr(defs[-1].func, "__module__", None) == __name__


@pytest.fixture(scope="session")
def external_source():
    """A DraftSource gRPC server in this process: prompt lookup over the target tokenizer."""
    from draftmesh.draft import registry
    from draftmesh.draft.grpc_server import serve_source

    server, port = serve_source(registry.create("prompt_lookup"), 0)
    yield f"127.0.0.1:{port}"
    server.stop(0)


@pytest.fixture(scope="session")
def otlp():
    """The collector every part of the mesh exports its spans to (an in-process OTLP receiver)."""
    from draftmesh.bench.otlp_receiver import OtlpReceiver

    receiver = OtlpReceiver().start()
    yield receiver
    receiver.stop()


@pytest.fixture(scope="session")
def mesh(external_source, otlp):
    from draftmesh.router.launcher import start_mesh

    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")]))
    small = {"num_cpus": 0.1}
    cfg = DraftmeshConfig.from_dict({
        "engine": {"threads": 2, "cost_cache": os.environ.get("DRAFTMESH_COST_CACHE")},
        "serve": {"grpc_port": free_port(), "http_port": free_port(), "verifier_num_cpus": 0.5,
                  # every admitted request runs at once (none waits in Serve's queue): a test can hold all slots
                  "max_in_flight": MAX_IN_FLIGHT, "verifier_max_ongoing": MAX_IN_FLIGHT, "api_keys": [API_KEY]},
        "sources": {"remote": {
            "boom": {"factory": "mesh_sources:raising", "deployment": small},
            "stuck": {"factory": "mesh_sources:hanging", "deployment": small},
            "extern": {"address": external_source, "token_ids": True},
            "down": {"address": f"127.0.0.1:{free_port()}"},
        }},
        # The workers (started by the launcher in their own environment when it exists) check
        # entities against an offline store built from the recorded Wikidata excerpts.
        "factcheck": {"wikidata": "offline", "wikidata_dump": [str(WIKIDATA / "entity-Q42.json")], "block_ms": 200},
    })
    # Tracing on for what the mesh starts (Ray's processes and the workers keep the environment
    # they started with), not for this test process.
    env = {**TRACING_ENV, "OTEL_EXPORTER_OTLP_ENDPOINT": otlp.endpoint}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        running = start_mesh(cfg, ray_init={"num_cpus": 4, "_system_config": {"metrics_report_interval_ms": 1000}})
    finally:
        for key, value in saved.items():
            os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)
    assert running.factcheck_workers is not None and running.redis is not None and running.http_address
    print(f"mesh started in {running.started_s:.1f}s; gRPC {running.address}, HTTP {running.http_address}")
    yield running
    running.stop()


@pytest.fixture(scope="session")
def channel(mesh):
    with grpc.insecure_channel(mesh.address) as ch:
        yield ch


@pytest.fixture(scope="session")
def stub(channel):
    return pb_grpc.GenerationStub(channel)


@pytest.fixture(scope="session")
def engine(mesh):
    """The in-process engine with the mesh's in-process sources."""
    from draftmesh.verify.engine import decoder_from_config, load_target

    cfg = DraftmeshConfig().replace(engine={"threads": 2, "cost_cache": os.environ.get("DRAFTMESH_COST_CACHE")})
    return decoder_from_config(load_target(cfg.engine), cfg)


def chat(text: str, max_new_tokens: int = 40, **kw) -> pb.GenerateRequest:
    return pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=text)], max_new_tokens=max_new_tokens, **kw)


def in_process(engine, text: str, max_new_tokens: int):
    from draftmesh.io_struct import GenerationRequest
    from draftmesh.prompts import encode_messages

    ids = encode_messages(engine.target.tokenizer, [{"role": "user", "content": text}])
    return engine.generate(GenerationRequest(tuple(ids), max_new_tokens=max_new_tokens))


def verifier_stats() -> dict:
    from ray import serve

    return serve.get_deployment_handle("verifier", app_name="draftmesh").stats.remote().result(timeout_s=10)


def wait_idle(timeout_s: float = 5.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = verifier_stats()
        if stats["active"] == 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def scrape(address: str) -> dict[str, float]:
    """Prometheus text -> {series: value}, series as written (name{labels})."""
    import urllib.request

    body = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    out = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            series, _, value = line.rpartition(" ")
            out[series] = float(value)
    return out


def total(metrics: dict[str, float], name: str, **labels: str) -> float:
    """Sum of a metric's series whose labels include ``labels``."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for series, v in metrics.items()
               if series.split("{", 1)[0] == name and all(w in series for w in want))
