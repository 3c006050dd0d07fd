"""Tenants without a mesh: keys name tenants, ids are scoped, answers stay in their tenant,
lossy requests neither store answers nor read other tenants', and quotas count on a sliding window.

The mesh end to end is ``test_tenant_isolation.py``."""

from __future__ import annotations

import random

import pytest

from draftmesh.auth import ApiKeyAuth, Unauthenticated, read_tenant_key_file
from draftmesh.config import DEFAULT_TENANT, DraftmeshConfig, ServeConfig, TenantConfig
from draftmesh.draft.base import DraftContext
from draftmesh.draft.history import HistorySource, InMemoryAnswerStore
from draftmesh.draft.redis_store import RedisAnswerStore
from draftmesh.io_struct import GenerationRequest, ServeRequest, SpeculationParams
from draftmesh.router.admission import QuotaExceeded, TenantAdmission
from draftmesh.tenancy import Tenants, scope, scoped_request


def bearer(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


# ---------------------------------------------------------------------- keys and identity
def test_key_file_lines_name_tenants_and_bare_keys_are_the_default_tenant(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# comment\nbare-key\nalpha  key-a1\n\nbeta key-b\nalpha key-a2\n")
    assert read_tenant_key_file(str(path)) == [
        (DEFAULT_TENANT, "bare-key"), ("alpha", "key-a1"), ("beta", "key-b"), ("alpha", "key-a2")]
    auth = ApiKeyAuth.from_config(ServeConfig(api_keys_file=str(path)))
    assert auth.identify(bearer("key-a1")) == auth.identify(bearer("key-a2")) == "alpha"
    assert auth.identify(bearer("key-b")) == "beta"
    assert auth.identify(bearer("bare-key")) == DEFAULT_TENANT
    assert auth.tenants == {"alpha", "beta", DEFAULT_TENANT}


@pytest.mark.parametrize("line, words", [("a b c-secret", "line 1"), ("bad/name secret-key", "tenant name")])
def test_bad_key_file_line_is_named_without_its_text(tmp_path, line, words):
    path = tmp_path / "keys"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match=words) as err:
        ApiKeyAuth.from_config(ServeConfig(api_keys_file=str(path)))
    assert "secret" not in str(err.value)


def test_identify_refuses_wrong_and_missing_keys_and_is_default_without_keys():
    auth = ApiKeyAuth.from_config(ServeConfig(tenants={"alpha": TenantConfig(keys=["k-alpha"])}, api_keys=["k-any"]))
    assert auth.identify(bearer("k-alpha")) == "alpha"
    assert auth.identify(bearer("k-any")) == DEFAULT_TENANT
    for metadata in (bearer("k-other"), [], [("authorization", "k-alpha")]):
        with pytest.raises(Unauthenticated):
            auth.identify(metadata)
    assert auth.check(bearer("k-other")) == "invalid API key"
    assert ApiKeyAuth(None).identify([]) == DEFAULT_TENANT


def test_one_key_in_two_tenants_is_a_config_error():
    with pytest.raises(ValueError, match="two tenants: alpha and beta"):
        ApiKeyAuth.from_config(ServeConfig(tenants={"alpha": TenantConfig(keys=["same"]),
                                                    "beta": TenantConfig(keys=["same"])}))


def test_tenant_config_round_trips_and_checks_names():
    cfg = DraftmeshConfig.from_dict({"serve": {"tenants": {"a": {"keys": ["k"], "tokens_per_minute": 100,
                                                                  "share_answers_with": ["b"]}, "b": {}}}})
    assert DraftmeshConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="tenant name"):
        DraftmeshConfig.from_dict({"serve": {"tenants": {"a/b": {}}}})
    with pytest.raises(ValueError, match="max_in_flight must be >= 0"):
        DraftmeshConfig.from_dict({"serve": {"tenants": {"a": {"max_in_flight": -1}}}})
    with pytest.raises(ValueError, match="unknown tenants: nobody"):
        Tenants(ServeConfig(tenants={"a": TenantConfig(share_answers_with=["nobody"])}))


