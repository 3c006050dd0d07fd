"""`draftmesh bench`: run the methods side by side on a workload, print and write the report.

See the package docstring for how a run is made, ``docs/bench.md`` for its use."""

from __future__ import annotations

import argparse
import contextlib
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from draftmesh import compute
from draftmesh.backend import TorchTarget
from draftmesh.bench.cli import (
    EXIT_INTERRUPTED,
    EXIT_MISMATCH,
    EXIT_OK,
    _error,
    check_target,
)
from draftmesh.bench.concurrency import (
    PLAIN_SERIAL,
    concurrency_methods,
    format_concurrency,
    mesh_ratios,
    plot_concurrency,
    run_concurrency,
)
from draftmesh.bench.concurrency import VLLM as VLLM_CONCURRENT
from draftmesh.bench.engine_report import (
    BenchReport,
    format_report,
    report_to_json,
    write_plot,
)
from draftmesh.bench.fidelity import measure_fidelity, top2_gap
from draftmesh.bench.items import PreparedItem, prepare_items
from draftmesh.bench.loop import WARMUP_TOKENS, execute
from draftmesh.bench.mesh import MeshError, open_mesh
from draftmesh.bench.methods import DRAFTMESH, HF_ASSIST, PLAIN, default_methods, parse_methods
from draftmesh.bench.report import command_line, machine_info, write_json
from draftmesh.bench.runners import load_target_spec, make_runner
from draftmesh.bench.tracing import noop_step_cost_us
from draftmesh.bench.vllm_runner import (
    VLLMError,
    VLLMRunner,
    closed_loop_pass,
    find_vllm_python,
    local_model_folder,
    max_model_len,
    our_engine_startup,
    start_vllm,
)
from draftmesh.bench.workload import WorkloadError, items_of_kinds, load_workload
from draftmesh.config import config_from_args


