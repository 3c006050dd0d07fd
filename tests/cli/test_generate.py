"""`draftmesh generate` against a fake plaintext server (no Ray, no model)."""

from __future__ import annotations

import argparse
import json
import socket

import pytest

from draftmesh.cli.generate import add_generate_arguments, format_stats, run_generate_cli
from draftmesh.v1 import generation_pb2 as pb
from fake_generation import WORDS

pytestmark = pytest.mark.timeout(60)


def _parse(argv):
    parser = argparse.ArgumentParser(prog="draftmesh generate")
    add_generate_arguments(parser)
    return parser.parse_args(argv)


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
    from draftmesh.cli.generate import _request_from_args

    args = _parse(["--raw", "Fix: teh cat"])
    req = _request_from_args(args)
    assert req.prompt == "Fix: teh cat" and not req.messages
    chat_req = _request_from_args(_parse(["Fix: teh cat"]))
    assert not chat_req.prompt and chat_req.messages[0].content == "Fix: teh cat"
