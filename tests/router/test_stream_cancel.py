"""The router cancels its verifier call only when the call did not run to its end: a client that
leaves early or a failure stops the verifier's work, while a stream the verifier finished costs no
``ray.cancel`` round trip (one per request, in the router and the verifier's process). The router's
own steps with a stand-in verifier (pure logic, no Ray)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from draftmesh.io_struct import ServeRequest
from draftmesh.router import ingress
from draftmesh.router.errors import RpcError


class Stream:
    """A verifier call's stream of events; ``fail`` is raised after them."""

    def __init__(self, events, fail: BaseException | None = None):
        self.events = list(events)
        self.fail = fail
        self.cancelled = 0

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.events:
            return self.events.pop(0)
        if self.fail is not None:
            raise self.fail
        raise StopAsyncIteration

    def cancel(self):
        self.cancelled += 1


class Verifier:
    def __init__(self, stream: Stream):
        self.stream = stream
        self.generate = SimpleNamespace(remote=lambda req: stream)

    def options(self, **_):
        return self


def _router(stream: Stream):
    return SimpleNamespace(verifier=Verifier(stream))


def _request() -> ServeRequest:
    return ServeRequest(request_id="req-1", prompt="x", tenant="alice")


def test_a_stream_run_to_its_end_is_not_cancelled():
    stream = Stream(["a", "b", "c"])

    async def run():
        return [e async for e in ingress.Router.func_or_class._events(_router(stream), _request())]

    assert asyncio.run(run()) == ["a", "b", "c"]
    assert stream.cancelled == 0


def test_a_caller_that_leaves_early_cancels_the_stream():
    stream = Stream(["a", "b", "c"])

    async def run():
        events = ingress.Router.func_or_class._events(_router(stream), _request())
        first = await events.__anext__()
        await events.aclose()  # the client went away: the router's generator is closed
        return first

    assert asyncio.run(run()) == "a"
    assert stream.cancelled == 1


def test_a_failed_stream_is_cancelled():
    stream = Stream(["a"], fail=ValueError("boom"))

    async def run():
        async for _ in ingress.Router.func_or_class._events(_router(stream), _request()):
            pass

    with pytest.raises(RpcError):
        asyncio.run(run())
    assert stream.cancelled == 1
