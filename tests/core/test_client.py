"""MeshClient and build_request against a fake plaintext server (no Ray, no model)."""

from __future__ import annotations

import grpc
import pytest

from draftmesh.client import MeshClient, build_request
from draftmesh.v1 import generation_pb2 as pb
from fake_generation import WORDS

pytestmark = pytest.mark.timeout(60)


# --------------------------------------------------------------------------- build_request


def test_build_request_encodes_everything():
    req = build_request(
        "Fix: teh cat",
        max_new_tokens=32,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        seed=7,
        stop=["\n\n", "END", b"\xff"],
        session_id="s1",
        documents=["first passage", ("wiki", "second passage"), {"id": "d3", "text": "third"}],
        speculate=True,
        sources="history, rules",
        max_nodes=0,
        policy="typical",
        policy_params={"epsilon": 0.3},
        source_caps={"rag": 8},
        request_id="rid",
    )
    assert req.prompt == "Fix: teh cat" and not req.messages
    assert req.max_new_tokens == 32 and req.top_k == 40 and req.seed == 7
    assert req.temperature == pytest.approx(0.7) and req.top_p == pytest.approx(0.9)
    assert list(req.stop) == [b"\n\n", b"END", b"\xff"]
    assert req.session_id == "s1" and req.request_id == "rid"
    assert [(d.id, d.text) for d in req.documents] == [
        ("0", "first passage"), ("wiki", "second passage"), ("d3", "third")
    ]
    spec = req.speculation
    assert spec.HasField("enabled") and spec.enabled
    assert list(spec.sources) == ["history", "rules"]
    assert spec.HasField("max_nodes") and spec.max_nodes == 0  # 0 (plain) is not "unset"
    assert spec.policy == "typical"
    assert dict(spec.policy_params) == {"epsilon": "0.3"}
    assert dict(spec.source_caps) == {"rag": 8}
    # Round-trips through the wire format.
    assert pb.GenerateRequest.FromString(req.SerializeToString()) == req


def test_build_request_leaves_unset_fields_unset():
    req = build_request("hi")
    for field in ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "speculation"):
        assert not req.HasField(field), field
    assert not list(req.stop) and not list(req.documents)

    req = build_request(messages=[{"role": "system", "content": "be brief"}, ("user", "hi")], speculate=False,
                        sources=["llm"])
    assert req.prompt == ""
    assert [(m.role, m.content) for m in req.messages] == [("system", "be brief"), ("user", "hi")]
    assert req.speculation.HasField("enabled") and not req.speculation.enabled
    assert list(req.speculation.sources) == ["llm"]
    assert not req.speculation.HasField("max_nodes")


def test_build_request_rejects_bad_input():
    with pytest.raises(ValueError, match="exactly one"):
        build_request("hi", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="exactly one"):
        build_request()
    with pytest.raises(ValueError, match="messages\\[0\\]"):
        build_request(messages=[{"role": "user"}])
    with pytest.raises(ValueError, match="seed"):
        build_request("hi", seed=-1)


# --------------------------------------------------------------------------- MeshClient


def test_client_complete_and_generate(upstream):
    addr, servicer = upstream
    with MeshClient(addr, api_key="k1", timeout_s=10) as client:
        result = client.complete(build_request("hi", max_new_tokens=4))
        assert result.text == "The cat sat. auth=Bearer k1"
        responses = list(client.generate(build_request("hi")))
    assert [r.delta.text for r in responses[:-1]] == WORDS
    assert responses[-1].WhichOneof("event") == "result"
    assert servicer.requests[0].max_new_tokens == 4
    assert all(md["authorization"] == "Bearer k1" for md in servicer.metadata)

    with MeshClient(addr, application="draftmesh") as client:
        assert client.complete(build_request("hi")).text.endswith("auth=none")
    assert "authorization" not in servicer.metadata[-1]
    assert servicer.metadata[-1]["application"] == "draftmesh"


def test_client_errors_are_rpc_errors(upstream):
    addr, _ = upstream
    with MeshClient(addr, timeout_s=10) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.complete(build_request("bad"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "max_new_tokens: must be >= 1"
