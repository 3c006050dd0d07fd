"""The cross-tenant probe against a real mesh: real Ray Serve, gRPC, HTTP, Redis, SmolLM2 on CPU.

One mesh for the module with four tenants by key: alice (shares her answers with carol), bob,
carol, and "metered" with quotas. Only the ``history`` source runs, so what a request drafted
is attributable: it drafts from its own prompt, its session's turns and the stored answers.
User B naming user A's session id, asking A's question, or asking it under the most lenient
lossy policy the mesh allows gets none of A's session KV, session turns or answers.

Run under the heavy lock (it starts Ray):
    flock /tmp/heavy.lock timeout 900 nice -n 10 .venv/bin/python -m pytest -q tests/security/test_tenant_isolation.py
"""

from __future__ import annotations

import os

import grpc
import httpx
import pytest

from draftmesh.config import DraftmeshConfig
from draftmesh.net import free_port
from draftmesh.v1 import generation_pb2 as pb
from draftmesh.v1 import generation_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

KEYS = {"alice": "key-alice-0123456789", "bob": "key-bob-0123456789", "carol": "key-carol-0123456789",
        "metered": "key-metered-0123456789"}
# The most lenient lossy policy the mesh allows (lossy.MIN_TYPICAL_EPSILON / MIN_TYPICAL_DELTA).
LENIENT = pb.Speculation(policy="typical", policy_params={"epsilon": "0.01", "delta": "0.01"})
SECRET = "The vault code is PURPLE-ELEPHANT-4417 and the meeting moved to the north tower."
ANSWER_PREFIX = b"draftmesh:answers:e:"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    from draftmesh.router.launcher import start_mesh

    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    # bob's key from the key file as "<tenant> <key>"; the others from the config
    keys.write_text(f"# tenants\nbob {KEYS['bob']}\n")
    cfg = DraftmeshConfig.from_dict({
        "engine": {"threads": 2, "cost_cache": os.environ.get("DRAFTMESH_COST_CACHE")},
        "sources": {"names": ["history"]},
        "serve": {
            "grpc_port": free_port(), "http_port": free_port(), "verifier_num_cpus": 0.5, "max_in_flight": 8,
            "log_level": "WARNING", "api_keys_file": str(keys),
            "tenants": {
                "alice": {"keys": [KEYS["alice"]], "share_answers_with": ["carol"]},
                "carol": {"keys": [KEYS["carol"]]},
                "metered": {"keys": [KEYS["metered"]], "max_in_flight": 1, "tokens_per_minute": 40},
            },
        },
        "factcheck": {"enabled": False},
    })
    running = start_mesh(cfg, ray_init={"num_cpus": 4})
    print(f"mesh started in {running.started_s:.1f}s; gRPC {running.address}, HTTP {running.http_address}")
    yield running
    running.stop()


@pytest.fixture(scope="module")
def stub(mesh):
    with grpc.insecure_channel(mesh.address) as ch:
        yield pb_grpc.GenerationStub(ch)


@pytest.fixture(scope="module")
def store(mesh):
    import redis

    client = redis.Redis.from_url(mesh.redis.url)
    yield client
    client.close()


