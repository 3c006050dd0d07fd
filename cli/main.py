"""The `draftmesh` command line: one subcommand per entry point.

Building the parser is cheap (no torch, Ray or transformers): each command imports what it runs
when it runs (the imports marked lazy), so `draftmesh health` in a container's health check and
`draftmesh factcheck-worker` in the worker's own environment load only what they need.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time

import yaml

from draftmesh import tracing
from draftmesh.bench.cli import add_arguments as add_bench_arguments
from draftmesh.cli.generate import add_generate_arguments, run_generate_cli
from draftmesh.cli.health import add_health_arguments, run_health_cli
from draftmesh.config import add_config_arguments, config_from_args

ENGINE_SECTIONS = ("engine", "sources", "builder")
"""The config sections of the in-process commands (`run`); the mesh commands take all of them."""


def _offline_defaults() -> None:
    # Packaged models never need the hub; do not let transformers try it.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def cmd_demo(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    if args.in_process:
        from draftmesh.cli.demo import run_demo  # lazy: the engine (torch)

        run_demo(cfg, repeats=args.repeats, max_new_tokens=args.max_new_tokens)
        return 0
    from draftmesh.cli.mesh_demo import run_mesh_demo  # lazy: the mesh (Ray)

    summary = run_mesh_demo(cfg, addr=args.addr, max_new_tokens=args.max_new_tokens)
    return 0 if summary["all_identical"] else 1


def cmd_run(args: argparse.Namespace) -> int:
    # lazy: the engine (torch, transformers)
    from draftmesh.io_struct import GenerationRequest, SamplingParams
    from draftmesh.prompts import encode_messages, encode_prompt
    from draftmesh.verify.engine import decoder_from_config, load_target

    cfg = config_from_args(args)
    tracing.setup_tracing("engine")
    target = load_target(cfg.engine)
    decoder = decoder_from_config(target, cfg)
    if args.raw:
        ids = encode_prompt(target.tokenizer, args.prompt)
    else:
        ids = encode_messages(target.tokenizer, [{"role": "user", "content": args.prompt}])
    req = GenerationRequest(
        tuple(ids),
        max_new_tokens=args.max_new_tokens,
        sampling=SamplingParams(args.temperature, args.top_p, args.top_k, args.seed),
        stop=tuple(args.stop or ()),
    )
    result = None
    for event in decoder.stream(req):
        if hasattr(event, "record"):
            sys.stdout.write(event.text)
            sys.stdout.flush()
        else:
            result = event
    assert result is not None
    print(
        f"\n[{len(result.token_ids)} tokens in {result.seconds:.2f}s, {result.tokens_per_s:.1f} tok/s, "
        f"{len(result.steps)} steps, {result.mean_accepted_per_step:.2f} tokens/step, finish: {result.finish_reason}]",
        file=sys.stderr,
    )
    return 0


def cmd_cost_curve(args: argparse.Namespace) -> int:
    from draftmesh.verify.engine import load_target  # lazy: the engine (torch, transformers)

    target = load_target(config_from_args(args).engine)
    curve = target.measure_cost_curve(context=args.context, repeats=args.repeats)
    print(f"one-token step: {target.step_seconds * 1000:.1f} ms (context {args.context})")
    for k, v in curve.items():
        print(f"k={k:3d} tokens  {v:5.2f}x")
    return 0


def cmd_prepare_models(args: argparse.Namespace) -> int:
    """Convert the packaged GGUFs to the safetensors cache once, so later loads take seconds."""
    from draftmesh.models import PACKAGED_MODELS, ensure_converted, resolve  # lazy: torch

    for spec in args.models or PACKAGED_MODELS:
        t0 = time.perf_counter()
        folder = ensure_converted(resolve(spec))
        print(f"{spec}: {folder} ({time.perf_counter() - t0:.1f}s)")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from draftmesh.bench.run import run  # lazy: loads torch and the engine

    return run(args)


def cmd_draft_serve(args: argparse.Namespace) -> int:
    """Serve one built-in draft source over gRPC until Ctrl-C or SIGTERM."""
    # lazy: the draft sources (torch, a tokenizer)
    import grpc

    from draftmesh.auth import ApiKeyAuth
    from draftmesh.draft.grpc_server import serve_source
    from draftmesh.draft.registry import build_source

    options = {}
    if args.options_yaml:
        try:
            with open(args.options_yaml, encoding="utf-8") as fh:
                options = yaml.safe_load(fh) or {}
        except OSError as exc:
            raise ValueError(f"cannot read --options-yaml: {exc}") from None
        if not isinstance(options, dict):
            raise ValueError(f"{args.options_yaml}: the source options must be a mapping")
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("--tls-cert and --tls-key must be given together")
    auth = ApiKeyAuth.from_keys_and_file(args.api_keys, args.api_keys_file)
    credentials = None
    if args.tls_cert:
        from draftmesh.router.tls_gateway import load_tls_files  # lazy: only with TLS; the gateway's PEM checks

        cert, key = load_tls_files(args.tls_cert, args.tls_key)
        credentials = grpc.ssl_server_credentials([(key, cert)])
    source = build_source(args.source, config_from_args(args).engine.model, options=options)
    tracing.setup_tracing("draft")
    server, port = serve_source(source, args.port, host=args.host, server_credentials=credentials, auth=auth)
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    extras = "".join((" with TLS" if credentials else "", " with API keys" if auth.enabled else ""))
    print(f"draft source {args.source!r} listening on {args.host}:{port}{extras}", flush=True)
    try:
        wait_polling(stop)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        server.stop(args.grace).wait()
    print(f"draft source {args.source!r} stopped", file=sys.stderr)
    return 0


HARD_STOP_S = 20.0
"""After a stop signal, seconds beyond ``serve.drain_s`` before the process exits regardless."""

SIGNAL_POLL_S = 0.5
"""How often the main thread wakes while it waits for a stop (see ``wait_polling``)."""


def wait_polling(event: threading.Event, poll_s: float = SIGNAL_POLL_S) -> None:
    """Wait for ``event`` in short slices, so that the main thread runs Python's signal handlers.

    The kernel may deliver SIGINT/SIGTERM to any thread of the process (Ray's and gRPC's native
    threads are many); Python's C handler then only flags it, and a main thread blocked in an untimed
    ``Event.wait()`` never wakes to run our handler. CI saw exactly that: Ctrl-C while streaming
    was ignored, no drain, no watchdog, until the test killed the process."""
    while not event.wait(poll_s):
        pass


def cmd_serve(args: argparse.Namespace) -> int:
    """Run the whole mesh (Redis, Ray, Serve, gRPC) until Ctrl-C or SIGTERM, then stop it.

    A signal is honoured in every phase: while starting (the half-started mesh is torn down), idle,
    or serving (calls in flight get ``serve.drain_s`` seconds, then are cancelled). A watchdog exits
    the process ``HARD_STOP_S`` after that, whatever is stuck; a second signal exits at once. Exit
    code: 130 after SIGINT (the shell's convention), 0 after SIGTERM (an orchestrator's normal stop)."""
    from draftmesh.router.launcher import start_mesh  # lazy: the mesh (Ray, the engine)

    cfg = config_from_args(args)
    stop = threading.Event()
    state = {"phase": "starting", "signal": None}

    def exit_code() -> int:
        return 130 if state["signal"] == signal.SIGINT else 0

    def hard_stop() -> None:
        if not done.wait(cfg.serve.drain_s + HARD_STOP_S):
            print("draftmesh: did not stop in time; exiting now", file=sys.stderr, flush=True)
            os._exit(exit_code())

    def on_signal(signum, _frame) -> None:
        if state["signal"] is not None:  # the second one: now
            print("draftmesh: stopping now", file=sys.stderr, flush=True)
            os._exit(130 if signum == signal.SIGINT else exit_code())
        state["signal"] = signum
        stop.set()
        threading.Thread(target=hard_stop, name="draftmesh-hard-stop", daemon=True).start()
        if state["phase"] == "starting":
            raise KeyboardInterrupt  # unwinds start_mesh, which tears down what it started

    done = threading.Event()
    signals = (signal.SIGTERM, signal.SIGINT)
    previous = {sig: signal.signal(sig, on_signal) for sig in signals}
    mesh = None
    try:
        try:
            mesh = start_mesh(cfg)
        except KeyboardInterrupt:
            if not stop.is_set():
                raise
            print("draftmesh: stopped while starting", file=sys.stderr, flush=True)
            return exit_code()
        state["phase"] = "serving"
        # ray.init installed its own SIGTERM handler (it would exit without cleanup): ours again.
        for sig in signals:
            signal.signal(sig, on_signal)
        if stop.is_set():  # a signal Ray swallowed while starting
            print("draftmesh: stopping", file=sys.stderr, flush=True)
            return exit_code()
        tls = " with TLS" if cfg.serve.tls_cert else ""
        auth = " with API keys" if cfg.serve.api_keys or cfg.serve.api_keys_file else ""
        metrics = f"; metrics http://{mesh.metrics_address}/metrics" if mesh.metrics_address else ""
        traces = f"; traces to {tracing.configured_endpoint()}" if tracing.configured_by_env() else ""
        http = f"; OpenAI-compatible HTTP API on http://{mesh.http_address}/v1{auth}" if mesh.http_address else ""
        print(f"draftmesh: serving {cfg.engine.model} on {mesh.address}{tls} (gRPC draftmesh.v1.Generation{auth}){http}; "
              f"redis {mesh.config.serve.redis_url}{metrics}{traces}; ready in {mesh.started_s:.1f}s. Ctrl-C to stop.",
              flush=True)
        wait_polling(stop)
        print(f"draftmesh: stopping (draining for up to {cfg.serve.drain_s:g}s)", file=sys.stderr, flush=True)
        return exit_code()
    finally:
        state["phase"] = "stopping"
        if mesh is not None:
            mesh.stop(cfg.serve.drain_s)
        done.set()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if state["signal"] is not None:
            _exit_after_stop(exit_code())


def _exit_after_stop(code: int) -> None:
    """Leave without the interpreter's finalization once the mesh is torn down after a signal.

    Finalizing with Ray's and gRPC's native threads still alive (a start interrupted inside
    ``ray.init``/``serve.start`` leaves some) can crash: CI saw SIGSEGV instead of exit 130 after
    "stopped while starting". Everything we own is stopped by now; spans are flushed here."""
    if tracing.enabled():
        tracing.flush(2.0)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def cmd_generate(args: argparse.Namespace) -> int:
    return run_generate_cli(args)


def cmd_health(args: argparse.Namespace) -> int:
    """Exit 0 when a running mesh's gRPC front door is healthy and serves the app, else 1 (container health checks)."""
    return run_health_cli(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="draftmesh", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="start the mesh, send grounded, RAG and repeated requests, compare with plain")
    add_config_arguments(demo)
    demo.add_argument("--addr", default=None, help="use a running mesh instead of starting one")
    demo.add_argument("--in-process", action="store_true", help="no mesh: the engine in this process, medians of --repeats")
    demo.add_argument("--repeats", type=int, default=3, help="with --in-process: interleaved runs per side")
    demo.add_argument("--max-new-tokens", type=int, default=160)
    demo.set_defaults(func=cmd_demo)

    run = sub.add_parser("run", help="generate in-process for one prompt")
    add_config_arguments(run, sections=ENGINE_SECTIONS)
    run.add_argument("prompt")
    run.add_argument("--raw", action="store_true", help="do not apply the chat template")
    run.add_argument("--max-new-tokens", type=int, default=128)
    run.add_argument("--temperature", type=float, default=0.0)
    run.add_argument("--top-p", type=float, default=1.0)
    run.add_argument("--top-k", type=int, default=0)
    run.add_argument("--seed", type=int, default=None)
    run.add_argument("--stop", action="append")
    run.set_defaults(func=cmd_run)

    curve = sub.add_parser("cost-curve", help="measure the verify cost of a k-token tree forward")
    add_config_arguments(curve, sections=("engine",))
    curve.add_argument("--context", type=int, default=128)
    curve.add_argument("--repeats", type=int, default=7)
    curve.set_defaults(func=cmd_cost_curve)

    prep = sub.add_parser("prepare-models", help="convert the packaged models into the local cache")
    prep.add_argument("models", nargs="*", help="model specs (default: all packaged models)")
    prep.set_defaults(func=cmd_prepare_models)

    ds = sub.add_parser("draft-serve", help="serve a built-in draft source over gRPC (draftmesh.v1.DraftSource)")
    ds.add_argument("--source", required=True, help="built-in source name (history, rules, rag, prompt_lookup, llm)")
    ds.add_argument("--port", type=int, default=9100, help="0: any free port")
    ds.add_argument("--host", default="127.0.0.1",
                    help="address to listen on (default: loopback only; 0.0.0.0 for every interface)")
    ds.add_argument("--api-key", action="append", default=None, dest="api_keys",
                    help="a bearer key calls must present (repeatable; the router's check; unset: no auth)")
    ds.add_argument("--api-keys-file", default=os.environ.get("DRAFTMESH_API_KEYS_FILE"),
                    help="a file of bearer keys, one per line (default: DRAFTMESH_API_KEYS_FILE)")
    ds.add_argument("--tls-cert", default=None, help="PEM certificate: serve TLS only (with --tls-key)")
    ds.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    add_config_arguments(ds, sections=("engine",))  # --model: the target whose tokenizer the source uses
    ds.add_argument("--options-yaml", default=None, help="YAML mapping of the source's options")
    ds.add_argument("--grace", type=float, default=2.0, help="seconds in-flight calls get on shutdown")
    ds.set_defaults(func=cmd_draft_serve)

    # Dispatched in main() before this parser is built: the worker runs in its own environment,
    # where the engine's imports (grpc, torch's bench) need not exist. Listed here for --help.
    sub.add_parser("factcheck-worker", help="annotate draft spans and outputs from the Redis stream (see its --help)",
                   add_help=False)
    sub.add_parser("factcheck-bench", help="annotation latency/throughput per NER backend and the effect on tokens/s",
                   add_help=False)

    srv = sub.add_parser("serve", help="run the mesh: Ray Serve deployments behind the gRPC front door")
    add_config_arguments(srv)
    srv.set_defaults(func=cmd_serve)

    gen = sub.add_parser("generate", help="send one request to a running mesh and print the answer and its stats")
    add_generate_arguments(gen)
    gen.set_defaults(func=cmd_generate)

    health = sub.add_parser("health", help="check that a running mesh's gRPC front door is healthy and serves the app "
                                           "(exit 0) or not (exit 1)")
    add_health_arguments(health)
    health.set_defaults(func=cmd_health)

    b = sub.add_parser("bench", help="benchmark methods side by side on a workload file")
    add_bench_arguments(b)
    b.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    _offline_defaults()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["factcheck-worker"]:
        from draftmesh.factcheck.worker import main as worker_main  # lazy: NER models, in the worker's env

        return worker_main(argv[1:])
    if argv[:1] == ["factcheck-bench"]:
        from draftmesh.bench.factcheck.cli import main as factcheck_bench_main  # lazy: the engine and workers

        return factcheck_bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"draftmesh: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