def without_prefix_pool(cfg):
    """The mesh's config for the single-stream comparisons. They run every method on the same items one
    after another, ``mesh:plain`` right after ``mesh:draftmesh`` on each, so with the prefix pool on the
    second would find the first's prompt KV. Their in-process twins have no pool either; sessions keep theirs."""
    return cfg.replace(engine={"prefix_cache_size": 0})


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by ``args`` (see ``add_arguments``); return the exit status.

    The model and the builder come from the config (``--config``, DRAFTMESH_*, the flags);
    ``args.model`` (and ``args.assistant``) may also be an already-loaded ``TorchTarget``, so
    tests and callers can inject a model.
    """
    opt = lambda name, default=None: getattr(args, name, default)  # noqa: E731 - Namespaces built by hand
    injected = opt("model") if isinstance(opt("model"), TorchTarget) else None
    try:
        cfg = config_from_args(argparse.Namespace(**{**vars(args), "model": None}) if injected else args)
    except ValueError as exc:
        return _error(str(exc))
    target_kind = opt("target") or "local"
    try:
        items = load_workload(args.workload)
        # --concurrency names its own methods (concurrency_methods), checked where that mode runs
        methods = [] if opt("concurrency") else parse_methods(default_methods(target_kind, opt("methods")))
        # with --concurrency the mesh methods come with --target mesh: check the target against the defaults
        check_target(target_kind, parse_methods(default_methods(target_kind, None)) if opt("concurrency") else methods,
                     addr=opt("addr"), tls_ca=opt("tls_ca"))
        if (opt("api") or "grpc") != "grpc" and target_kind != "mesh":
            raise ValueError(f"--api {opt('api')} compares the faces of a mesh: add --target mesh")
        if opt("http_addr") and (opt("api") or "grpc") != "openai":
            raise ValueError("--http-addr applies to --api openai")
        if opt("api") == "openai" and opt("addr") and not opt("http_addr"):
            raise ValueError("--api openai with --addr needs --http-addr (where that mesh serves its HTTP face)")
    except (WorkloadError, ValueError) as exc:
        return _error(str(exc))
    mesh_methods = [m for m in methods if m.family == "mesh"]
    vllm_methods = [m for m in methods if m.family == "vllm"]
    vllm_python = None
    if vllm_methods:
        try:
            vllm_python = find_vllm_python(opt("vllm_python"))
        except VLLMError as exc:
            return _error(str(exc))
    tls_ca = None
    if opt("tls_ca"):
        try:
            tls_ca = Path(opt("tls_ca")).expanduser().read_bytes()
        except OSError as exc:
            return _error(f"--tls-ca: cannot read {opt('tls_ca')}: {exc.strerror or exc}")
    if opt("kinds") is not None:
        try:
            items = items_of_kinds(items, opt("kinds"))
        except ValueError as exc:
            return _error(str(exc))
    if opt("limit"):
        items = items[: opt("limit")]
    repeats = opt("repeats") or 3
    if opt("plot"):
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return _error("--plot needs matplotlib (pip install matplotlib)")

    skipped: dict[str, str] = {}
    if any(m.name == HF_ASSIST for m in methods) and opt("assistant") is None:
        skipped[HF_ASSIST] = "no --assistant given"
        methods = [m for m in methods if m.name != HF_ASSIST]

    old_threads = compute.get_threads()
    threads = cfg.engine.threads or old_threads
    compute.set_threads(threads)
    cfg = cfg.replace(engine={"threads": threads})
    try:
        try:
            target = injected or load_target_spec(cfg.engine.model, cfg.engine)
            assistant = load_target_spec(opt("assistant"), cfg.engine) if opt("assistant") is not None else None
            prepared = prepare_items(items, target, opt("max_new_tokens"))
        except (ValueError, FileNotFoundError, OSError) as exc:
            return _error(str(exc))
        if opt("concurrency"):
            if (opt("target") or "local") == "mesh" and not opt("addr") and injected is not None:
                return _error("--target mesh without --addr starts a mesh for --model, which must be a model spec")
            return _run_concurrency(args, cfg, target, prepared, threads, tls_ca)
        if (opt("api") or "grpc") == "openai":
            return _run_faces(args, cfg, prepared, methods, repeats, tls_ca, injected is not None)
        if mesh_methods and not opt("addr") and injected is not None:
            return _error("--target mesh without --addr starts a mesh for --model, which must be a model spec")
        mesh_info: dict[str, Any] | None = None
        try:
            with contextlib.ExitStack() as cleanup:
                runners = [
                    make_runner(m, target, assistant=assistant, builder_config=cfg.builder,
                                source_options=cfg.sources.options, source_deadline_s=cfg.sources.deadline_s)
                    for m in methods
                    if m.family not in ("mesh", "vllm")
                ]
                model_spec = cfg.engine.model if injected is None else getattr(target, "name", "")
                dtype = str(target.dtype).replace("torch.", "")
                for m in vllm_methods:
                    try:
                        worker = start_vllm(vllm_python, local_model_folder(model_spec), dtype=dtype, threads=threads,
                                            max_len=max_model_len(prepared, target.max_context), method=m.name,
                                            eager=bool(opt("vllm_eager")))
                    except (VLLMError, ValueError, FileNotFoundError) as exc:
                        return _error(str(exc))
                    cleanup.callback(worker.close)
                    runners.append(VLLMRunner(m.name, worker, target.eos_token_ids, target.tokenizer))
                if mesh_methods:
                    try:
                        mesh_runners, mesh_info, measure_memory = open_mesh(
                            cleanup, mesh_methods, without_prefix_pool(cfg), addr=opt("addr"), api_key=opt("api_key"),
                            tls_ca=tls_ca, max_nodes=opt("max_nodes"),
                        )
                    except MeshError as exc:
                        return _error(str(exc))
                    runners += mesh_runners
                try:
                    results = execute(
                        runners, prepared, repeats, progress=not opt("no_progress"), tokenizer=target.tokenizer
                    )
                except (MeshError, VLLMError) as exc:
                    return _error(str(exc))
                if mesh_info is not None and mesh_info.get("started_by_bench"):
                    mesh_info["memory"] = measure_memory()
        except KeyboardInterrupt:
            stopped = " (the mesh it started is stopped)" if mesh_methods and not opt("addr") else ""
            print(f"draftmesh bench: interrupted{stopped}", file=sys.stderr)
            return EXIT_INTERRUPTED
        startup = None
        if vllm_methods:
            startup = cold_starts(runners, methods, model_spec, dtype, threads, prepared)
        measure_fidelity(results)
        by_id = {p.id: p for p in prepared}
        plain = {r.item_id: r for r in results if r.method == PLAIN}
        for r in results:
            if r.identical_to_plain is False and r.first_difference is not None:
                ref = plain[r.item_id].runs[r.mismatch_repeat or 0].token_ids
                try:
                    r.mismatch_top2_gap = top2_gap(target, by_id[r.item_id].prompt_ids, ref[: r.first_difference])
                except Exception:  # noqa: BLE001 - the gap is a diagnostic only
                    r.mismatch_top2_gap = None
        cost_curve = {}
        if not opt("no_cost_curve"):
            cost_curve = target.cost_curve or target.measure_cost_curve()
        meta = {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": opt("command_line") or command_line("draftmesh bench"),
            "machine": machine_info(),
            "dtype": str(target.dtype).replace("torch.", ""),
            "device": str(target.device),
            "assistant": getattr(assistant, "name", None),
            "workload": {"path": str(args.workload), "items": len(prepared)},
            "max_new_tokens_override": opt("max_new_tokens"),
            "max_nodes": cfg.builder.max_nodes,
            "cost_curve": {str(k): round(v, 4) for k, v in cost_curve.items()},
            "step_ms": round(1e3 * target.step_seconds, 4) if cost_curve and target.step_seconds else None,
            "costs_from_cache": _costs_from_cache(target),
        }
        if startup is not None:
            meta["startup"] = startup
        name = cfg.engine.model if injected is None else getattr(target, "name", "model")
        meta["target"] = target_kind
        traced = next((r.tracing for r in runners if getattr(r, "tracing", None) is not None), None)
        if traced is not None:
            meta["traced_spans_exported"] = traced.exported()
            meta["untraced_step_span_cost_us"] = round(noop_step_cost_us(), 2)
        report = BenchReport(name, threads, repeats, results, skipped, meta, mesh=mesh_info)
        print(format_report(report))
        _write_outputs(opt("json"), lambda: report_to_json(report), opt("plot"), lambda path: write_plot(report, path))
        return EXIT_MISMATCH if any(r.identical_to_plain is False and not r.other_engine for r in results) else EXIT_OK
    finally:
        compute.set_threads(old_threads)


def _costs_from_cache(target) -> bool:
    """Whether the forward's costs the budget weighed were read from ``engine.cost_cache`` (timed by an
    earlier process) rather than measured in this run: said in the report and printed."""
    cached = bool(getattr(target, "costs_from_cache", False))
    if cached:
        print(f"forward costs read from {target.cost_cache} (engine.cost_cache), not measured in this run")
    return cached


def _write_outputs(json_path, payload, plot_path, plot) -> None:
    """The report's JSON (``payload()``) and chart (``plot(path)``), where the flags asked for them."""
    if json_path:
        print(f"wrote {write_json(json_path, payload())}")
    if plot_path:
        Path(plot_path).parent.mkdir(parents=True, exist_ok=True)
        plot(plot_path)
        print(f"wrote {plot_path}")


