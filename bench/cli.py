"""The flags of `draftmesh bench` and their checks. Importing this is cheap (no torch): every
`draftmesh` command builds its parser from it; the run itself is ``draftmesh.bench.run``."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from draftmesh.bench.arguments import positive_int
from draftmesh.bench.methods import (
    DEFAULT_MESH_METHODS,
    DEFAULT_METHODS,
    MESH_METHODS,
    Method,
)
from draftmesh.config import add_config_arguments

TARGETS = ("local", "mesh")
APIS = ("grpc", "openai")

EXIT_OK, EXIT_MISMATCH, EXIT_USAGE = 0, 1, 2
EXIT_INTERRUPTED = 130


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", required=True, metavar="FILE.jsonl", help="workload file (JSON lines)")
    parser.add_argument(
        "--methods",
        default=None,
        metavar="LIST",
        help="comma-separated: plain, hf, hf-pld, hf-assist, vllm, vllm-ngram (vLLM in its own environment: plain greedy, or with its n-gram speculative decoding), draftmesh, draftmesh:<source> (one source alone), "
        "draftmesh:* (each default source alone), draftmesh+<policy> or draftmesh:<source>+<policy> "
        "(a lossy acceptance policy: typical, nkl, block, semantic), mesh:plain, mesh:draftmesh (through the "
        f"mesh, with --target mesh); plain is always run (default: {DEFAULT_METHODS}; with --target mesh: "
        f"{DEFAULT_MESH_METHODS})",
    )
    parser.add_argument(
        "--target", choices=TARGETS, default="local",
        help="local: in-process methods only; mesh: also run the mesh:* methods through a served mesh "
        "(--addr, or a local mesh the bench starts and stops) (default: %(default)s)",
    )
    parser.add_argument(
        "--addr", metavar="HOST:PORT", default=None,
        help="with --target mesh: an already running mesh (its learned state is not reset between passes); "
        "default: start a local mesh for the run",
    )
    parser.add_argument(
        "--api-key", default=None, help="with --addr: API key sent as a bearer token (default: $DRAFTMESH_API_KEY)"
    )
    parser.add_argument(
        "--api", choices=APIS, default="grpc",
        help="with --target mesh: grpc: the mesh methods through the gRPC face; openai: the same workload through "
             "the gRPC face and the HTTP face (the real openai client), passes alternating, with the HTTP/gRPC "
             "tokens/s ratio and the outputs compared (default: %(default)s)",
    )
    parser.add_argument(
        "--http-addr", metavar="HOST:PORT", default=None,
        help="with --addr and --api openai: where that mesh serves its HTTP face (the bench's own mesh: a free port)",
    )
    parser.add_argument("--tls-ca", metavar="FILE", default=None, help="with --addr: PEM CA/certificate to trust; enables TLS")
    parser.add_argument("--assistant", metavar="SPEC", default=None, help="assistant model for hf-assist")
    parser.add_argument(
        "--vllm-python", metavar="PATH", default=None,
        help="for the vllm methods: the Python of an environment with vLLM (default: $DRAFTMESH_VLLM_PYTHON, "
        "else .venv-vllm/bin/python, which `make vllm-env` creates)",
    )
    parser.add_argument(
        "--vllm-eager", action="store_true",
        help="run vLLM without torch.compile: it starts ~1.5 min sooner on a 2-core CPU but decodes slower, "
        "so its figures are labelled '(eager)'; for checks of the runner, not for comparisons",
    )
    parser.add_argument(
        "--repeats", type=positive_int, default=3, metavar="N",
        help="passes over the workload; the median time per item and method is kept (default: %(default)s)",
    )
    parser.add_argument("--json", metavar="OUT.json", default=None, help="write the full results as JSON")
    parser.add_argument("--plot", metavar="OUT.png", default=None, help="write a PNG chart (needs matplotlib)")
    parser.add_argument(
        "--kinds", default=None, metavar="LIST",
        help="only the items of these kinds (comma-separated, e.g. grounded,rag), before --limit",
    )
    parser.add_argument("--limit", type=positive_int, default=None, metavar="N", help="only the first N items")
    parser.add_argument(
        "--max-new-tokens", type=positive_int, default=None, metavar="N",
        help="replace every item's max_new_tokens with N",
    )
    parser.add_argument(
        "--concurrency", default=None, metavar="LIST",
        help="e.g. 1,2,4,8,16: a closed-loop load test instead of the single-stream comparison; per C and method "
             "(plain-serial, plain, draftmesh) aggregate tokens/s, p50/p95 latency and time to first token, batch rows "
             "and tokens per forward; --methods may add vllm, and draftmesh-oracle (after plain or plain-serial: "
             "the sources' candidates cut to the nodes the target accepts, the most any node choice makes of "
             "them); with --target mesh: plain-serial and the mesh methods, plus the in-process "
             "plain and draftmesh if --methods names them (each mesh method over its in-process twin, same run)",
    )
    parser.add_argument(
        "--prefill-probe-tokens", type=int, default=2048, metavar="N",
        help="with --concurrency: a short request's time to first token while an N-token prompt prefills (0: off)",
    )
    parser.add_argument("--no-cost-curve", action="store_true", help="skip measuring the target's cost curve")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    # The model, its threads and the tree builder come from the config (--config FILE, DRAFTMESH_*,
    # --model, --threads, --max-nodes, --builder-*), as for every other command; the draft
    # sources' options from the file's sources section.
    add_config_arguments(parser, sections=("engine", "builder"))


def _error(msg: str) -> int:
    print(f"draftmesh bench: error: {msg}", file=sys.stderr)
    return EXIT_USAGE


def check_target(target_kind: str, methods: Sequence[Method], *, addr: str | None = None,
                 tls_ca: str | None = None) -> None:
    """ValueError for a --target that does not fit the methods or the mesh flags."""
    if target_kind not in TARGETS:
        raise ValueError(f"--target must be one of {', '.join(TARGETS)}, got {target_kind!r}")
    mesh = [m.name for m in methods if m.family == "mesh"]
    if target_kind != "mesh":
        if mesh:
            raise ValueError(f"method(s) {', '.join(mesh)} run through the mesh: add --target mesh")
        if addr or tls_ca:
            raise ValueError("--addr and --tls-ca need --target mesh")
    elif not mesh:
        raise ValueError(f"--target mesh needs a mesh method in --methods ({', '.join(MESH_METHODS)})")
    if tls_ca and not addr:
        raise ValueError("--tls-ca applies to a mesh given with --addr")
