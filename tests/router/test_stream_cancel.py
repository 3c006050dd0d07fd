"""The router cancels its verifier call only when the call did not run to its end: a client that
leaves early or a failure stops the verifier's work, while a stream the verifier finished costs no
``ray.cancel`` round trip (one per request, in the router and the verifier's process). The router's
own steps with a stand-in verifier (pure logic, no Ray)."""

from __future__ import annotations

import asyncio

import pytest
from stand_in_verifier import StandInStream, router_with

from draftmesh.io_struct import ServeRequest
from draftmesh.router import ingress
from draftmesh.router.errors import RpcError


def _request() -> ServeRequest:
    return ServeRequest(request_id="req-1", prompt="x", tenant="alice")


def test_a_stream_run_to_its_end_is_not_cancelled():
    stream = StandInStream(["a", "b", "c"])

    async def run():
        return [e async for e in ingress.Router.func_or_class._events(router_with(stream), _request())]

    assert asyncio.run(run()) == ["a", "b", "c"]
    assert stream.cancelled == 0


def test_a_caller_that_leaves_early_cancels_the_stream():
    stream = StandInStream(["a", "b", "c"])

    async def run():
        events = ingress.Router.func_or_class._events(router_with(stream), _request())
        first = await events.__anext__()
        await events.aclose()  # the client went away: the router's generator is closed
        return first

    assert asyncio.run(run()) == "a"
    assert stream.cancelled == 1


def test_a_failed_stream_is_cancelled():
    stream = StandInStream(["a"], fail=ValueError("boom"))

    async def run():
        async for _ in ingress.Router.func_or_class._events(router_with(stream), _request()):
            pass

    with pytest.raises(RpcError):
        asyncio.run(run())
    assert stream.cancelled == 1
