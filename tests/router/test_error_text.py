"""Failures that are not the client's fault reach it as a generic message with a request id; the
exception's text (paths, addresses, other requests' data) goes only to the log, under the same id
(issue 18). Both faces; the router's own steps with a stand-in verifier (pure logic, no Ray)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from types import SimpleNamespace

import grpc
import pytest
from stand_in_verifier import StandInStream, router_with

from draftmesh.io_struct import ServeRequest
from draftmesh.router import ingress
from draftmesh.router.errors import RpcError, internal_error
from draftmesh.router.http_face import HttpFace

SECRET = "/srv/secret/path token=abc123"


def _id(details: str) -> str:
    found = re.search(r"request id ([\w-]+)", details)
    assert found, details
    return found.group(1)


def test_internal_error_is_generic_and_logged_with_its_id(caplog):
    with caplog.at_level(logging.ERROR, logger="draftmesh.router.errors"):
        error = internal_error(RuntimeError(SECRET), "req-7")
    assert error.code == grpc.StatusCode.INTERNAL and SECRET not in error.details
    assert _id(error.details) == "req-7"
    assert "req-7" in caplog.text and SECRET in caplog.text
    unavailable = internal_error(RuntimeError(SECRET), code=grpc.StatusCode.UNAVAILABLE)
    assert unavailable.code == grpc.StatusCode.UNAVAILABLE and SECRET not in unavailable.details
    assert len(_id(unavailable.details)) >= 16  # a fresh id when the request has none


class FakeContext:
    def __init__(self):
        self.code = self.details = None

    def set_code(self, code):
        self.code = code

    def set_details(self, details):
        self.details = details


def test_an_unexpected_exception_on_the_grpc_face_is_generic(caplog):
    ctx = FakeContext()
    with caplog.at_level(logging.ERROR), pytest.raises(RpcError) as info:
        with ingress._status_on(ctx):
            raise KeyError(SECRET)
    assert ctx.code == grpc.StatusCode.INTERNAL and SECRET not in ctx.details
    assert info.value.details == ctx.details
    rid = _id(ctx.details)
    assert any(rid in r.getMessage() and SECRET in r.getMessage() for r in caplog.records)


def test_a_verifier_failure_is_generic_with_the_request_id(caplog):
    router = router_with(StandInStream(fail=ValueError(SECRET)))
    req = ServeRequest(request_id="req-42", prompt="x", tenant="alice")  # the client's id, not the scoped one

    async def run():
        async for _ in ingress.Router.func_or_class._events(router, req):
            pass

    with caplog.at_level(logging.ERROR), pytest.raises(RpcError) as info:
        asyncio.run(run())
    assert info.value.code == grpc.StatusCode.INTERNAL
    assert SECRET not in info.value.details and "ValueError" not in info.value.details
    assert _id(info.value.details) == "req-42"
    assert "req-42" in caplog.text and SECRET in caplog.text


class Face(HttpFace):
    metrics = None

    def _authenticate(self, headers):
        return None


def test_an_http_500_is_generic_with_the_request_id(caplog):
    request = SimpleNamespace(headers={"x-request-id": "http-9"}, method="GET")

    def build():
        raise RuntimeError(SECRET)

    with caplog.at_level(logging.ERROR):
        response = Face()._http_simple(request, "/v1/models", build)
    body = json.loads(response.body)
    assert response.status_code == 500, body
    assert SECRET not in response.body.decode()
    assert _id(body["error"]["message"]) == "http-9"
    assert "http-9" in caplog.text and SECRET in caplog.text