def test_quotas_resolve_from_the_tenant_else_the_defaults_and_sharing_is_directed():
    serve = ServeConfig(tenant_max_in_flight=3, tenant_tokens_per_minute=500, tenants={
        "a": TenantConfig(max_in_flight=1, share_answers_with=["b"]), "b": TenantConfig(tokens_per_minute=0)})
    tenants = Tenants(serve, {"c"})
    assert set(tenants.names) == {"a", "b", "c", DEFAULT_TENANT}
    a, b, c = tenants["a"], tenants["b"], tenants["c"]
    assert (a.max_in_flight, a.in_flight_key, a.tokens_per_minute, a.tokens_key) == (
        1, "serve.tenants.a.max_in_flight", 500, "serve.tenant_tokens_per_minute")
    assert (b.max_in_flight, b.tokens_per_minute, b.tokens_key) == (3, 0, "serve.tenants.b.tokens_per_minute")
    assert b.reads_answers_of == ("a",) and a.reads_answers_of == () and c.reads_answers_of == ()


# ---------------------------------------------------------------------- scoping
def test_scoped_request_puts_request_and_session_ids_in_the_tenant_namespace():
    req = ServeRequest(request_id="r1", prompt="hi", session_id="s1", tenant="alpha")
    scoped = scoped_request(req)
    assert (scoped.request_id, scoped.session_id) == ("alpha/r1", "alpha/s1")
    assert scoped_request(ServeRequest(request_id="r", prompt="x", tenant="b")).session_id is None
    # the same client ids from two tenants never meet; tenant names hold no '/', so no id forges another's
    assert scope("alpha", "s1") != scope("beta", "s1")
    gen = scoped.to_generation((1, 2))
    assert (gen.tenant, gen.request_id, gen.session_id) == ("alpha", "alpha/r1", "alpha/s1")


# ---------------------------------------------------------------------- the answer store
PROMPT = tuple(range(10, 60))
NEAR = PROMPT[:-1] + (99,)
ANSWER = (7, 8, 9, 10, 11)


@pytest.fixture(params=["memory", "redis"])
def store(request):
    if request.param == "memory":
        yield InMemoryAnswerStore()
        return
    client = request.getfixturevalue("redis_client")
    prefix = f"test-tenants-{random.getrandbits(32)}:"
    yield RedisAnswerStore(client, prefix=prefix)
    for key in client.scan_iter(match=prefix + "*"):
        client.delete(key)


def test_answers_are_kept_per_tenant_exact_and_near(store):
    store.put(PROMPT, ANSWER, tenant="alpha")
    assert store.get_exact(PROMPT, tenant="alpha") == ANSWER
    assert [a.output_ids for a in store.near(NEAR, tenant="alpha")] == [ANSWER]
    assert store.get_exact(PROMPT, tenant="beta") is None
    assert store.near(NEAR, tenant="beta") == [] and store.near(PROMPT, tenant="beta") == []
    assert store.get_exact(PROMPT) is None  # the default tenant is a tenant too


def test_a_put_without_answer_keeps_the_session_turn_only(store):
    store.put(PROMPT, ANSWER, "alpha/s", tenant="alpha", answer=False)
    assert store.get_exact(PROMPT, tenant="alpha") is None and store.near(NEAR, tenant="alpha") == []
    assert [t.output_ids for t in store.session_turns("alpha/s")] == [ANSWER]


def ctx(tenant: str, lossless: bool, shared: tuple[str, ...] = (), prompt=PROMPT, rid="r") -> DraftContext:
    return DraftContext(token_ids=prompt, prompt_len=len(prompt), request_id=f"{tenant}/{rid}", tenant=tenant,
                        answer_tenants=(tenant, *shared) if lossless else (tenant,), store_answer=lossless)


def drafted(source: HistorySource, c: DraftContext) -> set[tuple[int, ...]]:
    return {p.token_ids for p in source.propose(c)}


