"""Fact-check workers as child processes of ``draftmesh serve``, in their own environment.

The worker's environment may differ from the engine's (flair pins transformers < 5), so a
worker is started with that environment's interpreter: ``factcheck.python`` if given
(DRAFTMESH_FACTCHECK_PYTHON), else a ``.venv-factcheck`` beside the running venv
(what ``make factcheck-env`` builds), else this interpreter (fine for the spaCy backend).
Children get SIGTERM when ``serve`` dies, even by SIGKILL, so no worker outlives it.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Sequence

import redis
import yaml

from draftmesh.config import FactCheckConfig
from draftmesh.factcheck.protocol import StreamNames, as_str
from draftmesh.redis_server import dying_with_parent

log = logging.getLogger(__name__)


def find_worker_python(explicit: str | None = None) -> str:
    """``explicit`` (the config's ``factcheck.python``), else the fact-check venv beside this one,
    else this interpreter."""
    if explicit:
        return explicit
    sibling = Path(sys.prefix).parent / ".venv-factcheck" / "bin" / "python"
    if sibling.exists():
        return str(sibling)
    return sys.executable


class WorkerProcesses:
    """``count`` workers started with ``python -m draftmesh.factcheck.worker --config FILE``."""

    def __init__(self, config: FactCheckConfig, count: int, python: str | None = None,
                 extra_args: Sequence[str] = (), nice: int = 10) -> None:
        if not config.redis_url:
            raise ValueError("fact-check workers need a Redis URL")
        self.config = config
        self.count = count
        self.python = find_worker_python(python)
        self.extra_args = list(extra_args)
        self.nice = nice
        """Workers run at a lower CPU priority: on one machine they share the cores with the
        engine, whose steps are latency-critical, while annotation is asynchronous anyway."""
        self.procs: list[subprocess.Popen] = []
        self.names: list[str] = []
        self._dir: tempfile.TemporaryDirectory | None = None

    def start(self) -> "WorkerProcesses":
        self._dir = tempfile.TemporaryDirectory(prefix="draftmesh-factcheck-")
        path = Path(self._dir.name) / "factcheck.yaml"
        path.write_text(yaml.safe_dump(self.config.to_dict()))
        env = dict(os.environ)
        env.setdefault("HF_HUB_OFFLINE", "1")
        for i in range(self.count):
            name = f"factcheck-{os.getpid()}-{i}-{uuid.uuid4().hex[:6]}"
            cmd = [self.python, "-m", "draftmesh.factcheck.worker", "--config", str(path), "--name", name,
                   *self.extra_args]
            self.names.append(name)
            cmd, setup = dying_with_parent(cmd, nice=self.nice)
            self.procs.append(subprocess.Popen(cmd, env=env, preexec_fn=setup))
        log.info("started %d fact-check worker(s) with %s", self.count, self.python)
        return self

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Until every worker has joined the consumer group (it reads once its checks are loaded)."""
        names = StreamNames.from_prefix(self.config.stream_prefix)
        client = redis.Redis.from_url(self.config.redis_url)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                dead = [p.args for p in self.procs if p.poll() is not None]
                if dead:
                    raise RuntimeError(f"a fact-check worker exited during start-up: {dead[0]}")
                try:
                    consumers = client.xinfo_consumers(names.stream, names.group)
                except redis.ResponseError:
                    consumers = []
                joined = {as_str(c["name"]) for c in consumers}
                if joined >= set(self.names):
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError(f"fact-check workers not ready after {timeout_s:.0f}s")
                time.sleep(0.1)
        finally:
            client.close()

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM (workers finish their in-flight entries), then SIGKILL after ``grace_s``."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("fact-check worker %s did not stop in %.0fs; killing it", proc.pid, grace_s)
                proc.kill()
                proc.wait()
        self.procs.clear()
        self.names.clear()
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None
