"""MeshClient, build_request and `draftmesh generate` against a fake plaintext server (no Ray, no model)."""

from __future__ import annotations

import argparse
import json
import socket
from concurrent import futures

import grpc
import pytest

from draftmesh.client import MeshClient, add_generate_arguments, build_request, format_stats, run_generate_cli
from draftmesh.v1 import generation_pb2 as pb
from draftmesh.v1 import generation_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(60)

WORDS = ["The", " cat", " sat", "."]


def _prompt_of(request: pb.GenerateRequest) -> str:
    return request.prompt or (request.messages[-1].content if request.messages else "")


class FakeGeneration(pb_grpc.GenerationServicer):
    def __init__(self):
        self.requests: list[pb.GenerateRequest] = []
        self.metadata: list[dict] = []

    def _enter(self, request, context):
        md = dict(context.invocation_metadata())
        self.requests.append(request)
        self.metadata.append(md)
        if _prompt_of(request) == "bad":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens: must be >= 1")
        if _prompt_of(request) == "boom":
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "server busy")
        return md

    def _result(self, md) -> pb.GenerateResult:
        return pb.GenerateResult(
            request_id="r1",
            text="".join(WORDS) + f" auth={md.get('authorization', 'none')}",
            token_ids=[1, 2, 3, 4, 5],
            finish_reason="stop",
            usage=pb.Usage(prompt_tokens=7, completion_tokens=5, steps=2, cached_prompt_tokens=3),
            sources=[
                pb.SourceStats(source="history", nodes=10, accepted_tokens=4, acceptance=0.4, failed_steps=0),
                pb.SourceStats(source="rules", nodes=3, accepted_tokens=0, acceptance=0.0, failed_steps=1),
            ],
            mean_accepted_per_step=2.5,
            policy="exact",
            lossless=True,
            seconds=0.25,
            first_token_ms=17.25,
            replica="verifier-7",
        )

    def Generate(self, request, context):
        md = self._enter(request, context)
        if _prompt_of(request) == "noresult":
            yield pb.GenerateResponse(delta=pb.GenerateDelta(text="x"))
            return
        for i, word in enumerate(WORDS):
            yield pb.GenerateResponse(delta=pb.GenerateDelta(text=word, token_ids=[i]))
        yield pb.GenerateResponse(result=self._result(md))

    def Complete(self, request, context):
        return self._result(self._enter(request, context))


@pytest.fixture
def upstream():
    servicer = FakeGeneration()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    pb_grpc.add_GenerationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(0)


def _parse(argv):
    parser = argparse.ArgumentParser(prog="draftmesh generate")
    add_generate_arguments(parser)
    return parser.parse_args(argv)


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


# --------------------------------------------------------------------------- the CLI


def test_cli_stream_prints_deltas_and_stats(upstream, capsys, tmp_path):
    addr, servicer = upstream
    (tmp_path / "notes.txt").write_text("the cat sat on the mat")
    args = _parse(["--addr", addr, "--stream", "--api-key", "k2", "--max-new-tokens", "16",
                   "--temperature", "0.5", "--top-p", "0.9", "--top-k", "5", "--seed", "3",
                   "--stop", "END", "--stop", "\n\n", "--session-id", "s9", "--sources", "history,rules",
                   "--policy", "exact", "--document", str(tmp_path / "notes.txt"), "--timeout", "10",
                   "Tell me"])
    assert run_generate_cli(args) == 0
    out, err = capsys.readouterr()
    assert out == "".join(WORDS) + "\n"
    assert "tokens: 5" in err and "tok/s: 20.0" in err and "steps: 2" in err
    assert "accepted/step: 2.50" in err and "finish: stop" in err
    assert "history" in err and "rules" in err and "0.400" in err
    assert "exact (lossless)" in err and "first token: 17.2" in err and "verifier-7" in err
    assert "3 from session cache" in err

    req = servicer.requests[-1]
    assert not req.prompt and [(m.role, m.content) for m in req.messages] == [("user", "Tell me")]
    assert req.max_new_tokens == 16 and req.top_k == 5 and req.seed == 3
    assert list(req.stop) == [b"END", b"\n\n"]
    assert req.session_id == "s9"
    assert list(req.speculation.sources) == ["history", "rules"]
    assert not req.speculation.HasField("enabled")
    assert [(d.id, d.text) for d in req.documents] == [("notes.txt", "the cat sat on the mat")]
    assert servicer.metadata[-1]["authorization"] == "Bearer k2"


