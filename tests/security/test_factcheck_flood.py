"""The FactCheck flood through a running mesh (issue 18): the issue's 40 FactCheck calls asking to wait a
minute each (ids that cannot exist, and well-formed ids nobody queued), sent all at once beside a Generate.
The router's FactCheck handler answers them at once (NOT_FOUND) or refuses beyond ``factcheck.max_waiters``,
so none holds a router slot for its minute: the Generate is served within seconds, not after the flood's
minute. (Serve's own queue may shed a request of the burst with RESOURCE_EXHAUSTED, "dropped due to
backpressure": the client retries that, as it would under any load.) The shared served mesh: real Ray
Serve, gRPC, Redis, fact-check workers and SmolLM2."""

from __future__ import annotations

import secrets
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from served_mesh import AUTH, chat

from draftmesh.v1 import generation_pb2 as pb

pytestmark = pytest.mark.slow

WAIT_MS = 60_000


def test_a_factcheck_flood_does_not_stall_generate(stub):
    def factcheck(annotation_id: str):
        t0 = time.perf_counter()
        try:
            stub.FactCheck(pb.FactCheckRequest(annotation_id=annotation_id, wait_ms=WAIT_MS), metadata=AUTH, timeout=90)
            code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            code = exc.code()
        return code, time.perf_counter() - t0

    ids = ["x"] * 20 + [f"o-{secrets.token_hex(16)}" for _ in range(20)]  # impossible, and never queued

    def generate():
        while True:  # retried only where Serve shed it at once (backpressure), never after a wait
            try:
                return stub.Complete(chat("Name three primary colours.", 16), metadata=AUTH, timeout=120)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.perf_counter() - t0 > 60:
                    raise
                time.sleep(0.2)

    with ThreadPoolExecutor(len(ids) + 1) as pool:
        flood = [pool.submit(factcheck, i) for i in ids]
        time.sleep(0.2)  # the flood is in the router
        t0 = time.perf_counter()
        result = pool.submit(generate).result()
        generate_s = time.perf_counter() - t0
        answers = [f.result() for f in flood]
    assert result.text and result.usage.completion_tokens > 0
    codes = {code for code, _ in answers}
    assert codes <= {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
    slowest = max(s for _, s in answers)
    assert slowest < 30, f"a FactCheck call held its slot for {slowest:.1f} s"  # each asked for 60 s
    assert generate_s < 30, f"the Generate took {generate_s:.1f} s beside the flood"
    print(f"40 FactCheck calls answered in at most {slowest:.2f} s; the Generate beside them took {generate_s:.2f} s")
