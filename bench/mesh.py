"""The bench's side of the served mesh: a runner per mesh method (``MeshRunner``), the reset of a mesh
the bench started (``OwnMeshState``), its memory, and ``open_mesh`` (connect, or start one)."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Any, Callable, Sequence

import grpc
import redis

from draftmesh.bench.items import ItemRun, PreparedItem, SourceStats
from draftmesh.bench.memory import processes_memory
from draftmesh.bench.methods import MESH_DRAFTMESH, Method
from draftmesh.client import MeshClient, api_key_from_env, build_request
from draftmesh.config import DraftmeshConfig
from draftmesh.net import free_port
from draftmesh.router.app import APP_NAME
from draftmesh.router.launcher import start_mesh

MESH_TIMEOUT_S = 600.0
"""Deadline of one mesh request (a hung mesh must not hang the bench)."""


class MeshError(RuntimeError):
    """The mesh could not be started or reached, refused a request, or answered inconsistently."""


def answered(name: str, item_id: str, addr: str, exc: grpc.RpcError) -> MeshError:
    """A gRPC failure of one item as the bench reports it (its method, the item, the mesh, the status)."""
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return MeshError(f"{name}: item {item_id!r}: the mesh at {addr} answered "
                     f"{code.name if code is not None else 'UNKNOWN'}: {details}")


class MeshRunner:
    """One method through the served mesh: a streaming ``Generate`` per item (``draftmesh.client``).

    The request carries the item as the workload gives it (``messages`` or the raw
    ``prompt``; the mesh renders it with the same ``draftmesh.prompts`` functions the bench
    uses, which is checked on every answer through ``usage.prompt_tokens``), its corpus as
    documents, its session and ``max_new_tokens``. ``speculate=False`` disables speculation
    (``mesh:plain``); ``True`` leaves the mesh's default speculation.

    Timing is client-side wall time around the whole streaming call; ``first_token_s`` is the
    time to the first delta that carries tokens; ``steps`` the target forwards the deltas
    cover (one each, unless the mesh's ``serve.stream_interval`` merges steps); draft/verify
    time the sum of the deltas' ``StepStats``. Per-source accepted tokens come from the
    result; the API does not expose proposals, so a mesh run's proposal counts stay 0.

    ``reset`` calls ``resetter`` (given when the bench owns the mesh: see ``OwnMeshState``).
    ``session_suffix`` keeps this method's sessions apart from another mesh method's on the
    same mesh (the in-process methods each have their own decoder, so their sessions never
    mix either). ``run_after`` names a method that must run before this one on each item:
    every request leaves its answer in the mesh's shared answer store, so a speculating
    method must not run an item after another method already answered it.
    """

    lossless = True

    def error(self, item: PreparedItem, exc: grpc.RpcError) -> MeshError:
        return answered(self.name, item.id, getattr(self.client, "addr", "?"), exc)

    def __init__(
        self,
        name: str,
        client,
        *,
        speculate: bool = True,
        max_nodes: int | None = None,
        resetter: Callable[[], None] | None = None,
        session_suffix: str = "",
        run_after: str | None = None,
        timeout_s: float | None = MESH_TIMEOUT_S,
    ) -> None:
        self.name = name
        self.client = client
        self.speculate = speculate
        self.max_nodes = max_nodes
        self.resetter = resetter
        self.session_suffix = session_suffix
        self.run_after = run_after
        self.timeout_s = timeout_s

    def reset(self) -> None:
        if self.resetter is not None:
            self.resetter()

    def request(self, item: PreparedItem):
        """The ``GenerateRequest`` for an item."""
        work = item.item
        session = f"{work.session}{self.session_suffix}" if work.session else ""
        return build_request(
            work.prompt if work.messages is None else None,
            messages=[dict(m) for m in work.messages] if work.messages is not None else None,
            max_new_tokens=item.max_new_tokens,
            session_id=session,
            documents=list(work.corpus),
            speculate=None if self.speculate else False,
            max_nodes=self.max_nodes if self.speculate else None,
        )

    def run(self, item: PreparedItem) -> ItemRun:
        req = self.request(item)
        steps, draft_ms, verify_ms = 0, 0.0, 0.0
        first_token_s = None
        result = None
        call = None
        t0 = time.perf_counter()
        try:
            call = self.client.generate(req, timeout_s=self.timeout_s)
            for response in call:
                kind = response.WhichOneof("event")
                if kind == "delta":
                    steps += response.delta.stats.steps or 1  # a delta may cover several (serve.stream_interval)
                    if first_token_s is None and len(response.delta.token_ids):
                        first_token_s = time.perf_counter() - t0
                    draft_ms += response.delta.stats.draft_ms
                    verify_ms += response.delta.stats.verify_ms
                elif kind == "result":
                    result = response.result
            seconds = time.perf_counter() - t0
        except grpc.RpcError as exc:
            raise self.error(item, exc) from None
        except KeyboardInterrupt:
            if call is not None:
                call.cancel()
            raise
        if result is None:
            raise MeshError(f"{self.name}: item {item.id!r}: the stream ended without a result")
        if result.usage.prompt_tokens != len(item.prompt_ids):
            what = "chat messages (chat template)" if item.item.messages is not None else "raw prompt text"
            raise MeshError(
                f"{self.name}: item {item.id!r}: the mesh rendered the {what} to {result.usage.prompt_tokens} "
                f"prompt tokens, the bench to {len(item.prompt_ids)}: the mesh must serve the same model "
                f"(and tokenizer) as --model"
            )
        sources = {s.source: SourceStats(accepted_tokens=int(s.accepted_tokens)) for s in result.sources}
        return ItemRun(
            item_id=item.id,
            kind=item.kind,
            method=self.name,
            token_ids=[int(t) for t in result.token_ids],
            seconds=seconds,
            steps=steps,
            draft_s=draft_ms / 1000.0,
            verify_s=verify_ms / 1000.0,
            sources=sources,
            text=result.text,
            prompt_tokens=int(result.usage.prompt_tokens),
            lenient_tokens=int(result.lenient_tokens),
            first_token_s=first_token_s,
            cached_prompt_tokens=int(result.usage.cached_prompt_tokens),
        )


class OwnMeshState:
    """Resets the learned state of a mesh this process started (``reset`` before every pass).

    ``reset_state`` on the verifier deployment rebuilds the decoder of the replica it
    reaches (builder statistics, in-memory stores, session KV; the model and its cost curve
    stay), and the answer store's Redis is emptied (``FLUSHDB`` on the mesh's embedded
    redis-server; on a Redis given through ``REDIS_URL`` only the answer store's keys are
    deleted). A deployment handle call reaches ONE replica: with more than one verifier
    replica the others keep their state (the bench starts exactly one).
    """

    ANSWER_PREFIX = "draftmesh:answers:"

    def __init__(self, redis_url: str | None, *, embedded_redis: bool, app_name: str | None = None,
                 idle_timeout_s: float = 30.0) -> None:
        self.redis_url = redis_url
        self.embedded_redis = embedded_redis
        self.app_name = app_name
        self.idle_timeout_s = idle_timeout_s
        self.resets = 0

    def reset(self) -> None:
        from ray import serve  # lazy: Ray only for a mesh this bench started

        app = self.app_name or APP_NAME
        handle = serve.get_deployment_handle("verifier", app_name=app)
        deadline = time.monotonic() + self.idle_timeout_s
        while True:
            try:
                handle.reset_state.remote().result()
                break
            except Exception as exc:  # noqa: BLE001 - the replica may still be finishing the last stream
                if "idle replica" in str(exc) and time.monotonic() < deadline:
                    time.sleep(0.05)
                    continue
                raise MeshError(f"cannot reset the mesh's verifier: {type(exc).__name__}: {exc}") from None
        if self.redis_url:
            client = redis.Redis.from_url(self.redis_url)
            try:
                if self.embedded_redis:
                    client.flushdb()
                else:
                    keys = list(client.scan_iter(match=self.ANSWER_PREFIX + "*", count=1000))
                    for start in range(0, len(keys), 1000):
                        client.delete(*keys[start : start + 1000])
            finally:
                client.close()
        self.resets += 1


def mesh_process_memory(root_pid: int | None = None) -> dict[str, Any] | None:
    """Memory of a local mesh this process started: every descendant process of ``root_pid``.

    ``start_mesh`` starts the embedded redis-server, Ray's gcs_server, raylet, dashboard,
    monitor and log monitor as children of this process and the raylet starts every Ray
    worker (the Serve controller, the proxy, the router and verifier replicas, Ray's agents),
    so the descendants are exactly the mesh; the bench process itself (the in-process
    methods' model) is not counted. Matching process names instead would also count other
    Ray instances of the same user. ``rss_mb`` sums resident set sizes (shared pages counted
    once per process), ``pss_mb`` proportional set sizes (shared pages split), where readable.
    None without psutil.
    """
    try:
        import psutil
    except ImportError:
        return None
    try:
        root = psutil.Process(root_pid or os.getpid())
        procs = root.children(recursive=True)
    except psutil.Error:
        return None
    counted = processes_memory(procs)
    own = None
    with contextlib.suppress(psutil.Error):
        own = root.memory_info().rss
    return {
        **counted,
        "counted": "every descendant process of the bench process (the mesh it started: redis-server, "
                   "Ray's gcs_server, raylet, agents and workers incl. Serve replicas), measured right after the run",
        "bench_process_rss_mb": round(own / 2**20, 1) if own is not None else None,
    }


def make_mesh_runners(
    methods: Sequence[Method], client, *, resetter: Callable[[], None] | None = None, max_nodes: int | None = None
) -> list[MeshRunner]:
    """The runners of the mesh methods, on one client (and one mesh).

    ``mesh:plain`` runs after ``mesh:draftmesh`` on every item and uses its own session ids
    (see ``MeshRunner``); ``max_nodes`` is sent per request (for a mesh the bench did not
    start; a mesh it starts gets it in its config instead).
    """
    names = {m.name for m in methods}
    runners = []
    for m in methods:
        if m.family != "mesh":
            continue
        plain = m.sources == ()
        runners.append(MeshRunner(
            m.name, client, speculate=not plain, max_nodes=max_nodes, resetter=resetter,
            session_suffix="#mesh-plain" if plain else "",
            run_after=MESH_DRAFTMESH if plain and MESH_DRAFTMESH in names else None,
        ))
    return runners


def open_mesh(
    cleanup: contextlib.ExitStack,
    methods: Sequence[Method],
    cfg: DraftmeshConfig,
    *,
    addr: str | None = None,
    api_key: str | None = None,
    tls_ca: bytes | None = None,
    max_nodes: int | None = None,
    http: bool = False,
) -> tuple[list[MeshRunner], dict[str, Any], Callable[[], dict[str, Any] | None]]:
    """Connect to ``addr``, or start a local mesh with the bench's config (its engine, sources
    and builder; a private, keyless, plaintext mesh on a free port), stopped by ``cleanup``, also
    on an error or Ctrl-C. Returns the mesh runners, the mesh facts for the report and a function
    measuring the mesh's memory (None for a mesh not started here). ``max_nodes`` (given by the
    user) is sent with every request to a mesh the bench did not start. ``http``: the mesh the bench
    starts serves its HTTP face too, on a free port (``info["http_address"]``); else that face is off,
    so a bench never takes the default port 8000 from a mesh already running here."""
    api_key = api_key_from_env(api_key)
    if addr:
        client = cleanup.enter_context(MeshClient(addr, api_key=api_key, tls_ca=tls_ca))
        print(
            f"draftmesh bench: warning: the mesh at {addr} was not started by the bench, so its learned state "
            "(answer store, builder statistics, session KV caches) carries over between passes and from "
            "earlier traffic: mesh:draftmesh does not start each pass cold like the in-process methods",
            file=sys.stderr,
        )
        runners = make_mesh_runners(methods, client, max_nodes=max_nodes)
        info = {"address": addr, "started_by_bench": False, "started_s": None, "memory": None,
                "mesh_state_reset": False, "tls": tls_ca is not None}
        return runners, info, lambda: None

    # Serve's per-request INFO lines would bury the progress bar and the tables
    cfg = cfg.replace(serve={"grpc_port": free_port(), "http_port": free_port() if http else 0, "log_level": "WARNING", "address": None, "api_keys": None,
                             "api_keys_file": None, "tls_cert": None, "tls_key": None})
    embedded_redis = cfg.serve.redis_url is None
    print(f"draftmesh bench: starting a local mesh for {cfg.engine.model} ({cfg.engine.threads} torch threads) ...",
          file=sys.stderr)
    try:
        running = start_mesh(cfg)
    except Exception as exc:  # noqa: BLE001 - reported as a bench error; start_mesh cleaned up
        raise MeshError(f"cannot start a local mesh: {type(exc).__name__}: {exc}") from exc
    cleanup.callback(running.stop)
    print(f"draftmesh bench: mesh ready at {running.address} in {running.started_s:.1f}s", file=sys.stderr)
    # api_key: the bench's own mesh has no auth; a key from the environment is simply ignored there
    client = cleanup.enter_context(MeshClient(running.address, api_key=api_key))
    state = OwnMeshState(running.config.serve.redis_url, embedded_redis=embedded_redis)
    runners = make_mesh_runners(methods, client, resetter=state.reset)
    cfg = running.config
    info = {
        "address": running.address,
        "http_address": running.http_address,
        "started_by_bench": True,
        "started_s": round(running.started_s, 3),
        "memory": None,
        "mesh_state_reset": True,
        "config": {"model": cfg.engine.model, "threads": cfg.engine.threads, "max_nodes": cfg.builder.max_nodes,
                   "verifier_replicas": cfg.serve.verifier_replicas, "session_cache_size": cfg.serve.session_cache_size,
                   "stream_interval": cfg.serve.stream_interval},
    }
    return runners, info, mesh_process_memory