def test_history_drafts_shared_answers_for_exact_requests_only_and_stores_no_lossy_answer():
    source = HistorySource(InMemoryAnswerStore())
    source.finish(ctx("alpha", lossless=True), ANSWER, "")
    assert any(d[:3] == ANSWER[:3] for d in drafted(source, ctx("alpha", True, rid="r2")))
    assert not drafted(source, ctx("beta", True, rid="r3"))  # not shared
    assert any(d[:3] == ANSWER[:3] for d in drafted(source, ctx("beta", True, ("alpha",), rid="r4")))
    assert not drafted(source, ctx("beta", False, rid="r5"))  # lossy: never another tenant's answers
    lossy_answer = (21, 22, 23, 24)
    other = tuple(range(100, 150))
    source.finish(ctx("alpha", lossless=False, prompt=other, rid="l"), lossy_answer, "")
    assert source.store.get_exact(other, tenant="alpha") is None
    assert not drafted(source, ctx("alpha", True, prompt=other, rid="r6"))


def test_the_decoder_marks_lossy_contexts(tiny):
    from draftmesh.verify.decoder import SpeculativeDecoder

    source = HistorySource(InMemoryAnswerStore())
    decoder = SpeculativeDecoder(tiny, [source])
    prompt = tuple(range(5, 25))
    lossy = SpeculationParams(policy="typical", policy_params={"epsilon": 0.3, "delta": 0.1})
    decoder.generate(GenerationRequest(prompt, max_new_tokens=6, speculation=lossy, tenant="alpha",
                                       reads_answers_of=("beta",), request_id="alpha/x"))
    assert source.store.get_exact(prompt, tenant="alpha") is None
    got = decoder.generate(GenerationRequest(prompt, max_new_tokens=6, tenant="alpha", request_id="alpha/y"))
    assert source.store.get_exact(prompt, tenant="alpha") == tuple(got.token_ids)
    assert decoder._context(GenerationRequest(prompt, tenant="alpha", reads_answers_of=("beta",)),
                            list(prompt), [], 4, lossless=True).answer_tenants == ("alpha", "beta")


def test_a_remote_source_gets_the_tenant_of_the_scoped_id_reads_only_its_answers_and_stores_none():
    from draftmesh.draft.wire import context_from_proto, context_to_proto

    sent = ctx("alice", lossless=True, shared=("beta",))
    got = context_from_proto(context_to_proto(sent))
    assert (got.tenant, got.answer_tenants, got.store_answer) == ("alice", ("alice",), False)
    unscoped = context_from_proto(context_to_proto(DraftContext(token_ids=(1, 2), prompt_len=1, request_id="r")))
    assert unscoped.tenant == DEFAULT_TENANT


# ---------------------------------------------------------------------- quotas
class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def admission(**serve) -> tuple[TenantAdmission, Clock]:
    clock = Clock()
    return TenantAdmission(Tenants(ServeConfig(**serve)), clock=clock), clock


def test_in_flight_quota_names_its_key_and_frees_on_release():
    adm, _ = admission(tenants={"a": TenantConfig(max_in_flight=1)}, tenant_max_in_flight=2)
    first = adm.admit("a", 10)
    with pytest.raises(QuotaExceeded, match=r"serve\.tenants\.a\.max_in_flight") as err:
        adm.admit("a", 10)
    assert err.value.key == "serve.tenants.a.max_in_flight"
    adm.admit(DEFAULT_TENANT, 10), adm.admit(DEFAULT_TENANT, 10)  # the default quota, per tenant
    with pytest.raises(QuotaExceeded, match=r"serve\.tenant_max_in_flight"):
        adm.admit(DEFAULT_TENANT, 10)
    capped, _ = admission(tenants={"a": TenantConfig(max_in_flight=1, tokens_per_minute=50)})
    held = capped.admit("a", 10)
    with pytest.raises(QuotaExceeded, match="tokens_per_minute"):  # never admissible: said first, whatever is in flight
        capped.admit("a", 51)
    capped.release(held, 10)
    adm.release(first, 3)
    adm.release(first, 3)  # twice: once counted
    assert adm.in_flight("a") == 0
    adm.admit("a", 10)


