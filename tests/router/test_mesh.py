"""The served mesh end to end through its gRPC face: real Ray Serve, real gRPC, real Redis, real
SmolLM2 on CPU. Outputs are compared with the in-process engine.

The mesh is the session's one served mesh (tests/served_mesh.py), shared with the HTTP face's tests;
the tests that break it (``breaks_mesh``) run after every other test that uses it.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from served_mesh import API_KEY, AUTH, COPY_PROMPT, MAX_IN_FLIGHT, chat, in_process, scrape, total, verifier_stats, wait_idle

from draftmesh.v1 import generation_pb2 as pb

pytestmark = pytest.mark.slow


# ---------------------------------------------------------------------------- outputs
def test_complete_and_generate_equal_the_in_process_engine(stub, engine):
    want = in_process(engine, COPY_PROMPT, 40)
    got = stub.Complete(chat(COPY_PROMPT, 40), metadata=AUTH, timeout=120)
    assert list(got.token_ids) == list(want.token_ids)
    assert got.text == want.text
    assert got.lossless and got.policy == "exact"
    assert got.usage.completion_tokens == len(want.token_ids)
    assert got.usage.prompt_tokens == want.prompt_tokens

    events = list(stub.Generate(chat(COPY_PROMPT, 40), metadata=AUTH, timeout=120))
    deltas = [e.delta for e in events if e.HasField("delta")]
    results = [e.result for e in events if e.HasField("result")]
    assert len(results) == 1 and events[-1].HasField("result")
    final = results[0]
    assert "".join(d.text for d in deltas) == final.text == want.text
    assert [t for d in deltas for t in d.token_ids] == list(final.token_ids) == list(want.token_ids)
    assert len(deltas) == final.usage.steps
    assert [d.stats.step for d in deltas] == list(range(1, len(deltas) + 1))
    assert final.mean_accepted_per_step == pytest.approx(len(final.token_ids) / final.usage.steps)


def test_faulty_sources_degrade_not_kill(stub, engine):
    """Raising and hanging draft deployments, a dead external address: same output, counted failed."""
    # A sentence the model copies and no earlier test asked for: the prompt (extern's prompt lookup)
    # drafts it, the answer store cannot (a variant of COPY_PROMPT was answered with COPY_PROMPT's
    # answer, which the store then drafted instead, so whether extern got a node depended on test order)
    prompt = ("Copy this sentence exactly, then stop: Mira packed three blue notebooks, a lantern and dried figs "
              "for the long walk to Orvieto.")
    want = in_process(engine, prompt, 32)
    got = stub.Complete(chat(prompt, 32), metadata=AUTH, timeout=120)
    assert list(got.token_ids) == list(want.token_ids)
    stats = {s.source: s for s in got.sources}
    assert {"boom", "stuck", "down", "extern"} <= set(stats), got.sources
    for name in ("boom", "stuck", "down"):
        assert stats[name].failed_steps >= 1, (name, stats.get(name))
        assert stats[name].accepted_tokens == 0
    # The working external source is one more branch of the tree and gets tokens accepted.
    assert stats["extern"].failed_steps == 0
    assert stats["extern"].accepted_tokens > 0


def test_seeded_plain_sampling_through_the_mesh_matches_in_process(stub, engine):
    """A seed fixes the sample: the mesh gives the in-process engine's output, twice."""
    from draftmesh.io_struct import GenerationRequest, SamplingParams, SpeculationParams
    from draftmesh.prompts import encode_messages

    text = "Write a short poem about rivers."
    req = chat(text, 24, temperature=0.8, top_p=0.95, seed=7, speculation=pb.Speculation(enabled=False))
    a = stub.Complete(req, metadata=AUTH, timeout=120)
    b = stub.Complete(req, metadata=AUTH, timeout=120)
    ids = encode_messages(engine.target.tokenizer, [{"role": "user", "content": text}])
    want = engine.generate(GenerationRequest(tuple(ids), max_new_tokens=24, sampling=SamplingParams(0.8, 0.95, 0, 7),
                                             speculation=SpeculationParams(enabled=False)))
    assert list(a.token_ids) == list(b.token_ids) == list(want.token_ids)


