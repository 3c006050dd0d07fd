"""Our engine behind the bench's worker protocol (``vllm_worker``'s docstring), so that its
start-up and memory are measured from a cold process exactly as vLLM's are: spawn, import,
load the model, build the decoder (with sources: their set-up and the cost curve the tree
budget needs, as a verifier replica does), answer a first request.

    python -m draftmesh.bench.engine_worker --model smollm2-135m --threads 2 [--sources plain]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from draftmesh.bench.vllm_worker import answer_requests, reply_channel


def main(argv: list[str] | None = None) -> int:
    t0 = time.perf_counter()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="model spec or folder")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument(
        "--sources", default=None,
        help="comma-separated draft sources; 'plain' for none (default: the registry's default set)",
    )
    args = parser.parse_args(argv)
    send = reply_channel()

    # lazy: the whole point is timing these imports from a cold process
    import torch

    from draftmesh.backend import TorchTarget
    from draftmesh.config import EngineConfig
    from draftmesh.io_struct import GenerationRequest
    from draftmesh.verify.engine import build_decoder

    engine = EngineConfig(model=args.model, dtype=args.dtype, threads=args.threads)
    engine.apply_threads()
    target = TorchTarget.load(engine.model, device=engine.device, dtype=engine.torch_dtype())
    sources = None if args.sources is None else tuple(s for s in args.sources.split(",") if s and s != "plain")
    decoder = build_decoder(target, sources)
    send({"event": "ready", "load_s": time.perf_counter() - t0, "torch": torch.__version__, "pid": os.getpid(),
          "sources": [s.name for s in decoder.sources]})
    def generate(msg):
        start = time.perf_counter()
        res = decoder.generate(GenerationRequest(
            prompt_ids=tuple(int(t) for t in msg["prompt_ids"]), max_new_tokens=int(msg["max_new_tokens"]),
            request_id=str(msg.get("id")),
        ))
        return res.token_ids, time.perf_counter() - start, res.finish_reason

    answer_requests(send, generate)
    return 0


if __name__ == "__main__":
    sys.exit(main())
