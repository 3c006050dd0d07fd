"""Start and stop the whole mesh: the gateway (the public port, answering "starting"), Redis, the
fact-check workers, Ray, Serve's gRPC proxy (loopback only), the app.

The gateway is the one public gRPC port, TLS or not: Serve's proxy listens on a free loopback port
behind it (``loopback`` keeps it there, and start-up checks that it did). Stopping drains the
gateway first (``serve.drain_s``), so the rest stops with no request in flight.

``draftmesh serve`` and the service tests both go through ``start_mesh`` so that what the
tests exercise is what users run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import psutil

from draftmesh import grpc_fork
from draftmesh.config import DraftmeshConfig
from draftmesh.fatal_signals import FatalSignalHandlers
from draftmesh.factcheck.processes import WorkerProcesses
from draftmesh.net import free_port
from draftmesh.redis_server import EmbeddedRedis
from draftmesh.serve_health import wait_served
from draftmesh.router.app import APP_NAME, GRPC_SERVICER_FUNCTIONS, build_app
from draftmesh.router.auth import ApiKeyAuth
from draftmesh.router.loopback import HOOK, exposed_on
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
    upstream_address: str = ""
    """Serve's own gRPC proxy (loopback only, behind the gateway)."""
    gateway: Any = None
    """The front door's GatewayThread (the public gRPC port)."""
    _cleanup: list[Callable[[], Any]] = field(default_factory=list, repr=False)

    def stop(self, drain_s: float = 0.0) -> None:
        """Drain the gateway (calls in flight get ``drain_s`` seconds, then are cancelled, which
        cancels them in the verifier), then tear down the rest in reverse order; each part is
        stopped even if another fails."""
        if self.gateway is not None:
            try:
                self.gateway.stop(drain_s, timeout=drain_s + 10)
            except Exception:
                log.exception("error while stopping the gateway")
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
        serve_cfg = cfg.serve
        cert = key = None
        if serve_cfg.tls_cert is not None:
            cert, key = load_tls_files(serve_cfg.tls_cert, serve_cfg.tls_key)
        # First, so that the public port answers "starting" (ours), never Ray's NOT_FOUND, and a
        # port in use fails before Ray is started. Its upstream, Serve's proxy, is named once Ray is up.
        gateway = running.gateway = TlsGateway(
            None, serve_cfg.grpc_port, cert, key,
            auth=ApiKeyAuth.from_config(serve_cfg), application=APP_NAME, ready=False,
            max_concurrent_rpcs=serve_cfg.max_streams, max_message_bytes=cfg.limits.max_body_bytes,
        ).run_in_thread()
        running._cleanup.append(gateway.stop)
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

        private = not ray.is_initialized() and serve_cfg.address is None
        if not ray.is_initialized():
            options = dict(ray_init or {})
            # Every worker (the Serve proxy, the replicas) binds its gRPC servers on loopback.
            runtime_env = dict(options.get("runtime_env") or {})
            runtime_env.setdefault("worker_process_setup_hook", HOOK)
            options["runtime_env"] = runtime_env
            if serve_cfg.address is None:
                # A private single-machine cluster: no token auth to configure, no dashboard;
                # its metrics agent serves every replica's metrics on one port.
                os.environ.setdefault("RAY_AUTH_MODE", "disabled")
                options.setdefault("_metrics_export_port", serve_cfg.metrics_port or free_port())
                running.metrics_address = f"localhost:{options['_metrics_export_port']}"
            handlers = _init_ray(serve_cfg.address or "local", options)
            running._cleanup.append(lambda: _shutdown_ray(handlers))

        # Picked only now: a port picked before ray.init was seen taken by one of Ray's own processes
        # by the time Serve's proxy bound it ("Address already in use"), failing the start.
        proxy_port = free_port()
        gateway.connect(f"127.0.0.1:{proxy_port}")
        # The HTTP face off: Serve's HTTP proxy still runs (it is the gRPC proxy's process) on loopback only.
        http_on = serve_cfg.http_port != 0
        http_options = {"host": "0.0.0.0", "port": serve_cfg.http_port} if http_on else {"host": "127.0.0.1", "port": free_port()}
        serve.start(
            grpc_options=gRPCOptions(port=proxy_port, grpc_servicer_functions=GRPC_SERVICER_FUNCTIONS),
            http_options=http_options,
            logging_config={"log_level": serve_cfg.log_level},
        )
        if serve_cfg.address is None:
            # Our private cluster: all of Serve goes (with our app). In this thread, never one we stop
            # waiting for: ray.shutdown (next) would tear the driver's core worker down under a Serve
            # call still in flight. Serve bounds its own wait: 5 s to find its controller alive, then
            # 30 s for the controller's graceful shutdown (the replicas' graceful timeouts within it).
            running._cleanup.append(serve.shutdown)
        else:  # on an existing cluster only our app goes; Serve and other apps stay up
            running._cleanup.append(lambda: serve.delete(APP_NAME))
        serve.run(build_app(cfg), name=APP_NAME, route_prefix="/", blocking=False,
                  logging_config={"log_level": serve_cfg.log_level})
        running.upstream_address = f"127.0.0.1:{proxy_port}"
        check_upstream_private(proxy_port, strict=private)
        # Ready means Serve's proxy routes our app: it learns its routes by a long poll of its own,
        # after serve.run has returned. One that does not in time is logged; the calls then tell.
        served = wait_served(running.upstream_address, APP_NAME, ROUTED_WAIT_S)
        if not served.healthy:
            log.warning("Serve's proxy does not route %s yet after %.0fs (%s); serving anyway", APP_NAME,
                        ROUTED_WAIT_S, served.message)
        if workers is not None:
            workers.wait_ready()
        gateway.set_ready()
        running.address = f"localhost:{gateway.port}"
        running.http_address = f"localhost:{serve_cfg.http_port}" if http_on else ""
        running.started_s = time.perf_counter() - t0
        return running
    except BaseException:
        running.stop()
        raise