def test_seeded_speculative_sampling_through_the_mesh_equals_plain(stub, engine):
    """Seeded draws are keyed by output position: speculation on (the second run also drafts from
    the first one's stored answer) gives the plain, speculation-off text."""
    from draftmesh.io_struct import GenerationRequest, SamplingParams, SpeculationParams
    from draftmesh.prompts import encode_messages

    text = "Repeat this sentence exactly: Seven grey herons stood in the shallow water at dawn."
    req = chat(text, 32, temperature=0.7, seed=21)
    a = stub.Complete(req, metadata=AUTH, timeout=120)
    b = stub.Complete(req, metadata=AUTH, timeout=120)
    ids = encode_messages(engine.target.tokenizer, [{"role": "user", "content": text}])
    want = engine.generate(GenerationRequest(tuple(ids), max_new_tokens=32, sampling=SamplingParams(0.7, seed=21),
                                             speculation=SpeculationParams(enabled=False)))
    assert list(a.token_ids) == list(b.token_ids) == list(want.token_ids)
    assert a.text == b.text == want.text
    assert a.usage.steps < len(a.token_ids)  # the drafts were used


def test_documents_and_speculation_options_are_honoured(stub, engine):
    doc = "The Aurora bridge opened in 1932 and carries State Route 99 across the ship canal in Seattle."
    req = chat("Using the document, say when the Aurora bridge opened and what it carries.", 30,
               documents=[pb.Document(id="d1", text=doc)])
    spec = stub.Complete(req, metadata=AUTH, timeout=120)
    req.speculation.enabled = False
    plain = stub.Complete(req, metadata=AUTH, timeout=120)
    assert list(spec.token_ids) == list(plain.token_ids)
    assert plain.mean_accepted_per_step == 1.0 and not plain.sources
    only = chat(COPY_PROMPT, 16)
    only.speculation.sources.append("rules")
    got = stub.Complete(only, metadata=AUTH, timeout=120)
    assert {s.source for s in got.sources} <= {"rules"}


def test_session_reuses_kv_and_history(stub):
    first = chat("Name three primary colours.", 20, session_id="sess-1")
    a = stub.Complete(first, metadata=AUTH, timeout=120)
    second = pb.GenerateRequest(
        messages=[pb.ChatMessage(role="user", content="Name three primary colours."),
                  pb.ChatMessage(role="assistant", content=a.text),
                  pb.ChatMessage(role="user", content="And three secondary ones?")],
        max_new_tokens=20, session_id="sess-1")
    b = stub.Complete(second, metadata=AUTH, timeout=120)
    assert b.usage.cached_prompt_tokens > 0
    assert b.replica == a.replica
    fresh = stub.Complete(pb.GenerateRequest(messages=second.messages, max_new_tokens=20), metadata=AUTH, timeout=120)
    assert list(fresh.token_ids) == list(b.token_ids)