def test_cli_complete_messages_and_env_api_key(upstream, capsys, tmp_path, monkeypatch):
    addr, servicer = upstream
    monkeypatch.setenv("DRAFTMESH_API_KEY", "from-env")
    msgs = tmp_path / "chat.json"
    msgs.write_text(json.dumps([{"role": "system", "content": "terse"}, {"role": "user", "content": "hi"}]))
    assert run_generate_cli(_parse(["--addr", addr, "--messages", str(msgs), "--no-speculate"])) == 0
    out, err = capsys.readouterr()
    assert out == "The cat sat. auth=Bearer from-env\n"
    assert "finish: stop" in err and "replica: verifier-7" in err
    req = servicer.requests[-1]
    assert [(m.role, m.content) for m in req.messages] == [("system", "terse"), ("user", "hi")]
    assert req.speculation.HasField("enabled") and not req.speculation.enabled

    # A prompt given with --messages is the final user turn.
    assert run_generate_cli(_parse(["--addr", addr, "--messages", str(msgs), "and then?"])) == 0
    assert servicer.requests[-1].messages[-1].content == "and then?"


@pytest.mark.parametrize("stream", [False, True])
def test_cli_error_exit_codes(upstream, capsys, stream):
    addr, _ = upstream
    flags = ["--stream"] if stream else []
    assert run_generate_cli(_parse(["--addr", addr, *flags, "bad"])) == 2
    assert "error: INVALID_ARGUMENT: max_new_tokens: must be >= 1" in capsys.readouterr().err
    assert run_generate_cli(_parse(["--addr", addr, *flags, "boom"])) == 1
    assert "error: RESOURCE_EXHAUSTED: server busy" in capsys.readouterr().err


def test_cli_stream_without_result_fails(upstream, capsys):
    addr, _ = upstream
    assert run_generate_cli(_parse(["--addr", addr, "--stream", "noresult"])) == 1
    out, err = capsys.readouterr()
    assert out == "x\n" and "without a result" in err


def test_cli_unreachable_server_is_unavailable(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    assert run_generate_cli(_parse(["--addr", dead, "--timeout", "5", "hi"])) == 1
    assert "error: UNAVAILABLE:" in capsys.readouterr().err


def test_cli_usage_errors(capsys, tmp_path):
    assert run_generate_cli(_parse([])) == 2
    assert "give a prompt" in capsys.readouterr().err
    assert run_generate_cli(_parse(["--messages", str(tmp_path / "nope.json")])) == 2
    assert "file not found" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text('{"role": "user"}')
    assert run_generate_cli(_parse(["--messages", str(tmp_path / "bad.json")])) == 2
    assert "JSON list" in capsys.readouterr().err
    assert run_generate_cli(_parse(["--document", str(tmp_path / "missing.txt"), "hi"])) == 2
    assert "--document: file not found" in capsys.readouterr().err
    assert run_generate_cli(_parse(["--tls-ca", str(tmp_path / "ca.pem"), "hi"])) == 2
    assert "--tls-ca" in capsys.readouterr().err


def test_format_stats_marks_lossy_results():
    result = pb.GenerateResult(policy="typical", lossless=False, lenient_tokens=4, finish_reason="length",
                               usage=pb.Usage(completion_tokens=8, steps=4), seconds=0.0)
    text = format_stats(result, wall_s=2.0)
    assert "LOSSY, 4 lenient tokens" in text and "tok/s: 4.0" in text and "steps: 4" in text


def test_cli_raw_sends_the_prompt_without_chat_template():
    from draftmesh.client import _request_from_args

    args = _parse(["--raw", "Fix: teh cat"])
    req = _request_from_args(args)
    assert req.prompt == "Fix: teh cat" and not req.messages
    chat_req = _request_from_args(_parse(["Fix: teh cat"]))
    assert not chat_req.prompt and chat_req.messages[0].content == "Fix: teh cat"
