"""`draftmesh demo`: start the mesh, send it a few real requests over gRPC, summarize, stop it.

Three requests show the three kinds of knowledge the drafts come from: a grounded code
edit (the prompt itself), a question over an inline document (retrieval), and a question
asked twice (the answer store). Each is sent with speculation on, then off (plain
decoding, the baseline); the outputs must be identical. The speculative run goes first so
the plain run's answer cannot help it through the answer store; only the repeated
question is meant to be helped.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any, TextIO

from draftmesh.cli.demo import DEMO_MESSAGES
from draftmesh.cli.generate import format_factcheck
from draftmesh.client import MeshClient, build_request
from draftmesh.config import DraftmeshConfig
from draftmesh.router.launcher import start_mesh
from draftmesh.v1 import generation_pb2 as pb

RAG_DOCUMENT = (
    "The Lindqvist Observatory was founded in 1911 on the summit of Mount Harrow. Its main "
    "instrument, the Carver refractor, has a 61-centimetre lens and was the largest in the "
    "region until 1958. The observatory discovered the comet 1934 Harrow-Vale and today runs "
    "public night tours every Friday from April to October."
)
RAG_QUESTION = "Using the document, describe the Lindqvist Observatory: when it was founded, its main instrument, and what it discovered."
REPEAT_QUESTION = "Explain in three sentences why the sky is blue."


@dataclass
class DemoRow:
    name: str
    plain_tps: float
    spec_tps: float
    tokens_per_step: float
    identical: bool
    tokens: int
    top_source: str

    @property
    def speedup(self) -> float:
        return self.spec_tps / self.plain_tps if self.plain_tps else 0.0


def _timed(client, request, out: TextIO | None = None):
    """Stream one request; returns (result, wall seconds). Echoes text to ``out`` if given."""
    t0 = time.perf_counter()
    result = None
    for response in client.generate(request):
        if response.HasField("delta") and out is not None:
            out.write(response.delta.text)
            out.flush()
        elif response.HasField("result"):
            result = response.result
    return result, time.perf_counter() - t0


def _compare(client, name: str, request, out: TextIO, *, echo: bool = False, label: str | None = None) -> DemoRow:
    if echo:
        print(f"\n--- {name}: speculative, streamed ---", file=out)
    spec, spec_s = _timed(client, request, out if echo else None)
    if echo:
        print("\n---", file=out)
        if spec.HasField("factcheck"):
            print(format_factcheck(spec.factcheck), file=out)
    plain_req = pb.GenerateRequest()
    plain_req.CopyFrom(request)
    plain_req.session_id = ""
    plain_req.speculation.enabled = False
    plain, plain_s = _timed(client, plain_req)
    best = max(spec.sources, key=lambda s: s.accepted_tokens, default=None)
    return DemoRow(
        name=label or name,
        plain_tps=len(plain.token_ids) / plain_s,
        spec_tps=len(spec.token_ids) / spec_s,
        tokens_per_step=spec.mean_accepted_per_step,
        identical=list(plain.token_ids) == list(spec.token_ids),
        tokens=len(spec.token_ids),
        top_source=f"{best.source} ({best.accepted_tokens} tok)" if best and best.accepted_tokens else "-",
    )


def _http_request(client, http_address: str, api_key: str | None, model: str, max_new_tokens: int, out: TextIO) -> None:
    """One request through the OpenAI-compatible HTTP face, as curl would send it, beside gRPC's answer."""
    import json
    import urllib.request

    messages = [{"role": "user", "content": REPEAT_QUESTION}]
    body = {"model": model, "messages": messages, "max_tokens": max_new_tokens, "temperature": 0}
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    url = f"http://{http_address}/v1/chat/completions"
    print(f"\n--- the same question through the OpenAI-compatible HTTP API: POST {url} ---", file=out)
    t0 = time.perf_counter()
    with urllib.request.urlopen(urllib.request.Request(url, json.dumps(body).encode(), headers), timeout=600) as r:
        answer = json.loads(r.read())
    seconds = time.perf_counter() - t0
    text = answer["choices"][0]["message"]["content"]
    want = client.complete(build_request(messages=messages, max_new_tokens=max_new_tokens)).text
    dm = answer["draftmesh"]
    print(f"{text}\n---\nHTTP face: {answer['usage']['completion_tokens']} tokens in {seconds:.2f}s, "
          f"{dm['tokens_per_step']:.2f} tokens/step, identical to gRPC Complete: {'yes' if text == want else 'NO'}",
          file=out, flush=True)


def run_mesh_demo(cfg: DraftmeshConfig, *, addr: str | None = None, api_key: str | None = None,
                  max_new_tokens: int = 160, out: TextIO = sys.stdout) -> dict[str, Any]:
    running = None
    if addr is None:
        print(f"starting the mesh ({cfg.engine.model}, {cfg.serve.verifier_replicas} verifier replica(s))...",
              file=out, flush=True)
        running = start_mesh(cfg)
        addr = running.address
        api_key = api_key or (cfg.serve.api_keys or [None])[0]
        print(f"mesh ready on {addr} in {running.started_s:.1f}s (Ray Serve, gRPC, Redis {running.config.serve.redis_url})",
              file=out, flush=True)
    try:
        with MeshClient(addr, api_key=api_key, timeout_s=600) as client:
            rows = [
                _compare(client, "grounded code edit", build_request(messages=DEMO_MESSAGES, max_new_tokens=max_new_tokens),
                         out, echo=True),
                # As a RAG app would: the passage in the prompt for the model, and as a document
                # for the rag source to draft from.
                _compare(client, "question over a document", build_request(
                    messages=[{"role": "user", "content": f"Document:\n{RAG_DOCUMENT}\n\n{RAG_QUESTION}"}],
                    documents=[RAG_DOCUMENT],
                    max_new_tokens=max_new_tokens), out, echo=True),
            ]
            ask = build_request(messages=[{"role": "user", "content": REPEAT_QUESTION}], max_new_tokens=max_new_tokens,
                                session_id="demo-user")
            rows.append(_compare(client, "question, first time", ask, out))
            rows.append(_compare(client, "same question again", ask, out, label="same question again (answer store)"))
            if running is not None and running.http_address:
                _http_request(client, running.http_address, api_key, cfg.engine.model, max_new_tokens, out)
    finally:
        if running is not None:
            running.stop()
            print("mesh stopped", file=out)

    width = max(len(r.name) for r in rows)
    print(f"\n{'request':<{width}}  plain tok/s  draftmesh tok/s  speedup  tokens/step  identical  most accepted from",
          file=out)
    for r in rows:
        print(f"{r.name:<{width}}  {r.plain_tps:11.1f}  {r.spec_tps:15.1f}  {r.speedup:6.2f}x  {r.tokens_per_step:11.2f}"
              f"  {'yes' if r.identical else 'NO':>9}  {r.top_source}", file=out)
    print("(one run each through the gRPC front door, speculative first; `make bench` gives medians over a workload)",
          file=out)
    return {"rows": [vars(r) | {"speedup": r.speedup} for r in rows], "all_identical": all(r.identical for r in rows),
            "started_s": running.started_s if running else None}