# ---------------------------------------------------------------------------- bad input
def _bad_requests():
    long_prompt = "word " * 20000
    both = chat("hi")
    both.prompt = "hi"
    cases = {
        "empty prompt": (pb.GenerateRequest(prompt="", max_new_tokens=4), "prompt"),
        "prompt and messages": (both, "prompt"),
        "oversized prompt": (pb.GenerateRequest(prompt=long_prompt, max_new_tokens=4), "bytes"),
        "invalid UTF-8 stop": (pb.GenerateRequest(prompt="hi", stop=[b"\xff\xfe"], max_new_tokens=4), "stop[0]"),
        "negative max_new_tokens": (pb.GenerateRequest(prompt="hi", max_new_tokens=-1), "max_new_tokens"),
        "huge max_new_tokens": (pb.GenerateRequest(prompt="hi", max_new_tokens=10**9), "max_new_tokens"),
        "context overflow": (pb.GenerateRequest(prompt="hi " * 300, max_new_tokens=8100), "context"),
        "negative temperature": (pb.GenerateRequest(prompt="hi", temperature=-1.0, max_new_tokens=4), "temperature"),
        "NaN temperature": (pb.GenerateRequest(prompt="hi", temperature=float("nan"), max_new_tokens=4), "temperature"),
        "top_p zero": (pb.GenerateRequest(prompt="hi", top_p=0.0, max_new_tokens=4), "top_p"),
        "top_p above one": (pb.GenerateRequest(prompt="hi", top_p=1.5, max_new_tokens=4), "top_p"),
        "negative top_k": (pb.GenerateRequest(prompt="hi", top_k=-3, max_new_tokens=4), "top_k"),
        "unknown source": (pb.GenerateRequest(prompt="hi", max_new_tokens=4,
                                              speculation=pb.Speculation(sources=["nope"])), "speculation.sources"),
        "bad node budget": (pb.GenerateRequest(prompt="hi", max_new_tokens=4,
                                               speculation=pb.Speculation(max_nodes=100000)), "speculation.max_nodes"),
        "unknown policy": (pb.GenerateRequest(prompt="hi", max_new_tokens=4,
                                              speculation=pb.Speculation(policy="yolo")), "speculation.policy"),
        # all documents together: over limits.max_document_total_bytes at the router, and under it
        # but over limits.max_document_tokens (~200k tokens) at the verifier
        "documents over the byte total": (pb.GenerateRequest(prompt="hi", max_new_tokens=4, documents=[
            pb.Document(text="d" * 250_000)] * 5), "documents: "),
        "documents over the token cap": (pb.GenerateRequest(prompt="hi", max_new_tokens=4, documents=[
            pb.Document(text="word " * 50_000)] * 4), "documents: "),
    }
    return [pytest.param(req, needle, id=name) for name, (req, needle) in cases.items()]