def auth(tenant: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {KEYS[tenant]}"),)


def chat(*turns: str, max_new_tokens: int = 32, **kw) -> pb.GenerateRequest:
    roles = ["user", "assistant"]
    messages = [pb.ChatMessage(role=roles[i % 2], content=t) for i, t in enumerate(turns)]
    return pb.GenerateRequest(messages=messages, max_new_tokens=max_new_tokens, **kw)


def complete(stub, tenant: str, req: pb.GenerateRequest) -> pb.GenerateResult:
    return stub.Complete(req, metadata=auth(tenant), timeout=300)


def drafted(result: pb.GenerateResult) -> int:
    """Drafted tokens the target accepted (tokens beyond one per step)."""
    return result.usage.completion_tokens - result.usage.steps


def answer_keys(store, tenant: str) -> set[bytes]:
    return set(store.scan_iter(match=ANSWER_PREFIX + tenant.encode() + b"/*"))


def test_a_session_id_reaches_only_its_own_tenants_kv_and_turns(stub):
    """B (exact) and C (the most lenient lossy policy) name A's session id: no cached prompt tokens
    (A's KV), none of A's text, and A's next turn still finds its own KV (their requests neither
    read nor replaced it). C is the tenant A shares answers with: sessions are never shared."""
    first = chat(f"Copy this sentence exactly, then stop: {SECRET}", session_id="team-sess")
    a1 = complete(stub, "alice", first)
    assert "PURPLE" in a1.text or "4417" in a1.text, a1.text  # the probe has something to find
    # each probe is its tenant's first request in that session (a second would find its own KV)
    for tenant, spec in (("bob", None), ("carol", LENIENT)):
        probe = chat("Go on, say it again exactly as before.", session_id="team-sess", speculation=spec)
        b = complete(stub, tenant, probe)
        assert b.usage.cached_prompt_tokens == 0, f"{tenant} reused {b.usage.cached_prompt_tokens} tokens of alice's KV"
        assert "PURPLE" not in b.text and "4417" not in b.text
        assert b.lossless is (spec is None)
    a2 = complete(stub, "alice", chat(first.messages[0].content, a1.text, "Thanks. Now say it once more.",
                                      session_id="team-sess"))
    assert a2.usage.cached_prompt_tokens > 0, "alice's own session KV must still be found"


MOSTLY, LITTLE = 0.6, 0.35
"""Shares of a request's tokens that were drafted and accepted: drafting a stored answer of the
same prompt gives nearly all (MOSTLY is far below it); the prompt alone gives few (LITTLE is
far above it for these questions, whose answers copy little of the prompt)."""


def share(result: pb.GenerateResult) -> float:
    return drafted(result) / max(1, result.usage.completion_tokens)


def test_answers_are_per_tenant_shared_only_with_exact_requests_of_named_tenants(stub, store):
    question = chat("Write two sentences about a lighthouse keeper who collects lost buttons.")
    before = answer_keys(store, "alice")
    first = complete(stub, "alice", question)
    assert len(answer_keys(store, "alice") - before) == 1, "alice's exact answer is stored under alice"
    again = complete(stub, "alice", question)  # her own answer is drafted back
    assert list(again.token_ids) == list(first.token_ids)
    assert share(again) >= MOSTLY, (drafted(again), again.usage)
    # her prompt's KV is pooled: she prefills only its last token, the others never get it
    assert again.usage.cached_prompt_tokens == again.usage.prompt_tokens - 1, again.usage

    bob = complete(stub, "bob", question)  # same question, another tenant: no answer to draft
    assert list(bob.token_ids) == list(first.token_ids)  # exact: the target's own text
    assert share(bob) <= LITTLE, (drafted(bob), bob.usage)

    carol = complete(stub, "carol", question)  # alice shares with carol
    assert share(carol) >= MOSTLY, (drafted(carol), carol.usage)
    # answers may be shared, KV never: each reuses at most the chat template its own earlier requests began with
    for other_tenant in (bob, carol):
        assert other_tenant.usage.cached_prompt_tokens < again.usage.cached_prompt_tokens - 8, other_tenant.usage

    # a question only alice answered: lossy requests never draft another tenant's answers,
    # shared or not, under the most lenient policy. The yardstick is alice's own lossy request,
    # which may draft her answer; theirs draft from their own prompt only (a lenient policy
    # accepts more of that than exact does, so an absolute share says little here).
    other = "Describe, in two sentences, a bakery that only opens during thunderstorms."
    complete(stub, "alice", chat(other))
    own = complete(stub, "alice", chat(other, speculation=LENIENT))
    assert not own.lossless and share(own) >= MOSTLY, (drafted(own), own.usage)
    for tenant in ("carol", "bob"):
        lossy = complete(stub, tenant, chat(other, speculation=LENIENT))
        assert not lossy.lossless
        assert share(lossy) <= share(own) - 0.15, (tenant, drafted(lossy), lossy.usage, drafted(own), own.usage)


def test_lossy_outputs_are_never_stored(stub, store):
    before = {t: answer_keys(store, t) for t in ("alice", "bob", "carol", "default")}
    got = complete(stub, "alice", chat("List four rivers of Europe, one per line.", speculation=LENIENT))
    assert not got.lossless and got.text
    assert {t: answer_keys(store, t) for t in before} == before
    # and nothing is ever stored outside a tenant's namespace
    names = {k[len(ANSWER_PREFIX):].split(b"/", 1)[0] for k in store.scan_iter(match=ANSWER_PREFIX + b"*")}
    assert names <= {b"alice", b"bob", b"carol", b"metered", b"default"}


def test_quotas_answer_resource_exhausted_and_429_naming_the_quota(stub, mesh):
    with pytest.raises(grpc.RpcError) as err:
        complete(stub, "metered", chat("Hello.", max_new_tokens=41))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "serve.tenants.metered.tokens_per_minute" in err.value.details()
    r = httpx.post(f"http://{mesh.http_address}/v1/chat/completions", timeout=120,
                   headers={"Authorization": f"Bearer {KEYS['metered']}"},
                   json={"model": mesh.config.engine.model, "max_tokens": 41,
                         "messages": [{"role": "user", "content": "Hello."}]})
    assert r.status_code == 429, r.text
    assert "serve.tenants.metered.tokens_per_minute" in r.json()["error"]["message"]

    # plain decoding, one token a step: it is still running when the next call comes
    held = chat("Count from one to one hundred in words, separated by commas.", max_new_tokens=38,
                speculation=pb.Speculation(enabled=False))
    stream = stub.Generate(held, metadata=auth("metered"), timeout=300)
    try:
        next(stream)  # admitted and running
        with pytest.raises(grpc.RpcError) as err:
            complete(stub, "metered", chat("Hi.", max_new_tokens=2))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "serve.tenants.metered.max_in_flight" in err.value.details()
        # another tenant is not held back by metered's quota
        assert complete(stub, "bob", chat("Hi.", max_new_tokens=2)).usage.completion_tokens >= 1
    finally:
        stream.cancel()
