"""A stand-in for the router's verifier handle (pure logic, no Ray): ``handle.options(...).generate.remote(req)``
returns a ``StandInStream`` that yields its events, then raises ``fail`` if given, and counts cancels."""

from __future__ import annotations

from types import SimpleNamespace


class StandInStream:
    def __init__(self, events=(), fail: BaseException | None = None):
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


class StandInVerifier:
    def __init__(self, stream: StandInStream):
        self.generate = SimpleNamespace(remote=lambda req: stream)

    def options(self, **_):
        return self


def router_with(stream: StandInStream) -> SimpleNamespace:
    """What ``Router._events`` reads of its instance: the verifier handle."""
    return SimpleNamespace(verifier=StandInVerifier(stream))