def _run_concurrency(args, cfg, target, prepared, threads: int, tls_ca: bytes | None = None) -> int:
    opt = lambda name, default=None: getattr(args, name, default)  # noqa: E731
    try:
        levels = [int(x) for x in str(opt("concurrency")).split(",") if x.strip()]
        if not levels or min(levels) < 1:
            raise ValueError
    except ValueError:
        return _error(f"--concurrency: a comma-separated list of positive integers, got {opt('concurrency')!r}")
    try:
        methods = concurrency_methods(opt("methods"))
    except ValueError as exc:
        return _error(str(exc))
    loads: dict = {}
    external: dict = {}
    note = None
    with contextlib.ExitStack() as cleanup:
        if (opt("target") or "local") == "mesh":
            from draftmesh.bench.mesh_load import MeshLoad, verifier_batch_stats  # lazy: only this mode
            from draftmesh.bench.methods import MESH_METHODS

            # The bench's own mesh runs as many requests at once as the highest level asks for.
            top = max(levels)
            cfg = cfg.replace(serve={"verifier_max_ongoing": max(cfg.serve.verifier_max_ongoing, top),
                                     "max_in_flight": max(cfg.serve.max_in_flight, top)})
            try:
                mesh_runners, info, _ = open_mesh(cleanup, [m for m in parse_methods(",".join(MESH_METHODS))
                                                            if m.family == "mesh"], cfg, addr=opt("addr"),
                                                  api_key=opt("api_key"), tls_ca=tls_ca, max_nodes=opt("max_nodes"))
            except MeshError as exc:
                return _error(str(exc))
            stats = verifier_batch_stats if info.get("started_by_bench") else None

            def fresh(runner):
                def make():
                    runner.reset()  # a pass starts from a reset mesh, as each in-process pass from a fresh decoder
                    return MeshLoad(runner, stats)
                return make

            loads = {r.name: fresh(r) for r in mesh_runners}
            # in-process methods named in --methods run in the same run, beside the mesh, so that
            # each mesh method has its in-process twin measured under the same conditions
            local = [m for m in methods if m not in (PLAIN_SERIAL, VLLM_CONCURRENT)] if opt("methods") else []
            methods = [PLAIN_SERIAL, *local, *loads, *([VLLM_CONCURRENT] if VLLM_CONCURRENT in methods else [])]
            note = (f"{', '.join([PLAIN_SERIAL, *local])} run in-process ({PLAIN_SERIAL}: the reference, batch-1 "
                    f"plain decoding); {', '.join(loads)} through the mesh's gRPC face at {info['address']}")
        if VLLM_CONCURRENT in methods:
            try:
                worker = start_vllm(find_vllm_python(opt("vllm_python")), local_model_folder(cfg.engine.model),
                                    dtype=str(target.dtype).replace("torch.", ""), threads=threads,
                                    max_len=max_model_len(prepared, target.max_context), eager=bool(opt("vllm_eager")))
            except (VLLMError, ValueError, FileNotFoundError) as exc:
                return _error(str(exc))
            cleanup.callback(worker.close)
            external[VLLM_CONCURRENT] = closed_loop_pass(worker, target.eos_token_ids)
        print(f"draftmesh bench --concurrency {','.join(map(str, levels))}: {len(prepared)} items, methods {', '.join(methods)}")
        try:
            report = run_concurrency(target, prepared, levels, methods, engine=cfg.engine, builder=cfg.builder,
                                     source_options=cfg.sources.options, source_deadline_s=cfg.sources.deadline_s,
                                     repeats=opt("repeats") or 1,
                                     probe_tokens=opt("prefill_probe_tokens"), loads=loads, external=external)
        except MeshError as exc:
            return _error(str(exc))
    if note:
        report["note"] = note
        report["target"] = "mesh"
        report["mesh_vs_local"] = {m: {str(c): round(v, 3) for c, v in per_c.items()}
                                   for m, per_c in mesh_ratios(report["rows"]).items()}
    report["meta"] = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                      "command": opt("command_line") or command_line("draftmesh bench"), "machine": machine_info(),
                      "model": cfg.engine.model, "threads": threads, "dtype": str(target.dtype).replace("torch.", ""),
                      "workload": {"path": str(args.workload), "items": len(prepared)},
                      "costs_from_cache": _costs_from_cache(target)}
    if VLLM_CONCURRENT in methods and opt("vllm_eager"):
        report["meta"]["vllm_eager"] = True
    print(format_concurrency(report))
    if report["meta"].get("vllm_eager"):
        print("vllm ran eager (--vllm-eager, no torch.compile): its figures are not vLLM's best")
    _write_outputs(opt("json"), lambda: report, opt("plot"), lambda path: plot_concurrency(report, path))
    # another engine's outputs are compared for agreement (shown), not required to match (see vllm_runner)
    # rows without a plain-serial pass to compare with hold None
    mismatched = sum(r["outputs"] - r["identical_to_plain_serial"] for r in report["rows"]
                     if r["method"] not in external and r["identical_to_plain_serial"] is not None)
    return EXIT_MISMATCH if mismatched else EXIT_OK


