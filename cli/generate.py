"""`draftmesh generate`: send one request to a running mesh, print the answer and its stats."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import grpc

from draftmesh import tracing
from draftmesh.client import API_KEY_ENV, DEFAULT_ADDR, MeshClient, api_key_from_env, build_request
from draftmesh.v1 import generation_pb2 as pb


class CliError(Exception):
    """A usage error of `draftmesh generate` (exit code 2)."""


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `draftmesh generate`."""
    parser.add_argument(
        "prompt", nargs="?", default=None,
        help="the prompt, sent as a user turn (chat template applied; '-' reads stdin); with --messages it is "
        "appended as the final user turn",
    )
    parser.add_argument("--raw", action="store_true", help="send the prompt as raw text, without the chat template")
    parser.add_argument("--addr", default=DEFAULT_ADDR, help=f"server host:port (default {DEFAULT_ADDR})")
    parser.add_argument("--stream", action="store_true", help="stream text as it is generated (Generate)")
    parser.add_argument("--messages", metavar="FILE.json", help="chat messages: a JSON list of {role, content}")
    parser.add_argument(
        "--document", dest="documents", metavar="FILE", action="append", default=[],
        help="a text file the rag source may draft from (repeatable)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=None, help="0 or unset = greedy")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", metavar="S", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--session-id", default="", help="share history drafts / KV cache across requests")
    parser.add_argument("--no-speculate", action="store_true", help="plain decoding (the baseline)")
    parser.add_argument("--sources", default="", help="draft sources to ask, comma-separated (default: all)")
    parser.add_argument("--max-nodes", type=int, default=None, help="token-tree node cap per step")
    parser.add_argument("--policy", default="", help="acceptance policy (default exact = lossless)")
    parser.add_argument("--no-factcheck", action="store_true", help="do not fact-check the output")
    parser.add_argument("--factcheck-wait-ms", type=int, default=None,
                        help="how long the result may wait for the output's fact-check")
    parser.add_argument(
        "--api-key", default=None, help=f"API key sent as a bearer token (default: ${API_KEY_ENV})"
    )
    parser.add_argument("--tls-ca", metavar="FILE", default=None, help="PEM CA/certificate to trust; enables TLS")
    parser.add_argument("--application", default=None, help="Ray Serve application name (multi-app setups)")
    parser.add_argument("--timeout", type=float, default=None, help="deadline in seconds")


def _load_messages(path: str) -> list[dict[str, str]]:
    try:
        data = json.loads(Path(path).expanduser().read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise CliError(f"--messages: file not found: {path}") from exc
    except OSError as exc:
        raise CliError(f"--messages: cannot read {path}: {exc.strerror or exc}") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CliError(f"--messages: {path} is not valid JSON: {exc}") from exc
    if isinstance(data, Mapping) and "messages" in data:
        data = data["messages"]
    if not isinstance(data, list) or not data:
        raise CliError(f"--messages: {path} must hold a non-empty JSON list of {{role, content}} objects")
    for i, m in enumerate(data):
        if not (isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise CliError(f"--messages: item {i} of {path} must be an object with string 'role' and 'content'")
    return [{"role": m["role"], "content": m["content"]} for m in data]


def _load_documents(paths: Sequence[str]) -> list[pb.Document]:
    docs = []
    for path in paths:
        p = Path(path).expanduser()
        try:
            text = p.read_text(encoding="utf-8")
        except FileNotFoundError as exc:
            raise CliError(f"--document: file not found: {path}") from exc
        except (OSError, UnicodeDecodeError) as exc:
            raise CliError(f"--document: cannot read {path} as UTF-8 text: {exc}") from exc
        docs.append(pb.Document(id=p.name, text=text))
    return docs


def _request_from_args(args: argparse.Namespace) -> pb.GenerateRequest:
    prompt = getattr(args, "prompt", None)
    if prompt == "-":
        prompt = sys.stdin.read()
    messages = None
    if getattr(args, "messages", None):
        messages = _load_messages(args.messages)
        if prompt is not None:
            messages.append({"role": "user", "content": prompt})
            prompt = None
    elif prompt is None:
        raise CliError("give a prompt (or --messages FILE.json)")
    elif not getattr(args, "raw", False):
        messages, prompt = [{"role": "user", "content": prompt}], None
    try:
        return build_request(
            prompt,
            messages=messages,
            max_new_tokens=getattr(args, "max_new_tokens", None),
            temperature=getattr(args, "temperature", None),
            top_p=getattr(args, "top_p", None),
            top_k=getattr(args, "top_k", None),
            seed=getattr(args, "seed", None),
            stop=getattr(args, "stop", None) or (),
            session_id=getattr(args, "session_id", "") or "",
            documents=_load_documents(getattr(args, "documents", None) or ()),
            speculate=False if getattr(args, "no_speculate", False) else None,
            sources=getattr(args, "sources", "") or "",
            max_nodes=getattr(args, "max_nodes", None),
            policy=getattr(args, "policy", "") or "",
            factcheck=False if getattr(args, "no_factcheck", False) else None,
            factcheck_wait_ms=getattr(args, "factcheck_wait_ms", None),
        )
    except ValueError as exc:
        raise CliError(str(exc)) from exc


def _client_from_args(args: argparse.Namespace) -> MeshClient:
    tls_ca = None
    if getattr(args, "tls_ca", None):
        try:
            tls_ca = Path(args.tls_ca).expanduser().read_bytes()
        except OSError as exc:
            raise CliError(f"--tls-ca: cannot read {args.tls_ca}: {exc.strerror or exc}") from exc
    api_key = api_key_from_env(getattr(args, "api_key", None))
    return MeshClient(
        getattr(args, "addr", None) or DEFAULT_ADDR,
        api_key=api_key,
        tls_ca=tls_ca,
        timeout_s=getattr(args, "timeout", None),
        application=getattr(args, "application", None),
    )


def format_stats(result: pb.GenerateResult, *, wall_s: float | None = None) -> str:
    """A short human-readable summary of a GenerateResult (what `draftmesh generate` prints)."""
    tokens = result.usage.completion_tokens or len(result.token_ids)
    steps = result.usage.steps
    seconds = result.seconds if result.seconds > 0 else (wall_s or 0.0)
    tok_s = tokens / seconds if seconds > 0 else 0.0
    lines = [
        f"tokens: {tokens}  tok/s: {tok_s:.1f}  steps: {steps}  "
        f"accepted/step: {result.mean_accepted_per_step:.2f}  finish: {result.finish_reason or '?'}"
    ]
    prompt_line = f"prompt tokens: {result.usage.prompt_tokens}"
    if result.usage.cached_prompt_tokens:
        prompt_line += f" ({result.usage.cached_prompt_tokens} from session cache)"
    lines.append(prompt_line)
    if result.sources:
        width = max(6, *(len(s.source) for s in result.sources))
        lines.append(f"  {'source':<{width}}  {'nodes':>7}  {'accepted':>8}  {'acceptance':>10}  {'failed':>6}")
        for s in result.sources:
            lines.append(
                f"  {s.source:<{width}}  {s.nodes:>7}  {s.accepted_tokens:>8}  "
                f"{s.acceptance:>10.3f}  {s.failed_steps:>6}"
            )
    policy = result.policy or "exact"
    lossless = "lossless" if result.lossless else f"LOSSY, {result.lenient_tokens} lenient tokens"
    lines.append(
        f"policy: {policy} ({lossless})  first token: {result.first_token_ms:.1f} ms  "
        f"replica: {result.replica or '?'}"
    )
    if result.HasField("factcheck"):
        lines.append(format_factcheck(result.factcheck))
    return "\n".join(lines)


def format_factcheck(report: pb.FactCheckReport) -> str:
    """The fact-check report: status, then one line per finding (flagged ones marked '!')."""
    head = f"fact-check: {report.status}"
    if report.annotation_id:
        head += f"  id: {report.annotation_id}"
    if report.drafts_submitted or report.drafts_skipped or report.flagged_steps:
        head += (f"  drafts sent: {report.drafts_submitted}  skipped: {report.drafts_skipped}  "
                 f"steps with flags: {report.flagged_steps}")
    if report.error:
        head += f"  ({report.error})"
    lines = [head]
    for a in report.annotations:
        mark = "!" if a.flagged else " "
        what = " ".join(x for x in (a.label, a.rule, a.entity_id) if x)
        lines.append(f"  {mark} [{a.start}:{a.end}] {a.text!r} {a.check}/{a.verdict} ({what}) {a.evidence}".rstrip())
    return "\n".join(lines)


def _print_error(message: str, *, newline_first: bool = False) -> None:
    if newline_first:
        sys.stdout.write("\n")
        sys.stdout.flush()
    print(f"error: {message}", file=sys.stderr)


def run_generate_cli(args: argparse.Namespace) -> int:
    """The body of `draftmesh generate`. Exit codes: 0 ok, 2 bad input (INVALID_ARGUMENT
    or a usage error), 1 any other failure, 130 interrupted."""
    try:
        request = _request_from_args(args)
        tracing.setup_tracing("client")
        client = _client_from_args(args)
    except (CliError, ValueError) as exc:  # ValueError: a bad OTEL_* setting
        _print_error(str(exc))
        return 2

    printed = False
    call = None
    t0 = time.perf_counter()
    try:
        with client:
            if getattr(args, "stream", False):
                result = None
                call = client.generate(request)
                for response in call:
                    kind = response.WhichOneof("event")
                    if kind == "delta":
                        if response.delta.text:
                            sys.stdout.write(response.delta.text)
                            sys.stdout.flush()
                            printed = True
                    elif kind == "result":
                        result = response.result
                if result is None:
                    _print_error("the stream ended without a result", newline_first=printed)
                    return 1
                sys.stdout.write("\n")
                sys.stdout.flush()
            else:
                result = client.complete(request)
                sys.stdout.write(result.text + "\n")
                sys.stdout.flush()
            print(format_stats(result, wall_s=time.perf_counter() - t0), file=sys.stderr)
            return 0
    except grpc.RpcError as exc:
        code = exc.code() if hasattr(exc, "code") else None
        details = exc.details() if hasattr(exc, "details") else str(exc)
        name = code.name if code is not None else "UNKNOWN"
        _print_error(f"{name}: {details}", newline_first=printed)
        return 2 if code == grpc.StatusCode.INVALID_ARGUMENT else 1
    except KeyboardInterrupt:
        if call is not None:
            call.cancel()
        _print_error("interrupted", newline_first=printed)
        return 130
