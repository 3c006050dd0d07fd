"""The router: the Ray Serve ingress behind Serve's gRPC proxy (service draftmesh.v1.Generation)
and its HTTP proxy (the OpenAI-compatible API, ``http_face``): one deployment, one code path.

Per request, whichever face it came in by, it authenticates (which names the caller's tenant),
validates every field, admits or refuses (a bounded number in flight, never an unbounded queue,
and the tenant's quotas, ``admission``), scopes the request's ids by tenant (``tenancy``), then
makes ONE streaming call to the verifier pool and relays its steps. A client that cancels or
runs out of deadline cancels that call, and the verifier stops before its next step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
from contextlib import contextmanager
from typing import Any, AsyncIterator, Iterable, Iterator

import grpc
from ray import serve
from ray.serve.grpc_util import RayServegRPCContext

from draftmesh import tracing
from draftmesh.auth import Unauthenticated
from draftmesh.config import DraftmeshConfig
from draftmesh.draft import registry
from draftmesh.factcheck.client import FactCheckBusy, FactCheckClient, FactCheckNotFound, FactCheckUnavailable
from draftmesh.factcheck.protocol import annotation_id_for_text
from draftmesh.io_struct import Rejected, ServedResult, ServeRequest, StepEvent
from draftmesh.metrics import RayMetrics
from draftmesh.router.admission import QuotaExceeded, TenantAdmission
from draftmesh.router.auth import ApiKeyAuth
from draftmesh.router.errors import RpcError, internal_error
from draftmesh.router.http_face import HttpFace, http_app
from draftmesh.router.responses import report_to_proto, result_to_proto, step_to_proto
from draftmesh.router.telemetry import RouterMetrics, RpcCall
from draftmesh.router.validation import InvalidRequest, parse_factcheck, parse_request
from draftmesh.tenancy import Tenants, scoped_request
from draftmesh.v1 import generation_pb2 as pb
from draftmesh.verify.policy import available_policies

log = logging.getLogger(__name__)


def mesh_source_names(cfg: DraftmeshConfig) -> list[str]:
    """The draft sources a request may name: the verifier's own and the remote ones."""
    local = list(registry.DEFAULT_SOURCES if cfg.sources.names is None else cfg.sources.names)
    return local + list(cfg.sources.remote)