def _run_faces(args, cfg, prepared, methods, repeats: int, tls_ca, injected: bool) -> int:
    """``--api openai``: the mesh methods through both faces of one mesh (``draftmesh.bench.faces``)."""
    from draftmesh.bench.faces import faces_report, format_faces, plot_faces, run_faces  # lazy: only this mode
    from draftmesh.bench.methods import MESH_DRAFTMESH
    from draftmesh.bench.openai_runner import OpenAIRunner  # lazy: imports openai
    from draftmesh.client import api_key_from_env

    opt = lambda name, default=None: getattr(args, name, default)  # noqa: E731
    if not opt("addr") and injected:
        return _error("--target mesh without --addr starts a mesh for --model, which must be a model spec")
    # Only the mesh methods run (default: mesh:draftmesh); the in-process ones are not part of this comparison.
    mesh_methods = [m for m in methods if m.family == "mesh"] if opt("methods") else \
        [m for m in parse_methods(MESH_DRAFTMESH) if m.family == "mesh"]
    try:
        with contextlib.ExitStack() as cleanup:
            try:
                grpc_runners, info, measure_memory = open_mesh(
                    cleanup, mesh_methods, without_prefix_pool(cfg), addr=opt("addr"), api_key=opt("api_key"),
                    tls_ca=tls_ca, max_nodes=opt("max_nodes"), http=True)
            except MeshError as exc:
                return _error(str(exc))
            http_addr = opt("http_addr") or info.get("http_address")
            info["http_address"] = http_addr
            key = api_key_from_env(opt("api_key")) if opt("addr") else None
            runners = {}
            for r in grpc_runners:
                http = OpenAIRunner(r.name, f"http://{http_addr}/v1", model=cfg.engine.model, api_key=key,
                                    speculate=r.speculate, session_suffix=r.session_suffix)
                cleanup.callback(http.close)
                runners[r.name] = {"grpc": r, "http": http}
            try:
                runs = run_faces(runners, prepared, repeats, reset=grpc_runners[0].reset)
            except MeshError as exc:
                return _error(str(exc))
            if info.get("started_by_bench"):
                info["memory"] = measure_memory()
    except KeyboardInterrupt:
        print("draftmesh bench: interrupted" + ("" if opt("addr") else " (the mesh it started is stopped)"),
              file=sys.stderr)
        return EXIT_INTERRUPTED
    report = faces_report(runs, prepared, repeats, info)
    report["meta"] = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                      "command": opt("command_line") or command_line("draftmesh bench"), "machine": machine_info(),
                      "model": cfg.engine.model, "threads": cfg.engine.threads,
                      "workload": {"path": str(args.workload), "items": len(prepared)}}
    print(format_faces(report))
    _write_outputs(opt("json"), lambda: report, opt("plot"), lambda path: plot_faces(report, path))
    return EXIT_MISMATCH if any(s["mismatches"] for s in report["summary"].values()) else EXIT_OK


def cold_starts(runners, methods, model_spec: str, dtype: str, threads: int, prepared) -> dict[str, Any]:
    """Each engine's cold start and memory, measured alike: the vLLM workers' own (spawned for the
    run, first request = the warm-up), and ours from a fresh ``engine_worker`` process given the
    same first request, for plain and (if it ran) draftmesh with its default sources."""
    first = prepared[0]
    warmup = PreparedItem(first.item, first.prompt_ids, min(WARMUP_TOKENS, first.max_new_tokens))
    engines: dict[str, Any] = {}
    names = {m.name for m in methods}
    for name, sources in ((PLAIN, "plain"), (DRAFTMESH, None)):
        if name not in names:
            continue
        try:
            engines[name] = our_engine_startup(model_spec, dtype=dtype, threads=threads, sources=sources,
                                               item=warmup, what=f"draftmesh ({'plain' if sources else 'default sources'})")
        except Exception as exc:  # noqa: BLE001 - a diagnostic: the run's results stand without it
            engines[name] = {"engine": "draftmesh", "error": str(exc)}
    for r in runners:
        if isinstance(r, VLLMRunner) and r.startup is not None:
            engines[r.name] = r.startup
    return {"first_request_tokens": warmup.max_new_tokens, "engines": engines}