@pytest.mark.parametrize("request_msg, needle", _bad_requests())
@pytest.mark.parametrize("rpc", ["Complete", "Generate"])
def test_bad_input_is_invalid_argument_and_the_service_keeps_serving(stub, rpc, request_msg, needle):
    with pytest.raises(grpc.RpcError) as info:
        if rpc == "Complete":
            stub.Complete(request_msg, metadata=AUTH, timeout=60)
        else:
            list(stub.Generate(request_msg, metadata=AUTH, timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert needle in info.value.details()


def test_service_still_serves_after_bad_input(stub):
    got = stub.Complete(chat("Say OK.", 4), metadata=AUTH, timeout=60)
    assert got.usage.completion_tokens >= 1


# ---------------------------------------------------------------------------- security
@pytest.mark.parametrize("metadata, reason", [
    ((), "missing"),
    ((("authorization", "Bearer wrong-key"),), "invalid API key"),
    ((("authorization", API_KEY),), "Bearer"),
])
def test_requests_without_a_valid_key_are_unauthenticated(stub, metadata, reason):
    with pytest.raises(grpc.RpcError) as info:
        stub.Complete(chat("hi", 4), metadata=metadata, timeout=30)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert reason in info.value.details() and API_KEY not in info.value.details()


def test_tls_gateway_in_front_of_the_mesh(mesh, tmp_path):
    """What `serve` runs when tls_cert/tls_key are set: the gateway before Serve's proxy."""
    from tls_certs import self_signed

    from draftmesh.client import MeshClient, build_request
    from draftmesh.router.tls_gateway import TlsGateway

    cert, key = self_signed("localhost")
    gateway = TlsGateway(mesh.address.replace("localhost", "127.0.0.1"), 0, cert, key).run_in_thread()
    try:
        with MeshClient(f"localhost:{gateway.port}", api_key=API_KEY, tls_ca=cert, timeout_s=60) as client:
            got = client.complete(build_request("Say OK.", max_new_tokens=4))
            assert got.usage.completion_tokens >= 1
            with pytest.raises(grpc.RpcError) as info:
                client.complete(build_request("", max_new_tokens=4))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        gateway.stop()


def test_the_gateway_cannot_be_bypassed_and_pins_the_app(mesh, stub):
    """Serve's plaintext proxy answers on loopback only; the gateway's port on every interface; a client's
    `application` header cannot pick another Serve app (issue 18)."""
    from draftmesh.router.loopback import non_loopback_addresses, reachable

    others = non_loopback_addresses()
    if not others:
        pytest.skip("this machine has no non-loopback address to test from")
    upstream_port = int(mesh.upstream_address.rsplit(":", 1)[1])
    public_port = int(mesh.address.rsplit(":", 1)[1])
    assert upstream_port != public_port and reachable("127.0.0.1", upstream_port)
    for address in others:
        assert reachable(address, public_port), address
        assert not reachable(address, upstream_port), f"Serve's proxy answers on {address}:{upstream_port}"
    got = stub.Complete(chat("Say OK.", 4), metadata=AUTH + (("application", "someone-elses-app"),), timeout=120)
    assert got.usage.completion_tokens >= 1


# ---------------------------------------------------------------------------- deadlines, cancellation, load
# Ray Serve 2.60's gRPC proxy sometimes loses a client's cancellation: when it arrives while the
# proxy is handing a message to the client, send_request_to_replica catches the GeneratorExit,
# yields again ("async generator ignored GeneratorExit") and never cancels the replica call, so
# the request runs to its end (measured: 1-2 of 20 cancels, with the code before and after the
# layout change alike; tools in the issue 15 note). Each check below therefore gets three tries
# on fresh prompts, and a lost cancellation is waited out so that it cannot leak into the tests
# after it; a router or verifier that never stops still fails every try.
LOST_CANCEL_TRIES = 3


def _stops_within_a_few_steps(start_request) -> bool:
    """Run one request that is cut short (``start_request(i)``); True when the verifier stopped."""
    for i in range(LOST_CANCEL_TRIES):
        before = verifier_stats()
        start_request(i)
        after = wait_idle()
        if after["active"] == 0:
            assert after["cancelled"] > before["cancelled"]
            assert after["steps"] - before["steps"] < 200  # stopped long before its 600 tokens
            return True
        wait_idle(timeout_s=120)  # the proxy lost this cancellation: let the request finish
    return False


ESSAY = "Write a long essay about the history of the bicycle{}."


def test_deadline_shorter_than_the_generation_frees_the_verifier(stub):
    def start(i):
        with pytest.raises(grpc.RpcError) as info:
            stub.Complete(chat(ESSAY.format(f", part {i}" if i else ""), 600), metadata=AUTH, timeout=1.5)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    assert _stops_within_a_few_steps(start)


def test_cancelled_stream_stops_the_verifier(stub):
    def start(i):
        call = stub.Generate(chat(ESSAY.format(f", chapter {i}" if i else ""), 600), metadata=AUTH, timeout=120)
        next(call)  # the first step arrived: the verifier is decoding
        call.cancel()

    assert _stops_within_a_few_steps(start)


def test_concurrent_clients_get_correct_outputs_and_excess_is_refused(stub, engine):
    prompts = [f"Count from {i} to {i + 6}, separated by commas." for i in range(MAX_IN_FLIGHT)]
    want = {p: list(in_process(engine, p, 24).token_ids) for p in prompts}
    with ThreadPoolExecutor(MAX_IN_FLIGHT) as pool:
        got = list(pool.map(lambda p: stub.Complete(chat(p, 24), metadata=AUTH, timeout=300), prompts))
    for p, g in zip(prompts, got):
        assert list(g.token_ids) == want[p], p

    # Beyond max_in_flight: refused at once with RESOURCE_EXHAUSTED, never queued without bound.
    codes = []
    lock = threading.Lock()

    def one(i):
        try:
            stub.Complete(chat(f"Write a story number {i}.", 48), metadata=AUTH, timeout=300)
            code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            code = exc.code()
        with lock:
            codes.append(code)

    with ThreadPoolExecutor(14) as pool:
        list(pool.map(one, range(14)))
    assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 1, codes
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
    assert codes.count(grpc.StatusCode.OK) >= MAX_IN_FLIGHT
    assert wait_idle()["active"] == 0


# ---------------------------------------------------------------------------- fact-check
FACTS = "Douglas Adams was born on 11 March 1952. Zorblax Quintavian was born on February 30, 2023."


def findings(report) -> set[tuple]:
    return {(a.check, a.rule, a.text, a.verdict, a.flagged, a.entity_id) for a in report.annotations}


def test_factcheck_rpc_flags_a_wrong_date_and_an_unknown_entity(stub):
    report = stub.FactCheck(pb.FactCheckRequest(text=FACTS, wait_ms=20_000), metadata=AUTH, timeout=60)
    assert report.status == "done", report
    got = findings(report)
    assert ("wikidata", "exists", "Douglas Adams", "supported", False, "Q42") in got
    assert ("wikidata", "birth_date", "11 March 1952", "supported", False, "Q42") in got
    assert ("wikidata", "exists", "Zorblax Quintavian", "not_found", True, "") in got
    assert ("date", "calendar", "February 30, 2023", "contradicted", True, "") in got
    assert all(FACTS[a.start:a.end] == a.text for a in report.annotations)
    # The same text again is the cached annotation; by id it is fetched without a recheck.
    again = stub.FactCheck(pb.FactCheckRequest(annotation_id=report.annotation_id), metadata=AUTH, timeout=60)
    assert again.status == "done" and findings(again) == got


@pytest.mark.parametrize("request_msg, code, needle", [
    (pb.FactCheckRequest(), grpc.StatusCode.INVALID_ARGUMENT, "give exactly one of text and annotation_id"),
    (pb.FactCheckRequest(text="x", wait_ms=99_999), grpc.StatusCode.INVALID_ARGUMENT, "wait_ms: must be <= 60000"),
])
def test_factcheck_rpc_bad_input(stub, request_msg, code, needle):
    with pytest.raises(grpc.RpcError) as info:
        stub.FactCheck(request_msg, metadata=AUTH, timeout=30)
    assert info.value.code() == code and needle in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        stub.FactCheck(pb.FactCheckRequest(text=FACTS), timeout=30)  # no key
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_generate_reports_the_output_factcheck(stub, engine):
    text = "Repeat exactly: " + FACTS
    got = stub.Complete(chat(text, 40, factcheck=pb.FactCheckOptions(wait_ms=20_000)), metadata=AUTH, timeout=120)
    assert list(got.token_ids) == list(in_process(engine, text, 40).token_ids)  # annotating changes nothing
    assert got.factcheck.status == "done", got.factcheck
    assert all(got.text[a.start:a.end] == a.text for a in got.factcheck.annotations)
    # The same checks as an on-demand FactCheck of the same text.
    direct = stub.FactCheck(pb.FactCheckRequest(text=got.text, wait_ms=20_000), metadata=AUTH, timeout=60)
    assert findings(direct) == findings(got.factcheck)
    fetched = stub.FactCheck(pb.FactCheckRequest(annotation_id=got.factcheck.annotation_id), metadata=AUTH, timeout=60)
    assert findings(fetched) == findings(got.factcheck)
    # Opting out, and not waiting.
    off = stub.Complete(chat(text, 8, factcheck=pb.FactCheckOptions(enabled=False)), metadata=AUTH, timeout=120)
    assert off.factcheck.status == "skipped" and not off.factcheck.annotations
    nowait = stub.Complete(chat(text, 8, factcheck=pb.FactCheckOptions(wait_ms=0)), metadata=AUTH, timeout=120)
    assert nowait.factcheck.status == "pending" and nowait.factcheck.annotation_id


def test_lossy_requests_send_their_drafts_to_the_factcheck_service(stub):
    doc = "Zorblax Quintavian was born on February 30, 2023 in the town of Quintavia, where he still lives."
    req = chat("Using the document, say where and when Zorblax Quintavian was born.", 40,
               documents=[pb.Document(id="d", text=doc)],
               speculation=pb.Speculation(policy="typical"), factcheck=pb.FactCheckOptions(wait_ms=20_000))
    got = stub.Complete(req, metadata=AUTH, timeout=120)
    assert not got.lossless and got.policy == "typical"
    assert got.factcheck.status == "done" and got.factcheck.drafts_submitted > 0, got.factcheck
    exact = stub.Complete(chat("Using the document, say where Zorblax lives.", 20, documents=[pb.Document(id="d", text=doc)]),
                          metadata=AUTH, timeout=120)
    assert exact.lossless and exact.factcheck.drafts_submitted == 0  # drafts matter only to lossy policies


# ---------------------------------------------------------------------------- traces and metrics
def test_one_request_is_one_trace_across_router_verifier_sources_and_factcheck(stub, otlp):
    trace_id, client_span = os.urandom(16).hex(), os.urandom(8).hex()
    metadata = AUTH + (("traceparent", f"00-{trace_id}-{client_span}-01"),)
    got = stub.Complete(chat("Repeat exactly: " + FACTS, 24, factcheck=pb.FactCheckOptions(wait_ms=20_000)),
                        metadata=metadata, timeout=120)
    assert got.factcheck.status == "done", got.factcheck

    def complete(spans):
        # Each process exports in batches, in the order its spans ended: the last span of each
        # process in, all of that process's earlier ones are in too.
        names = [s.name for s in spans if s.trace_id == trace_id]
        last = {"factcheck.annotate", "draft deployment boom", "draftmesh.v1.Generation/Complete", "factcheck.output"}
        return last <= set(names) and names.count("step") == got.usage.steps

    spans = [s for s in otlp.wait_for(complete, timeout_s=30) if s.trace_id == trace_id]
    by_id = {s.span_id: s for s in spans}
    named = lambda name: [s for s in spans if s.name == name]  # noqa: E731
    parent = lambda s: by_id.get(s.parent_id)  # noqa: E731

    (server,) = named("draftmesh.v1.Generation/Complete")
    assert server.service == "draftmesh-router" and server.parent_id == client_span  # the caller's traceparent
    assert server.kind == 2 and server.attributes["rpc.grpc.status_code"] == 0  # SERVER, OK
    assert server.attributes["draftmesh.tokens"] == len(got.token_ids)
    (decode,) = named("decode")
    assert decode.service == "draftmesh-verifier" and parent(decode) is server
    assert decode.attributes["draftmesh.steps"] == got.usage.steps and decode.attributes["draftmesh.lossless"] is True
    steps = named("step")
    assert len(steps) == got.usage.steps and all(parent(s) is decode for s in steps)
    assert sorted(s.attributes["draftmesh.step"] for s in steps) == list(range(1, len(steps) + 1))
    assert sum(s.attributes["draftmesh.emitted"] for s in steps) == len(got.token_ids)
    for name in ("draft", "verify"):
        assert {parent(s).name for s in named(name)} == {"step"}, name
    verified = sum(s.attributes["draftmesh.tree_size"] for s in named("verify"))
    assert verified == sum(s.attributes["draftmesh.tree_size"] for s in steps) > 0
    # Each source asked is a child of a step's draft span; a remote one continues in its own process.
    sources = {s.attributes["draftmesh.source"]: s for s in spans if s.name.startswith("source ")}
    assert {"history", "rules", "boom", "extern"} <= set(sources), sorted(sources)
    assert all(parent(s).name == "draft" for s in sources.values())
    (remote,) = named("draft deployment boom")[:1]
    assert remote.service == "draftmesh-draft" and parent(remote).name == "source boom"
    assert remote.status_code == 2  # the source raises: an error span
    # External gRPC sources: a client span (traceparent sent in metadata) under the source's span;
    # the address where nothing listens gives error spans with the gRPC code.
    calls = {}
    for s in spans:
        if s.name == "/draftmesh.v1.DraftSource/Propose":
            calls.setdefault(parent(s).name, []).append(s)
    assert set(calls) == {"source extern", "source down"}
    assert all(s.status_code != 2 for s in calls["source extern"])
    assert all(s.status_code == 2 and s.attributes["rpc.grpc.status_code"] == 14 for s in calls["source down"])
    # The fact-check of the output: submitted by the verifier, annotated by a worker process.
    (output,) = named("factcheck.output")
    assert output.service == "draftmesh-verifier" and output.attributes["draftmesh.factcheck.status"] == "done"
    annotate = named("factcheck.annotate")
    assert annotate and all(s.service == "draftmesh-factcheck" and parent(s).name == "factcheck.submit" for s in annotate)
    assert any(parent(parent(s)) is output for s in annotate)


def test_metrics_endpoint_counts_requests_steps_and_sources(mesh, stub):
    assert mesh.metrics_address
    before = scrape(mesh.metrics_address)
    ok = stub.Complete(chat(COPY_PROMPT, 24), metadata=AUTH, timeout=120)
    with pytest.raises(grpc.RpcError):
        stub.Complete(chat("hi", max_new_tokens=-1), metadata=AUTH, timeout=30)
    wanted = {
        ("ray_draftmesh_requests_total", (("method", "Complete"), ("code", "OK"))): 1,
        ("ray_draftmesh_requests_total", (("method", "Complete"), ("code", "INVALID_ARGUMENT"))): 1,
        ("ray_draftmesh_generated_tokens_total", (("policy", "exact"),)): len(ok.token_ids),
        ("ray_draftmesh_steps_total", ()): ok.usage.steps,
        ("ray_draftmesh_tokens_per_step_count", ()): ok.usage.steps,
    }
    deadline = time.monotonic() + 60
    while True:
        after = scrape(mesh.metrics_address)
        moved = {key: total(after, key[0], **dict(key[1])) - total(before, key[0], **dict(key[1])) for key in wanted}
        if all(moved[k] >= v for k, v in wanted.items()) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert all(moved[k] >= v for k, v in wanted.items()), moved
    accepted = sum(s.accepted_tokens for s in ok.sources)
    assert total(after, "ray_draftmesh_source_accepted_tokens_total") - total(before, "ray_draftmesh_source_accepted_tokens_total") >= accepted > 0
    for gauge in ("ray_draftmesh_router_in_flight", "ray_draftmesh_verifier_active_requests", "ray_draftmesh_factcheck_lag"):
        assert any(series.startswith(gauge) for series in after), gauge
    assert total(after, "ray_draftmesh_draft_seconds_count") > 0 and total(after, "ray_draftmesh_verify_seconds_count") > 0


def test_the_container_health_check_passes_against_the_real_mesh(mesh):
    from draftmesh.cli.health import check_health
    from draftmesh.router.app import APP_NAME

    status = check_health(mesh.address, timeout=10)
    assert status.healthy and APP_NAME in status.applications, status.message
    missing = check_health(mesh.address, application="not-deployed", timeout=10)
    assert not missing.healthy and "not-deployed" in missing.message


# ---------------------------------------------------------------------------- losing a replica (after the others)
@pytest.mark.breaks_mesh
def test_a_lost_verifier_replica_fails_its_request_cleanly_and_the_session_is_recomputed(stub, engine):
    import ray

    text = "Name three primary colours."
    first = stub.Complete(chat(text, 16, session_id="sess-lost"), metadata=AUTH, timeout=120)
    names = [a for a in ray.util.list_named_actors(all_namespaces=True)
             if "verifier" in a["name"] and a["name"].startswith("SERVE_REPLICA")]
    assert len(names) == 1, names
    replica = ray.get_actor(names[0]["name"], namespace=names[0]["namespace"])

    call = stub.Generate(chat("Write a long essay about the history of the bicycle.", 2000), metadata=AUTH, timeout=120)
    next(call)  # decoding on the replica we are about to lose
    ray.kill(replica, no_restart=True)
    with pytest.raises(grpc.RpcError) as info:
        for _ in call:
            pass
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()

    # Serve replaces the replica; the session's KV is gone, so it is recomputed: same output.
    again = stub.Complete(chat(text, 16, session_id="sess-lost"), metadata=AUTH, timeout=300)
    assert list(again.token_ids) == list(first.token_ids) == list(in_process(engine, text, 16).token_ids)
    assert again.replica != first.replica


# ---------------------------------------------------------------------------- losing Redis (the very last)
@pytest.mark.breaks_mesh
def test_without_redis_generation_goes_on_and_annotations_say_unavailable(mesh, stub, engine):
    mesh.redis.stop()
    text = "Name three primary colours."
    got = stub.Complete(chat(text, 16), metadata=AUTH, timeout=120)
    assert list(got.token_ids) == list(in_process(engine, text, 16).token_ids)
    assert got.factcheck.status == "unavailable"
    lossy = stub.Complete(chat(text, 16, speculation=pb.Speculation(policy="typical")), metadata=AUTH, timeout=120)
    assert lossy.factcheck.status == "unavailable" and lossy.lenient_tokens == 0  # unknown flags: exact only
    with pytest.raises(grpc.RpcError) as info:
        stub.FactCheck(pb.FactCheckRequest(text=FACTS), metadata=AUTH, timeout=30)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
