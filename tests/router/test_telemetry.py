"""The router's per-RPC accounting: status codes, tokens and durations, whatever ended the call."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from draftmesh.io_struct import GenerationResult, ServedResult, StepRecord
from draftmesh.metrics import MemoryMetrics
from draftmesh.router.ingress import RpcError
from draftmesh.router.telemetry import RouterMetrics, RpcCall


def result(tokens: int, policy: str = "exact", lenient: int = 0) -> ServedResult:
    steps = (StepRecord(tree_size=4, accepted=1, emitted=2, draft_s=0.001, verify_s=0.01),) * (tokens // 2)
    return ServedResult(GenerationResult(tuple(range(tokens)), "x", "length", 5, steps, 0.5, 0.1, policy=policy,
                                         lossless=policy == "exact", lenient_tokens=lenient), "verifier-0")


def finish(call: RpcCall, exc: BaseException | None = None) -> None:
    """End ``call`` as an RPC body that raised ``exc`` (or returned) would."""
    try:
        with call:
            if exc is not None:
                raise exc
    except BaseException as raised:  # noqa: BLE001 - re-raised unchanged by the context manager
        assert raised is exc


@pytest.mark.parametrize("exc, code", [
    (None, "OK"),
    (RpcError(grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens must be >= 1"), "INVALID_ARGUMENT"),
    (RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy"), "RESOURCE_EXHAUSTED"),
    (asyncio.CancelledError(), "CANCELLED"),
    (GeneratorExit(), "CANCELLED"),
    (KeyError("bug"), "INTERNAL"),
])
def test_each_rpc_is_counted_once_under_its_code(exc, code):
    backend = MemoryMetrics()
    call = RpcCall("Generate", [], RouterMetrics(backend))
    finish(call, exc)
    assert backend.value("draftmesh_requests", method="Generate", code=code) == 1
    assert sum(v for (name, _), v in backend.values.items() if name == "draftmesh_requests") == 1
    assert len(backend.observed("draftmesh_request_seconds", method="Generate")) == 1


def test_tokens_and_first_token_are_recorded_per_policy():
    backend = MemoryMetrics()
    metrics = RouterMetrics(backend)
    call = RpcCall("Complete", [], metrics)
    call.step()
    call.step()  # only the first step is the first token
    call.result(result(10, "typical", lenient=3))
    finish(call)
    assert backend.value("draftmesh_generated_tokens", policy="typical") == 10
    assert backend.value("draftmesh_lenient_tokens", policy="typical") == 3
    assert len(backend.observed("draftmesh_time_to_first_token_seconds")) == 1
    empty = RpcCall("Complete", [], metrics)
    empty.result(result(0))  # nothing generated: no counter step of 0 (Ray refuses those)
    finish(empty)
    assert backend.value("draftmesh_generated_tokens", policy="exact") == 0
