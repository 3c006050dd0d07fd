"""Start and stop the whole mesh: Redis, the fact-check workers, Ray, Serve's gRPC proxy, the app,
the TLS gateway.

``draftmesh serve`` and the service tests both go through ``start_mesh`` so that what the
tests exercise is what users run.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from draftmesh.config import DraftmeshConfig
from draftmesh.factcheck.processes import WorkerProcesses
from draftmesh.net import free_port
from draftmesh.redis_server import EmbeddedRedis
from draftmesh.router.app import APP_NAME, GRPC_SERVICER_FUNCTIONS, build_app
from draftmesh.router.tls_gateway import TlsGateway, load_tls_files

log = logging.getLogger(__name__)


@dataclass
class RunningMesh:
    config: DraftmeshConfig
    address: str
    """Where gRPC clients connect (host:port)."""
    started_s: float
    """Seconds from start_mesh() to the app answering."""
    redis: Any = None
    """The embedded redis-server this mesh started, if it started one."""
    factcheck_workers: Any = None
    """The fact-check worker processes this mesh started, if any."""
    http_address: str = ""
    """Where HTTP clients (the OpenAI-compatible API) connect (host:port); empty when serve.http_port is 0."""
    metrics_address: str = ""
    """Where Prometheus scrapes this node's metrics (host:port, path /metrics), if known."""
    _cleanup: list[Callable[[], Any]] = field(default_factory=list, repr=False)

    def stop(self) -> None:
        """Tear down in reverse order; each part is stopped even if another fails."""
        while self._cleanup:
            step = self._cleanup.pop()
            try:
                step()
            except Exception:
                log.exception("error while stopping the mesh")


def start_mesh(cfg: DraftmeshConfig, *, ray_init: dict[str, Any] | None = None) -> RunningMesh:
    """Start everything ``cfg`` asks for; its ``serve.redis_url`` (None: an embedded redis-server)
    is taken as given (``load_config`` has already read REDIS_URL)."""
    import ray  # lazy: Ray (seconds to import) only once a mesh is really started
    from ray import serve
    from ray.serve.config import gRPCOptions

    t0 = time.perf_counter()
    running = RunningMesh(cfg, address="", started_s=0.0)
    try:
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        redis_url = cfg.serve.redis_url
        if not redis_url:
            redis = running.redis = EmbeddedRedis(maxmemory_bytes=cfg.serve.redis_maxmemory_bytes).start()
            running._cleanup.append(redis.stop)
            redis_url = redis.url
            log.info("embedded redis-server at %s", redis_url)
            if cfg.serve.address is not None:
                log.warning("the embedded redis-server listens on this machine's loopback only; replicas on "
                            "other nodes of %s cannot reach it: set REDIS_URL for a multi-node cluster",
                            cfg.serve.address)
        cfg = cfg.replace(serve={"redis_url": redis_url})
        running.config = cfg
        serve_cfg = cfg.serve
        workers = None
        if cfg.factcheck.enabled and cfg.factcheck.workers:
            # Started first: they load their checks while Ray and the models come up.
            workers = running.factcheck_workers = WorkerProcesses(
                cfg.factcheck_config(), cfg.factcheck.workers, cfg.factcheck.python
            ).start()
            running._cleanup.append(workers.stop)

        if not ray.is_initialized():
            options = dict(ray_init or {})
            if serve_cfg.address is None:
                # A private single-machine cluster: no token auth to configure, no dashboard;
                # its metrics agent serves every replica's metrics on one port.
                os.environ.setdefault("RAY_AUTH_MODE", "disabled")
                options.setdefault("_metrics_export_port", serve_cfg.metrics_port or free_port())
                running.metrics_address = f"localhost:{options['_metrics_export_port']}"
            _init_ray(serve_cfg.address or "local", options)
            running._cleanup.append(ray.shutdown)

        tls = serve_cfg.tls_cert is not None
        proxy_port = free_port() if tls else serve_cfg.grpc_port
        # The HTTP face off: Serve's HTTP proxy still runs (it is the gRPC proxy's process) on loopback only.
        http_on = serve_cfg.http_port != 0
        http_options = {"host": "0.0.0.0", "port": serve_cfg.http_port} if http_on else {"host": "127.0.0.1", "port": free_port()}
        serve.start(
            grpc_options=gRPCOptions(port=proxy_port, grpc_servicer_functions=GRPC_SERVICER_FUNCTIONS),
            http_options=http_options,
            logging_config={"log_level": serve_cfg.log_level},
        )
        if serve_cfg.address is None:
            running._cleanup.append(serve.shutdown)  # our private cluster: all of Serve goes
        # On an existing cluster only our app goes; Serve and other apps stay up.
        serve.run(build_app(cfg), name=APP_NAME, route_prefix="/", blocking=False,
                  logging_config={"log_level": serve_cfg.log_level})
        running._cleanup.append(lambda: serve.delete(APP_NAME))
        address = f"localhost:{proxy_port}"
        if tls:
            cert, key = load_tls_files(serve_cfg.tls_cert, serve_cfg.tls_key)
            gateway = TlsGateway(f"127.0.0.1:{proxy_port}", serve_cfg.grpc_port, cert, key).run_in_thread()
            running._cleanup.append(gateway.stop)
            address = f"localhost:{serve_cfg.grpc_port}"
        if workers is not None:
            workers.wait_ready()
        running.address = address
        running.http_address = f"localhost:{serve_cfg.http_port}" if http_on else ""
        running.started_s = time.perf_counter() - t0
        return running
    except BaseException:
        running.stop()
        raise


STARTUP_TIMEOUTS = ("Timed out waiting for file", "timed out during startup")


def _init_ray(address: str, options: dict[str, Any], attempts: int = 2) -> None:
    """``ray.init``, tried once more when a local node does not come up in time.

    On a loaded 2-core machine a fresh local node sometimes misses one of Ray's 30 s startup
    deadlines: the GCS never publishes its port ("Timed out waiting for file
    .../gcs_server_port_...") or the raylet never registers ("The current node timed out during
    startup", once after Ray's dashboard process aborted). Seen in CI and locally, rarely; cause
    not found. The half-started node is shut down and a fresh one started; other errors are raised."""
    import ray

    for attempt in range(1, attempts + 1):
        try:
            ray.init(address=address, include_dashboard=False, log_to_driver=True, **options)
            return
        except Exception as exc:  # Ray raises a bare Exception for the raylet's timeout
            if attempt == attempts or address != "local" or not any(s in str(exc) for s in STARTUP_TIMEOUTS):
                raise
            log.warning("Ray did not start (%s); retrying once", exc)
            ray.shutdown()
