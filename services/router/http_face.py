"""The router's HTTP face: the OpenAI-compatible API, served by the same Serve deployment as the gRPC
face (``Router`` is a FastAPI ingress too), through the same steps: authenticate (the same bearer
keys), validate (``parse_request`` on the request ``openai_api`` builds), admit (the same in-flight
bound), ONE streaming call to the verifier pool.

- ``POST /v1/chat/completions``, ``POST /v1/completions``: ``stream: true`` answers server-sent
  events, one chunk per decode step, ending in ``data: [DONE]``; a client that goes away cancels the
  verifier's work before its next step.
- ``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health`` (no key needed: probes).
- Errors are OpenAI's JSON: ``{"error": {"message", "type", "param", "code"}}``.
- A deadline: ``X-Request-Timeout: <seconds>``, the HTTP twin of a gRPC deadline (HTTP has none of its
  own, and a client's read timeout only closes its socket): when it expires the verifier's work is
  cancelled and the answer is 504 (after a stream's 200: the error as its last event).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import time
from typing import Any, AsyncIterator

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from draftmesh.io_struct import InvalidField, ServedResult, ServeRequest, StepEvent
from draftmesh.router import openai_api as oa
from draftmesh.router.errors import RpcError, http_status, internal_error
from draftmesh.router.telemetry import HttpCall

# The router makes the server span and the metrics of each request itself, for both faces alike
# (HttpCall); FastAPI's own OpenTelemetry spans (FastAPI >= 0.16x) would be a second server span.
_NO_TELEMETRY = {"telemetry": {"tracing": False, "metrics": False, "logs": False, "operation_spans": False}}
http_app = FastAPI(title="draftmesh", docs_url=None, redoc_url=None, openapi_url=None,
                   **(_NO_TELEMETRY if "telemetry" in inspect.signature(FastAPI).parameters else {}))

CHAT_ROUTE = "/v1/chat/completions"
COMPLETIONS_ROUTE = "/v1/completions"
REQUEST_ID_HEADER = "x-request-id"
TIMEOUT_HEADER = "X-Request-Timeout"
MAX_REQUEST_TIMEOUT_S = 3600.0


def request_deadline(headers, now: float) -> float | None:
    """The monotonic time by which the request must be answered (``X-Request-Timeout``, seconds), or None."""
    raw = headers.get(TIMEOUT_HEADER.lower())
    if raw is None:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds <= MAX_REQUEST_TIMEOUT_S:  # (NaN fails this too)
        raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                       f"{TIMEOUT_HEADER}: must be a number of seconds in (0, {MAX_REQUEST_TIMEOUT_S:g}], got {raw!r}",
                       TIMEOUT_HEADER)
    return now + seconds


async def within(awaitable, deadline: float | None):
    """``await awaitable``, cancelled at ``deadline`` (the verifier call with it) and raised as DEADLINE_EXCEEDED."""
    if deadline is None:
        return await awaitable
    try:
        return await asyncio.wait_for(awaitable, max(0.0, deadline - time.monotonic()))
    except asyncio.TimeoutError:
        raise RpcError(grpc.StatusCode.DEADLINE_EXCEEDED,
                       f"deadline exceeded: the request's {TIMEOUT_HEADER} expired before it was answered") from None


class HttpError(Exception):
    """An HTTP answer that is not one of the router's gRPC codes (404 model, 413 body)."""

    def __init__(self, status: int, message: str, type_: str, param: str | None = None, code: str | None = None):
        super().__init__(status, message, type_, param, code)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def error_response(status: int, message: str, type_: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = oa.ErrorBody(error=oa.ErrorInfo(message=message, type=type_, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def _rpc_error_response(exc: RpcError, face: oa.Face | None) -> tuple[int, JSONResponse]:
    status, type_, code = http_status(exc.code)
    param, message = exc.param, exc.details
    if face is not None:
        param, message = face.rename(param, message)
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return status, error_response(status, message, type_, param, code, headers)


@http_app.exception_handler(StarletteHTTPException)
async def _http_exception(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Unknown routes and methods answer OpenAI-style JSON too."""
    return error_response(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                          "invalid_request_error", None, "not_found" if exc.status_code == 404 else None)


def _sse(payload: Any) -> bytes:
    data = payload.model_dump_json() if hasattr(payload, "model_dump_json") else json.dumps(payload)
    return f"data: {data}\n\n".encode()


DONE = b"data: [DONE]\n\n"


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The body, refused (413) beyond ``max_bytes`` without reading it all."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise HttpError(413, f"body: {int(length)} bytes exceeds the limit of {max_bytes}", "invalid_request_error",
                        "body", "request_too_large")
    chunks, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > max_bytes:
            raise HttpError(413, f"body: more than {max_bytes} bytes", "invalid_request_error", "body", "request_too_large")
        chunks.append(part)
    return b"".join(chunks)


class HttpFace:
    """The routes, mixed into ``Router`` (which provides ``_authenticate``, ``_admit``, ``_events``,
    ``_result``, ``_release`` and ``metrics``)."""

    @http_app.get("/health")
    async def http_health(self) -> dict:
        return {"status": "ok", "model": self.cfg.engine.model, "in_flight": self.in_flight}

    @http_app.get("/v1/models")
    async def http_models(self, request: Request) -> Response:
        return self._http_simple(request, "/v1/models", lambda: oa.ModelList(data=self._model_cards()))

    @http_app.get("/v1/models/{model_id:path}")
    async def http_model(self, model_id: str, request: Request) -> Response:
        def card():
            self._check_model(model_id)
            return self._model_cards()[0]
        return self._http_simple(request, "/v1/models/{model}", card)

    @http_app.post(CHAT_ROUTE)
    async def http_chat_completions(self, request: Request) -> Response:
        return await self._http_generate(request, "chat", CHAT_ROUTE, oa.ChatCompletionRequest)

    @http_app.post(COMPLETIONS_ROUTE)
    async def http_completions(self, request: Request) -> Response:
        return await self._http_generate(request, "completions", COMPLETIONS_ROUTE, oa.CompletionRequest)

    # ------------------------------------------------------------------ the steps
    def _model_cards(self) -> list[oa.ModelCard]:
        return [oa.ModelCard(id=self.cfg.engine.model, created=self._started)]

    def _check_model(self, model: str) -> None:
        if model != self.cfg.engine.model:
            raise HttpError(404, f"model: the model {model!r} does not exist; this server serves {self.cfg.engine.model!r}",
                            "invalid_request_error", "model", "model_not_found")

    def _http_simple(self, request: Request, route: str, build) -> Response:
        call = HttpCall(route, list(request.headers.items()), self.metrics, "GET")
        try:
            self._authenticate(request.headers.items())
            return JSONResponse(build().model_dump())
        except RpcError as exc:
            call.fail(exc)
            call.status, response = _rpc_error_response(exc, None)
            return response
        except HttpError as exc:
            call.status = exc.status
            return error_response(exc.status, exc.message, exc.type, exc.param, exc.code)
        except Exception as exc:  # a bug: a generic 500 with an id, the details in the log
            error = internal_error(exc, request.headers.get(REQUEST_ID_HEADER))
            call.fail(error)
            call.status, response = _rpc_error_response(error, None)
            return response
        finally:
            call.end()

    async def _http_generate(self, request: Request, endpoint: str, route: str, model: type) -> Response:
        headers = list(request.headers.items())
        call = HttpCall(route, headers, self.metrics)
        face: oa.Face | None = None
        admitted = streaming = False
        try:
            self._start_lag_watch()
            tenant = self._authenticate(headers)
            deadline = request_deadline(request.headers, time.monotonic())
            raw = await read_body(request, self.limits.max_body_bytes)
            try:
                body = oa.parse_body(raw, model)
                self._check_model(body.model)
                face = oa.to_face(endpoint, body)
            except InvalidField as exc:
                raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, str(exc), exc.field) from None
            req = self._admit(face.request, headers, call, request_id=request.headers.get(REQUEST_ID_HEADER),
                              tenant=tenant)
            admitted = True
            created = int(time.time())
            reply_headers: dict[str, str] = {}  # (Serve's proxy answers x-request-id itself)
            if not face.stream:
                served = await within(self._result(req, call), deadline)
                answer = oa.completion(endpoint, served, req.request_id, body.model, created)
                return JSONResponse(answer.model_dump(), headers=reply_headers)
            events = self._events(req)
            first = await within(anext(events), deadline)  # a refusal before the first step is still an HTTP error
            streaming = True
            return StreamingResponse(self._http_stream(face, req, call, created, first, events, deadline),
                                     media_type="text/event-stream",
                                     headers={**reply_headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        except RpcError as exc:
            call.fail(exc)
            call.status, response = _rpc_error_response(exc, face)
            return response
        except HttpError as exc:
            call.status = exc.status
            return error_response(exc.status, exc.message, exc.type, exc.param, exc.code)
        except Exception as exc:  # a bug: a generic 500 with an id, the details in the log
            error = internal_error(exc, req.request_id if admitted else request.headers.get(REQUEST_ID_HEADER))
            call.fail(error)
            call.status, response = _rpc_error_response(error, face)
            return response
        except BaseException as exc:  # cancelled
            call.fail(exc)
            raise
        finally:
            if not streaming:  # else the stream owns the admission and the call
                if admitted:
                    self._release(call)
                call.end()

    async def _http_stream(self, face: oa.Face, req: ServeRequest, call: HttpCall, created: int, first,
                           events: AsyncIterator, deadline: float | None = None) -> AsyncIterator[bytes]:
        endpoint, model = face.endpoint, face.body.model
        rid = req.request_id
        try:
            if endpoint == "chat":
                yield _sse(oa.chunk(endpoint, rid, model, created, role=True, text=""))
            event = first
            while True:
                if isinstance(event, StepEvent):
                    call.step()
                    if event.text:
                        yield _sse(oa.chunk(endpoint, rid, model, created, text=event.text))
                elif isinstance(event, ServedResult):
                    call.result(event)
                    yield _sse(oa.chunk(endpoint, rid, model, created, finish=event.result.finish_reason, served=event))
                    if face.include_usage:
                        yield _sse(oa.chunk(endpoint, rid, model, created, served=event, with_usage=True))
                    yield DONE
                    return
                try:
                    event = await within(anext(events), deadline)
                except StopAsyncIteration:
                    raise RpcError(grpc.StatusCode.INTERNAL, "the verifier ended without a result") from None
        except (RpcError, Exception) as exc:  # after the 200: the error as the stream's last event
            if not isinstance(exc, RpcError):  # a bug: generic text with the id, the details in the log
                exc = internal_error(exc, rid)
            call.fail(exc)
            call.status, response = _rpc_error_response(exc, face)
            yield b"data: " + response.body + b"\n\n"
            yield DONE
        except BaseException as exc:  # the client went away (cancelled), or a bug
            call.fail(exc)
            raise
        finally:
            await events.aclose()  # cancels the verifier call if it is still running
            self._release(call)
            call.end()