# A short graceful timeout, like the verifier's: by Serve's shutdown the gateway has drained every call,
# and the mesh's stop lets Serve's shutdown finish before Ray's (launcher).
@serve.deployment(name="router", health_check_period_s=10, graceful_shutdown_timeout_s=5)
@serve.ingress(http_app)
class Router(HttpFace):
    def __init__(self, config: dict, verifier) -> None:
        tracing.setup_tracing("router")
        self._started = int(time.time())
        cfg = DraftmeshConfig.from_dict(config)
        self.cfg = cfg
        self.verifier = verifier
        self.limits = cfg.limits
        self.auth = ApiKeyAuth.from_config(cfg.serve)
        self.tenants = Tenants(cfg.serve, self.auth.tenants)
        self.admission = TenantAdmission(self.tenants)
        self.sources = mesh_source_names(cfg)
        self.policies = available_policies()
        self.in_flight = 0
        self.metrics = RouterMetrics(RayMetrics())
        self.factcheck_client: FactCheckClient | None = None
        self._lag_watch: asyncio.Task | None = None
        if cfg.factcheck.enabled:
            self.factcheck_client = FactCheckClient(cfg.serve.redis_url, cfg.factcheck_config())

    # ------------------------------------------------------------------ RPCs
    async def Generate(self, request: pb.GenerateRequest, grpc_context: RayServegRPCContext) -> AsyncIterator[pb.GenerateResponse]:
        with self._call("Generate", grpc_context) as call, _status_on(grpc_context):
            req = self._admit(request, grpc_context.invocation_metadata(), call)
            try:
                step = 0
                async for event in self._events(req):
                    if isinstance(event, StepEvent):
                        step += event.steps
                        call.step()
                        yield step_to_proto(step, event)
                    else:
                        call.result(event)
                        yield pb.GenerateResponse(result=result_to_proto(event, req.request_id))
            finally:
                self._release(call)

    async def Complete(self, request: pb.GenerateRequest, grpc_context: RayServegRPCContext) -> pb.GenerateResult:
        with self._call("Complete", grpc_context) as call, _status_on(grpc_context):
            req = self._admit(request, grpc_context.invocation_metadata(), call)
            try:
                return result_to_proto(await self._result(req, call), req.request_id)
            finally:
                self._release(call)

    async def FactCheck(self, request: pb.FactCheckRequest, grpc_context: RayServegRPCContext) -> pb.FactCheckReport:
        """Check a text now (through the workers), or fetch an earlier output's annotations by id."""
        # The span is current here (no yield crosses it); its status comes from the code, not the exception.
        with (self._call("FactCheck", grpc_context) as call, _status_on(grpc_context),
              tracing.use_span(call.span, record_exception=False, set_status_on_exception=False)):
            return await self._factcheck(request, grpc_context.invocation_metadata())

    async def _factcheck(self, request: pb.FactCheckRequest, metadata: Iterable[tuple[str, Any]]) -> pb.FactCheckReport:
        self._authenticate(metadata)
        if self.factcheck_client is None:
            raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, "the fact-check service is off in this mesh")
        try:
            text, annotation_id, wait_ms = parse_factcheck(request, self.limits)
        except InvalidRequest as exc:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, str(exc), exc.field)
        wait_s = (self.cfg.factcheck.wait_ms if wait_ms is None else wait_ms) / 1000
        try:
            if text:
                annotation_id = annotation_id_for_text("query", text)
                annotation = await asyncio.to_thread(self.factcheck_client.check_text, text, wait_s)  # context copied
            else:
                annotation = await asyncio.to_thread(self._fetch, annotation_id, wait_s)
        except FactCheckNotFound as exc:
            raise RpcError(grpc.StatusCode.NOT_FOUND, str(exc))
        except FactCheckBusy as exc:
            raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"fact-check service busy: {exc}; retry later")
        except FactCheckUnavailable as exc:
            raise RpcError(grpc.StatusCode.UNAVAILABLE, f"fact-check service unavailable: {exc}")
        if annotation is None:
            return pb.FactCheckReport(status="pending", annotation_id=annotation_id,
                                      error="no annotation yet: still queued, unknown or expired")
        return report_to_proto(annotation.report())

    def _fetch(self, annotation_id: str, wait_s: float):
        found = self.factcheck_client.fetch(annotation_id, wait_s)  # reads the key first; 0 s: only that
        if found is None and not self.factcheck_client.available:
            raise FactCheckUnavailable("Redis unreachable")
        return found

    # ------------------------------------------------------------------ steps of a request (both faces)
    def _authenticate(self, metadata: Iterable[tuple[str, Any]] | None) -> str:
        """The caller's tenant. ``metadata``: gRPC invocation metadata or HTTP headers, (name, value) pairs."""
        try:
            return self.auth.identify(metadata)
        except Unauthenticated as exc:
            raise RpcError(grpc.StatusCode.UNAUTHENTICATED, str(exc)) from None

    def _call(self, method: str, ctx: RayServegRPCContext) -> RpcCall:
        self._start_lag_watch()
        return RpcCall(method, ctx.invocation_metadata(), self.metrics)

    def _start_lag_watch(self) -> None:
        if self.factcheck_client is not None and self._lag_watch is None:
            self._lag_watch = asyncio.get_running_loop().create_task(self._watch_factcheck_lag())

    def _admit(self, request: pb.GenerateRequest, metadata: Iterable[tuple[str, Any]] | None, call: RpcCall,
               request_id: str | None = None, tenant: str | None = None) -> ServeRequest:
        """Authenticate (unless ``tenant`` says who it is), validate, admit: the ServeRequest to run (call
        ``_release`` when it ends). ``request_id``: the server's id for it (the HTTP face's x-request-id), used
        when the request has none. Its ids are still the client's; ``_events`` scopes them."""
        if tenant is None:
            tenant = self._authenticate(metadata)
        try:
            req = parse_request(request, self.limits, sources=self.sources, policies=self.policies, request_id=request_id)
        except InvalidRequest as exc:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, str(exc), exc.field)
        if self.in_flight >= self.cfg.serve.max_in_flight:
            raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"server busy: {self.in_flight} requests in flight (limit {self.cfg.serve.max_in_flight}); retry later")
        try:
            call.ticket = self.admission.admit(tenant, req.max_new_tokens)
        except QuotaExceeded as exc:
            self.metrics.tenant_rejections.inc(1, {"tenant": tenant, "quota": exc.key.rsplit(".", 1)[-1]})
            raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)) from None
        call.tenant = tenant
        self.in_flight += 1
        self.metrics.in_flight.set(self.in_flight)
        self.metrics.tenant_requests.inc(1, {"tenant": tenant})
        call.admitted(req.request_id, req.speculation.policy)
        req = dataclasses.replace(req, tenant=tenant, reads_answers_of=self.tenants[tenant].reads_answers_of)
        return req.with_trace_context(call.carrier())

    def _release(self, call: RpcCall) -> None:
        self.in_flight -= 1
        self.metrics.in_flight.set(self.in_flight)
        if call.ticket is not None:
            self.admission.release(call.ticket, call.generated)

    async def _watch_factcheck_lag(self, period_s: float = 5.0) -> None:
        """Keep the fact-check lag gauge fresh (the producers read it anyway, cached)."""
        while True:
            try:
                self.metrics.factcheck_lag.set(await asyncio.to_thread(self.factcheck_client.lag, refresh=True))
            except Exception as exc:  # Redis down: the gauge keeps its last value
                log.debug("fact-check lag unavailable: %r", exc)
            await asyncio.sleep(period_s)

    async def _result(self, req: ServeRequest, call: RpcCall) -> ServedResult:
        """Run an admitted request to its end."""
        async for event in self._events(req):
            if isinstance(event, ServedResult):
                call.result(event)
                return event
            call.step()
        raise RpcError(grpc.StatusCode.INTERNAL, "the verifier ended without a result")

    async def _events(self, req: ServeRequest):
        """The verifier's events (ONE streaming call); a replica lost before its first event is retried once."""
        client_id = req.request_id  # what the client knows its request by (errors name it)
        req = scoped_request(req)  # the one place ids enter the tenant's namespace
        for attempt in (1, 2):
            handle = self.verifier.options(stream=True, multiplexed_model_id=req.session_id or "")
            stream = handle.generate.remote(req)
            started = ended = False
            try:
                async for event in stream:
                    if isinstance(event, Rejected):
                        if event.reason == "busy":  # the replica's KV budget or queue
                            raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, event.message)
                        raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, event.message, _rejected_field(event.message))
                    started = True
                    yield event
                ended = True
                return
            except (RpcError, asyncio.CancelledError, GeneratorExit):
                raise
            except Exception as exc:  # a replica died or failed: say so, never hang
                if not started and attempt == 1 and _is_replica_loss(exc):
                    log.warning("verifier replica lost before request %s started; retrying: %r", req.request_id, exc)
                    continue
                raise internal_error(exc, client_id,
                                     grpc.StatusCode.UNAVAILABLE if _is_replica_loss(exc) else grpc.StatusCode.INTERNAL)
            finally:
                if not ended:  # a stream run to its end has nothing to stop: no ray.cancel round trip
                    stream.cancel()


@contextmanager
def _status_on(ctx: RayServegRPCContext) -> Iterator[None]:
    """The gRPC face: an RpcError's code and details go on the call (Serve's proxy sends them); any
    other exception becomes a generic INTERNAL with a request id (Serve's proxy would send its text)."""
    try:
        yield
    except RpcError as exc:
        ctx.set_code(exc.code)
        ctx.set_details(exc.details)
        raise
    except Exception as exc:
        error = internal_error(exc)
        ctx.set_code(error.code)
        ctx.set_details(error.details)
        raise error from None


_REJECTED_FIELDS = re.compile(r"\b(max_new_tokens|prompt|stop|speculation\.\w+|documents)\b")


def _rejected_field(message: str) -> str | None:
    """The request field a verifier's refusal is about, when its message names one (context: the prompt
    plus max_new_tokens; an unknown source)."""
    if "draft source" in message:
        return "speculation.sources"
    found = _REJECTED_FIELDS.findall(message)
    return "max_new_tokens" if "max_new_tokens" in found else (found[0] if found else None)


def _is_replica_loss(exc: BaseException) -> bool:
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    return isinstance(exc, (RayActorError, ActorDiedError, ActorUnavailableError)) or "ActorDied" in type(exc).__name__
