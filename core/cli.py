"""The `draftmesh` command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from draftmesh.config import EngineConfig, add_config_arguments, config_from_args


def _offline_defaults() -> None:
    # Packaged models never need the hub; do not let transformers try it.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def cmd_demo(args: argparse.Namespace) -> int:
    from draftmesh.demo import run_demo

    cfg = config_from_args(args)
    run_demo(cfg, repeats=args.repeats, max_new_tokens=args.max_new_tokens)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from draftmesh.prompts import encode_messages, encode_prompt
    from draftmesh.router.engine import decoder_from_config, load_target
    from draftmesh.verify.decoder import GenerationRequest
    from draftmesh.verify.sampling import SamplingParams

    cfg = config_from_args(args)
    target = load_target(cfg)
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
    from draftmesh.router.engine import load_target

    target = load_target(config_from_args(args))
    curve = target.measure_cost_curve(context=args.context, repeats=args.repeats)
    print(f"one-token step: {target.step_seconds * 1000:.1f} ms (context {args.context})")
    for k, v in curve.items():
        print(f"k={k:3d} tokens  {v:5.2f}x")
    return 0


def cmd_prepare_models(args: argparse.Namespace) -> int:
    """Convert the packaged GGUFs to the safetensors cache once, so later loads take seconds."""
    import time

    from draftmesh.models import PACKAGED_MODELS, ensure_converted, resolve

    for spec in args.models or PACKAGED_MODELS:
        t0 = time.perf_counter()
        folder = ensure_converted(resolve(spec))
        print(f"{spec}: {folder} ({time.perf_counter() - t0:.1f}s)")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from draftmesh import bench

    return bench.run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="draftmesh", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="stream a grounded request and compare plain vs speculative decoding")
    add_config_arguments(demo)
    demo.add_argument("--repeats", type=int, default=3)
    demo.add_argument("--max-new-tokens", type=int, default=160)
    demo.set_defaults(func=cmd_demo)

    run = sub.add_parser("run", help="generate in-process for one prompt")
    add_config_arguments(run)
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
    add_config_arguments(curve)
    curve.add_argument("--context", type=int, default=128)
    curve.add_argument("--repeats", type=int, default=7)
    curve.set_defaults(func=cmd_cost_curve)

    prep = sub.add_parser("prepare-models", help="convert the packaged models into the local cache")
    prep.add_argument("models", nargs="*", help="model specs (default: all packaged models)")
    prep.set_defaults(func=cmd_prepare_models)

    try:
        from draftmesh import bench
    except ImportError:  # pragma: no cover - bench is part of the package
        bench = None
    if bench is not None:
        b = sub.add_parser("bench", help="benchmark methods side by side on a workload file")
        bench.add_arguments(b)
        b.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    _offline_defaults()
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"draftmesh: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
