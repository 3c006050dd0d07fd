"""The vLLM side of the bench's ``vllm`` method: a script run by path with the Python of vLLM's own
environment (``make vllm-env`` -> ``.venv-vllm``), never imported by draftmesh (whose environment
has no vLLM, and cannot: vLLM pins transformers < 5.20).

It loads the model once with vLLM's offline engine (``vllm.LLM``), then answers requests, one JSON
object per line: token ids in, token ids and the seconds ``LLM.generate`` took out. Token ids
both ways, so both engines see exactly the same prompt and are compared token for token; the
offline engine rather than ``vllm serve``, so the time is the engine's, with no HTTP, JSON or
tokenizer round trip that our in-process methods do not pay either.

Protocol (``draftmesh.bench.vllm`` is the other end). Replies go to the file descriptor that was
stdout when the script started; everything vLLM prints is sent to stderr instead.

    -> {"event": "ready", "load_s": 12.3, "vllm": "0.32.0", "pid": 123}        once, after loading
    <- {"op": "generate", "id": "x", "prompt_ids": [...], "max_new_tokens": 64, "stop_token_ids": [2]}
    -> {"event": "result", "id": "x", "token_ids": [...], "seconds": 1.9, "finish_reason": "stop"}
    -> {"event": "error", "id": "x", "message": "..."}                          a request failed
    <- {"op": "closed_loop", "id": "p", "concurrency": 8, "requests": [{"id": .., "prompt_ids": [..],
        "max_new_tokens": 64, "stop_token_ids": [2]}, ...]}                     keep 8 in flight
    -> {"event": "closed_loop_result", "id": "p", "seconds": 9.1, "results": [{"id": .., "token_ids":
        [..], "latency_s": 1.2, "ttft_s": 0.1, "finish_reason": "length"}, ...]}
    <- {"op": "exit"}  (or end of input)                                        the script exits
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def reply_channel():
    """``send(obj)`` writing one JSON line to the protocol's channel (the original stdout), with
    stdout pointed at stderr so that nothing a library prints can reach the protocol."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def send(obj) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    return send


def answer_requests(send, generate, closed_loop=None) -> None:
    """Answer ``generate`` lines from stdin until ``exit`` or end of input: ``generate(msg)``
    returns ``(token_ids, seconds, finish_reason)``; ``closed_loop(msg)`` (where given) returns
    ``(results, seconds)``. An exception answers that request with an error and the worker goes
    on. Shared with ``engine_worker`` (which imports this module; this script itself can import
    nothing of draftmesh, which vLLM's environment lacks)."""
    for line in sys.stdin:
        if not line.strip():
            continue
        msg = json.loads(line)
        if msg.get("op") == "exit":
            break
        rid = msg.get("id")
        try:
            if msg.get("op") == "closed_loop" and closed_loop is not None:
                results, seconds = closed_loop(msg)
                send({"event": "closed_loop_result", "id": rid, "results": results, "seconds": seconds})
                continue
            token_ids, seconds, finish_reason = generate(msg)
        except Exception as exc:  # noqa: BLE001 - reported to the bench, which fails the method
            send({"event": "error", "id": rid, "message": f"{type(exc).__name__}: {exc}"})
            continue
        send({"event": "result", "id": rid, "token_ids": list(token_ids), "seconds": seconds,
              "finish_reason": finish_reason})


def run_closed_loop(engine, make_params, make_prompt, requests, concurrency: int):
    """Keep ``concurrency`` requests in flight on vLLM's engine (``LLMEngine``: ``add_request``,
    ``step``), each next one added as soon as one finishes: the same closed loop the bench's own
    methods get from client threads, here without threads, the engine being single-threaded.
    Returns per-request results (token ids, latency, time to first token) and the wall time."""
    pending = list(requests)
    started: dict[str, float] = {}
    first: dict[str, float] = {}
    results = []
    t0 = time.perf_counter()

    def add_next() -> None:
        req = pending.pop(0)
        started[req["id"]] = time.perf_counter()
        engine.add_request(req["id"], make_prompt(req), make_params(req))

    while pending and len(started) - len(results) < concurrency:
        add_next()
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            completion = out.outputs[0] if out.outputs else None
            if completion is not None and completion.token_ids and out.request_id not in first:
                first[out.request_id] = now - started[out.request_id]
            if out.finished:
                results.append({"id": out.request_id, "token_ids": list(completion.token_ids) if completion else [],
                                "latency_s": now - started[out.request_id],
                                "ttft_s": first.get(out.request_id, now - started[out.request_id]),
                                "finish_reason": completion.finish_reason if completion else None})
                if pending:
                    add_next()
    return results, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a local model folder (safetensors)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help="vLLM's speculative_config, e.g. n-gram prompt lookup (default: none, plain decoding)")
    parser.add_argument("--eager", action="store_true",
                        help="no torch.compile (CompilationMode.NONE): a faster start, a slower decode")
    args = parser.parse_args(argv)
    send = reply_channel()

    t0 = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        seed=args.seed,
        # The checkpoint's generation defaults (repetition penalty, ...) would change greedy output;
        # the bench's hf runner hides them from transformers the same way.
        generation_config="vllm",
        enable_prefix_caching=False,
        speculative_config=json.loads(args.speculative_config) if args.speculative_config else None,
        # mode 0 is CompilationMode.NONE: the model runs as plain PyTorch, skipping ~1.5 min of compiling
        **({"compilation_config": {"mode": 0}} if args.eager else {}),
    )
    send({"event": "ready", "load_s": time.perf_counter() - t0, "vllm": vllm.__version__, "pid": os.getpid(),
          "eager": args.eager})

    def params_of(msg):
        return SamplingParams(
            temperature=0.0,
            max_tokens=int(msg["max_new_tokens"]),
            stop_token_ids=[int(t) for t in msg.get("stop_token_ids", [])],
            ignore_eos=False,
            detokenize=False,
        )

    def prompt_of(msg):
        return TokensPrompt(prompt_token_ids=[int(t) for t in msg["prompt_ids"]])

    def generate(msg):
        start = time.perf_counter()
        (out,) = llm.generate([prompt_of(msg)], params_of(msg), use_tqdm=False)
        completion = out.outputs[0]
        return completion.token_ids, time.perf_counter() - start, completion.finish_reason

    def closed_loop(msg):
        return run_closed_loop(llm.llm_engine, params_of, prompt_of, msg["requests"], int(msg["concurrency"]))

    answer_requests(send, generate, closed_loop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
