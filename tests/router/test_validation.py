"""The router's request validation: every bad field is an InvalidRequest naming the field."""

from __future__ import annotations

import re

import pytest

from draftmesh.config import LimitsConfig, load_config
from draftmesh.io_struct import FactCheckOptions, SamplingParams, ServeRequest, SpeculationParams
from draftmesh.router.validation import InvalidRequest, parse_request
from draftmesh.tree import MAX_TREE_NODES
from draftmesh.v1 import generation_pb2 as pb

LIMITS = LimitsConfig(
    max_prompt_bytes=100, max_documents=2, max_document_bytes=50, max_stop_strings=2, default_max_new_tokens=64
)
SOURCES = ("history", "rules", "rag")
POLICIES = ("block", "exact", "nkl", "typical")


def parse(req: pb.GenerateRequest, **kwargs) -> ServeRequest:
    return parse_request(req, LIMITS, sources=SOURCES, policies=POLICIES, **kwargs)


def base(**fields) -> pb.GenerateRequest:
    fields.setdefault("prompt", "Hello there")
    return pb.GenerateRequest(**fields)


def chat(*turns) -> list[pb.ChatMessage]:
    return [pb.ChatMessage(role=r, content=c) for r, c in turns]


def spec(**fields) -> pb.Speculation:
    return pb.Speculation(**fields)


BAD = [
    # prompt / messages
    (dict(prompt="hi", messages=chat(("user", "hi"))), "prompt", "both set"),
    (dict(prompt=""), "prompt", "give prompt or messages"),
    (dict(prompt="   \n\t"), "prompt", "empty"),
    (dict(prompt="x" * 101), "prompt", "101 UTF-8 bytes exceeds the limit of 100"),
    (dict(prompt="é" * 51), "prompt", "102 UTF-8 bytes"),
    (dict(prompt="", messages=chat(("robot", "hi"))), "messages[0].role", "must be one of system, user, assistant"),
    (dict(prompt="", messages=chat(("user", "hi"), ("User", "x"))), "messages[1].role", "'User'"),
    (dict(prompt="", messages=chat(("system", "be nice"))), "messages", "at least one user message"),
    (dict(prompt="", messages=chat(("user", "hi"), ("assistant", "yo"), ("user", " "))), "messages[2].content", "empty"),
    (dict(prompt="", messages=chat(("system", "s" * 60), ("user", "u" * 41))), "messages", "101 UTF-8 bytes in all"),
    # max_new_tokens
    (dict(max_new_tokens=0), "max_new_tokens", "got 0"),
    (dict(max_new_tokens=-5), "max_new_tokens", "got -5"),
    (dict(max_new_tokens=2**31 - 1), "max_new_tokens", f"must be in [1, 8192], got {2**31 - 1}"),
    # sampling
    (dict(temperature=-0.5), "temperature", "got -0.5"),
    (dict(temperature=float("nan")), "temperature", "got nan"),
    (dict(temperature=float("inf")), "temperature", "got inf"),
    (dict(temperature=101.0), "temperature", "[0, 100]"),
    (dict(top_p=0.0), "top_p", "(0, 1]"),
    (dict(top_p=1.5), "top_p", "got 1.5"),
    (dict(top_p=-0.1), "top_p", "(0, 1]"),
    (dict(top_p=float("nan")), "top_p", "got nan"),
    (dict(top_k=-1), "top_k", "got -1"),
    (dict(top_k=2_000_000), "top_k", "got 2000000"),
    # stop
    (dict(stop=[b"a", b"b", b"c"]), "stop", "at most 2 stop strings, got 3"),
    (dict(stop=[b"ok", b"bad\xffx"]), "stop[1]", "not valid UTF-8 (byte 0xff at offset 3)"),
    (dict(stop=[b"\xc3"]), "stop[0]", "not valid UTF-8 (byte 0xc3 at offset 0)"),
    (dict(stop=[b""]), "stop[0]", "must not be empty"),
    (dict(stop=[b"x" * 257]), "stop[0]", "257 bytes exceeds the limit of 256"),
    # documents
    (dict(documents=[pb.Document(text="a")] * 3), "documents", "at most 2 documents, got 3"),
    (dict(documents=[pb.Document(text="ok"), pb.Document(text="")]), "documents[1].text", "empty"),
    (dict(documents=[pb.Document(text="  ")]), "documents[0].text", "empty"),
    (dict(documents=[pb.Document(text="d" * 51)]), "documents[0].text", "51 UTF-8 bytes exceeds the limit of 50"),
    (dict(documents=[pb.Document(text="a\x00b")]), "documents[0].text", "NUL"),
    (dict(documents=[pb.Document(id="x\ny", text="ok")]), "documents[0].id", "printable"),
    # ids
    (dict(session_id="s" * 129), "session_id", "at most 128 characters, got 129"),
    (dict(session_id="abc\x07"), "session_id", "U+0007"),
    (dict(request_id="r" * 200), "request_id", "at most 128 characters"),
    (dict(request_id="a\tb"), "request_id", "printable"),
    # speculation
    (dict(speculation=spec(sources=["history", "llm"])), "speculation.sources[1]",
     "unknown draft source 'llm'; this mesh serves: history, rules, rag"),
    (dict(speculation=spec(sources=["rag", "rag"])), "speculation.sources[1]", "listed twice"),
    (dict(speculation=spec(source_caps={"nope": 3})), "speculation.source_caps[nope]", "unknown draft source"),
    (dict(speculation=spec(source_caps={"rag": 1000})), "speculation.source_caps[rag]", "must be an integer in [0, 256], got 1000"),
    (dict(speculation=spec(max_nodes=MAX_TREE_NODES + 1)), "speculation.max_nodes",
     f"must be an integer in [0, {MAX_TREE_NODES}], got {MAX_TREE_NODES + 1}"),
    (dict(speculation=spec(policy="yolo")), "speculation.policy", "available: block, exact, nkl, typical"),
    (dict(speculation=spec(policy="typical", policy_params={"": "1"})), "speculation.policy_params", "names"),
    (dict(speculation=spec(policy="typical", policy_params={f"k{i}": "1" for i in range(17)})),
     "speculation.policy_params", "at most 16 parameters, got 17"),
    (dict(speculation=spec(policy="typical", policy_params={"epsilon": "1e999"})),
     "speculation.policy_params[epsilon]", "out of range"),
    (dict(speculation=spec(policy="typical", policy_params={"epsilon": "v" * 300})),
     "speculation.policy_params[epsilon]", "limit is 256"),
    (dict(speculation=spec(policy_params={"epsilon": "0.3"})), "speculation.policy_params", "exact policy takes no"),
]