ROUTED_WAIT_S = 30.0
"""How long a start waits for Serve's proxy to route the app after ``serve.run`` returned."""

def _shutdown_ray(handlers: FatalSignalHandlers) -> None:
    """``ray.shutdown``, then the fatal signals' handlers as they were before ``ray.init``: Ray's
    shutdown resets them to the default, which would make any later native crash silent."""
    import ray

    try:
        ray.shutdown()
    finally:
        handlers.restore()


def _child_pids() -> set[int]:
    return {p.pid for p in psutil.Process().children()}


def _kill_children_since(before: set[int], grace_s: float = 5.0) -> None:
    """Stop this process's children not in ``before``, with all their descendants: SIGTERM, then
    SIGKILL after ``grace_s``. Children from before (Redis, fact-check workers) are left alone."""
    procs = []
    for child in psutil.Process().children():
        if child.pid not in before:
            with contextlib.suppress(psutil.Error):
                procs += [child, *child.children(recursive=True)]
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(alive, timeout=grace_s)
    if procs:
        log.warning("stopped %d process(es) of the half-started Ray node", len(procs))


class UpstreamExposed(RuntimeError):
    """Serve's plaintext gRPC proxy answers on a non-loopback address: the gateway could be bypassed."""


def check_upstream_private(port: int, *, strict: bool = True) -> None:
    """Refuse to serve (``strict``: our private cluster, where ``loopback`` should have held) or
    log an error (an existing cluster whose Serve someone else started) when Serve's gRPC proxy is
    reachable on one of this machine's non-loopback addresses."""
    exposed = exposed_on(port)
    if not exposed:
        return
    message = (f"Serve's plaintext gRPC proxy (port {port}) is reachable on {', '.join(exposed)}: clients could "
               "bypass the gateway (TLS, keys, caps). The loopback patch did not apply (a Ray version other than "
               "the tested 2.60, or a Serve started elsewhere); firewall that port")
    if strict:
        raise UpstreamExposed(message)
    log.error(message)


STARTUP_TIMEOUTS = ("Timed out waiting for file", "timed out during startup")
GCS_PORT_WAIT_S = "90"
"""How long a local head waits for its GCS to publish its port (Ray's default: 30 s), unless the
environment sets ``RAY_gcs_server_port_wait_time_s``. Raised when 30 s was missed on a loaded 2-core
machine; the misses measured later were a GCS child killed at fork (``draftmesh.grpc_fork``)."""


def _init_ray(address: str, options: dict[str, Any], attempts: int = 2) -> FatalSignalHandlers:
    """``ray.init``, tried once more when a local node does not come up in time; returns the fatal
    signals' handlers from before it, for ``_shutdown_ray`` to put back.

    A fresh local node can miss one of Ray's startup deadlines: the GCS never publishes its port
    ("Timed out waiting for file .../gcs_server_port_...") or the raylet never registers within
    Ray's fixed 30 s ("The current node timed out during startup"). The cause measured was a child
    killed between fork and exec by gRPC's fork handlers, off since (``draftmesh.grpc_fork``); the
    retry stays for a machine too starved to start one in time. A failed ``ray.init`` leaves the
    half-started node's processes running (its ``Node`` is never returned, so ``ray.shutdown``
    cannot stop them): they are killed here before the retry, or they would starve it, and before
    the error is raised. Other errors are raised at once."""
    import ray

    if address == "local":
        os.environ.setdefault("RAY_gcs_server_port_wait_time_s", GCS_PORT_WAIT_S)
        if not grpc_fork.handlers_off():
            log.warning("gRPC's fork handlers are on in this process (grpc was imported before draftmesh, "
                        "or %s says so): a local Ray node's processes can die as they start; "
                        "set %s=0 before the program starts", grpc_fork.ENV, grpc_fork.ENV)
    handlers = FatalSignalHandlers.save()  # Ray's next start chains to them, not to the default
    for attempt in range(1, attempts + 1):
        before = _child_pids()
        try:
            ray.init(address=address, include_dashboard=False, log_to_driver=True, **options)
            return handlers
        except Exception as exc:  # Ray raises a bare Exception for the raylet's timeout
            startup = address == "local" and any(s in str(exc) for s in STARTUP_TIMEOUTS)
            if startup:
                _kill_children_since(before)
            if attempt == attempts or not startup:
                raise
            log.warning("Ray did not start (%s); retrying once", exc)
            _shutdown_ray(handlers)