def test_tokens_per_minute_charge_max_tokens_then_actual_usage_on_a_sliding_window():
    adm, clock = admission(tenant_tokens_per_minute=100)
    t1 = adm.admit("default", 60)
    with pytest.raises(QuotaExceeded, match=r"serve\.tenant_tokens_per_minute exceeded: 60 of 100 .* retry in 60 s"):
        adm.admit("default", 50)
    adm.release(t1, 20)  # generated 20: the charge is corrected
    clock.now += 30
    t2 = adm.admit("default", 50)
    assert adm.tokens_used("default") == 70
    clock.now += 31  # t1 left the window (sliding: t2 is still in it)
    assert adm.tokens_used("default") == 50
    with pytest.raises(QuotaExceeded, match="retry in 29 s"):
        adm.admit("default", 51)
    adm.release(t2, None)  # no result (cancelled, failed): the full charge stays
    assert adm.tokens_used("default") == 50
    with pytest.raises(QuotaExceeded, match="max_new_tokens 101 is over"):
        adm.admit("default", 101)


def test_zero_is_unlimited():
    adm, _ = admission()
    for _ in range(100):
        adm.admit("default", 10_000)


# ---------------------------------------------------------------------- the router's one place
class _Verifier:
    """Records what the router sends (test double of the verifier handle; the mesh test runs the real one)."""

    def __init__(self) -> None:
        self.sent: list[ServeRequest] = []
        self.model_ids: list[str] = []

    def options(self, stream: bool, multiplexed_model_id: str):
        self.model_ids.append(multiplexed_model_id)
        return self

    @property
    def generate(self):
        return self

    def remote(self, req):
        self.sent.append(req)
        return _Stream()


class _Stream:
    def __aiter__(self):
        return self

    async def __anext__(self):
        raise StopAsyncIteration

    def cancel(self) -> None:
        pass


def test_the_router_scopes_ids_once_admits_by_quota_and_counts_per_tenant(monkeypatch):
    import asyncio

    import grpc

    from draftmesh.metrics import MemoryMetrics
    from draftmesh.router import ingress
    from draftmesh.router.errors import RpcError
    from draftmesh.router.telemetry import RpcCall
    from draftmesh.v1 import generation_pb2 as pb

    metrics = MemoryMetrics()
    monkeypatch.setattr(ingress, "RayMetrics", lambda: metrics)
    cfg = DraftmeshConfig.from_dict({"factcheck": {"enabled": False}, "serve": {"tenants": {
        "alice": {"keys": ["k-alice"], "max_in_flight": 1}, "bob": {"keys": ["k-bob"], "share_answers_with": ["alice"]}}}})
    verifier = _Verifier()
    wrapped = ingress.Router.func_or_class  # Serve's ASGI wrapper of the class (its __init__ is async)
    router = object.__new__(wrapped)
    wrapped.__mro__[1].__init__(router, cfg.to_dict(), verifier)  # the router's own __init__, no ASGI app
    request = pb.GenerateRequest(prompt="hi", max_new_tokens=4, request_id="r-1", session_id="s-1")
    call = RpcCall("Generate", bearer("k-alice"), router.metrics)
    req = router._admit(request, bearer("k-alice"), call)
    assert (req.request_id, req.session_id, req.tenant, req.reads_answers_of) == ("r-1", "s-1", "alice", ("bob",))
    with pytest.raises(RpcError) as err:
        router._admit(request, bearer("k-alice"), RpcCall("Generate", bearer("k-alice"), router.metrics))
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "serve.tenants.alice.max_in_flight" in err.value.details
    assert metrics.value("draftmesh_tenant_rejections", tenant="alice", quota="max_in_flight") == 1

    async def run() -> None:
        with pytest.raises(RpcError):  # the double answers nothing
            await router._result(req, call)

    asyncio.run(run())
    assert [(s.request_id, s.session_id) for s in verifier.sent] == [("alice/r-1", "alice/s-1")]
    assert verifier.model_ids == ["alice/s-1"]
    router._release(call)
    assert router.admission.in_flight("alice") == 0
    bob = router._admit(request, bearer("k-bob"), RpcCall("Generate", bearer("k-bob"), router.metrics))
    assert (bob.tenant, bob.reads_answers_of) == ("bob", ())
    assert metrics.value("draftmesh_tenant_requests", tenant="alice") == 1
    assert metrics.value("draftmesh_tenant_requests", tenant="bob") == 1