@pytest.mark.parametrize("fields, field, rule", BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_bad_requests_name_the_field_and_rule(fields, field, rule):
    with pytest.raises(InvalidRequest) as err:
        parse(base(**fields))
    assert err.value.field == field
    assert rule in err.value.rule
    assert str(err.value) == f"{field}: {err.value.rule}"
    assert isinstance(err.value, ValueError)


def test_message_format_example():
    with pytest.raises(InvalidRequest, match=re.escape(f"speculation.max_nodes: must be an integer in [0, {MAX_TREE_NODES}], got 5000")):
        parse(base(speculation=spec(max_nodes=5000)))


def test_unknown_source_with_no_sources_served():
    with pytest.raises(InvalidRequest, match="this mesh serves: none"):
        parse_request(base(speculation=spec(sources=["rag"])), LIMITS, sources=(), policies=POLICIES)


def test_defaults():
    out = parse(base())
    assert out == ServeRequest(request_id=out.request_id, prompt="Hello there", max_new_tokens=64)
    assert re.fullmatch(r"[0-9a-f]{32}", out.request_id)
    assert out.messages is None and out.sampling == SamplingParams() and out.session_id is None
    assert out.speculation == SpeculationParams() and out.factcheck_options == FactCheckOptions()
    assert (out.sampling.temperature, out.sampling.top_p, out.sampling.top_k) == (0.0, 1.0, 0)
    assert parse(base()).request_id != out.request_id


def test_request_id_precedence():
    assert parse(base(request_id="client-1"), request_id="server-1").request_id == "client-1"
    assert parse(base(), request_id="server-1").request_id == "server-1"
    assert len(parse(base(), request_id="").request_id) == 32
    with pytest.raises(InvalidRequest, match="request_id"):
        parse(base(), request_id="bad\x00id")


def test_full_request_round_trip():
    req = pb.GenerateRequest(
        messages=chat(("system", "Be brief."), ("user", "Fix: teh cat"), ("assistant", "the cat"), ("user", "again")),
        max_new_tokens=128,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        seed=2**64 - 1,
        stop=["\n\n".encode(), "ünd".encode()],
        session_id="sess-42",
        documents=[pb.Document(id="d1", text="The cat sat."), pb.Document(text="Ünïcödé passage")],
        speculation=pb.Speculation(
            enabled=False,
            sources=["rag", "history"],
            source_caps={"rag": 16, "history": 0},
            max_nodes=0,
            policy="typical",
            policy_params={"epsilon": "0.3", "delta": "1", "flag": "TRUE", "mode": "fast", "neg": "-2.5e-1"},
        ),
        request_id="req-1",
    )
    out = parse(req)
    assert out == ServeRequest(
        request_id="req-1",
        prompt=None,
        messages=(("system", "Be brief."), ("user", "Fix: teh cat"), ("assistant", "the cat"), ("user", "again")),
        max_new_tokens=128,
        sampling=SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=2**64 - 1),
        stop=("\n\n", "ünd"),
        session_id="sess-42",
        documents=("The cat sat.", "Ünïcödé passage"),
        speculation=SpeculationParams(
            enabled=False,
            sources=("rag", "history"),
            source_caps={"history": 0, "rag": 16},
            max_nodes=0,
            policy="typical",
            policy_params={"epsilon": 0.3, "delta": 1, "flag": True, "mode": "fast", "neg": -0.25},
        ),
    )
    assert type(out.speculation.policy_params["delta"]) is int
    assert isinstance(out.messages, tuple) and all(isinstance(m, tuple) for m in out.messages)


def test_limits_at_the_edge_are_accepted():
    out = parse(base(
        prompt="x" * 100,
        max_new_tokens=8192,
        temperature=100.0,
        top_p=1.0,
        top_k=0,
        stop=[b"a", b"x" * 256],
        documents=[pb.Document(text="d" * 50)] * 2,
        session_id="s" * 128,
        speculation=spec(enabled=True, max_nodes=MAX_TREE_NODES, source_caps={"rules": 256}),
    ))
    assert out.max_new_tokens == 8192 and out.speculation.max_nodes == MAX_TREE_NODES and out.speculation.enabled
    assert out.speculation.source_caps == {"rules": 256} and len(out.documents) == 2
    assert out.sampling.temperature == 100.0


def test_policy_is_exact_when_empty_even_if_not_listed():
    assert parse_request(base(), LIMITS, sources=SOURCES, policies=()).speculation.policy == "exact"


def test_messages_may_end_with_assistant_prefill():
    out = parse(base(prompt="", messages=chat(("user", "Say hi"), ("assistant", ""))))
    assert out.messages == (("user", "Say hi"), ("assistant", ""))


def test_every_limit_comes_from_the_config():
    """The limits section is the one source of the front door's bounds (none is a constant here)."""
    cfg = load_config(env={}, overrides={"limits.max_id_chars": 4, "limits.max_stop_bytes": 3,
                                         "limits.max_policy_params": 1, "limits.max_factcheck_wait_ms": 10,
                                         "limits.max_new_tokens_cap": 100, "limits.default_max_new_tokens": 50})
    lim = cfg.limits

    def refused(req, field, rule):
        with pytest.raises(InvalidRequest) as err:
            parse_request(req, lim, sources=SOURCES, policies=POLICIES)
        assert err.value.field == field and rule in err.value.rule

    assert parse_request(base(), lim, sources=SOURCES, policies=POLICIES).max_new_tokens == 50
    refused(base(session_id="abcde"), "session_id", "at most 4 characters")
    refused(base(request_id="abcde"), "request_id", "at most 4 characters")
    refused(base(stop=[b"abcd"]), "stop[0]", "exceeds the limit of 3")
    refused(base(max_new_tokens=101), "max_new_tokens", "[1, 100]")
    refused(base(speculation=spec(policy="typical", policy_params={"epsilon": "0.1", "delta": "0.2"})),
            "speculation.policy_params", "at most 1 parameters")
    refused(base(factcheck=pb.FactCheckOptions(wait_ms=11)), "factcheck.wait_ms", "must be <= 10")
    with pytest.raises(ValueError, match="default_max_new_tokens"):
        LimitsConfig(default_max_new_tokens=9000)


# ---------------------------------------------------------------------- fact-check
def test_factcheck_options_default_and_explicit():
    assert parse(base()).factcheck_options == FactCheckOptions(enabled=True, wait_ms=None)
    req = parse(base(factcheck=pb.FactCheckOptions(enabled=False, wait_ms=0)))
    assert req.factcheck_options == FactCheckOptions(enabled=False, wait_ms=0)
    req = parse(base(factcheck=pb.FactCheckOptions(wait_ms=60_000)))
    assert req.factcheck_options == FactCheckOptions(enabled=True, wait_ms=60_000)


def test_factcheck_wait_beyond_the_cap_is_invalid():
    with pytest.raises(InvalidRequest, match=r"^factcheck\.wait_ms: must be <= 60000, got 60001$"):
        parse(base(factcheck=pb.FactCheckOptions(wait_ms=60_001)))


@pytest.mark.parametrize(
    "fields, field, rule",
    [
        (dict(), "text", "give exactly one of text and annotation_id"),
        (dict(text="a", annotation_id="b"), "text", "give exactly one of text and annotation_id"),
        (dict(text="x" * 101), "text", "is 101 bytes; the limit is 100"),
        (dict(text=" \n "), "text", "is blank"),
        (dict(annotation_id="a\x00b"), "annotation_id", "must be printable"),
        (dict(text="ok", wait_ms=70_000), "wait_ms", "must be <= 60000"),
    ],
)
def test_bad_factcheck_requests_name_the_field(fields, field, rule):
    from draftmesh.router.validation import parse_factcheck

    with pytest.raises(InvalidRequest) as info:
        parse_factcheck(pb.FactCheckRequest(**fields), LIMITS)
    assert info.value.field == field and rule in info.value.rule


def test_good_factcheck_requests():
    from draftmesh.router.validation import parse_factcheck

    assert parse_factcheck(pb.FactCheckRequest(text="Ada was born in 1815."), LIMITS) == ("Ada was born in 1815.", "", None)
    assert parse_factcheck(pb.FactCheckRequest(annotation_id="out:abc", wait_ms=5), LIMITS) == ("", "out:abc", 5)
