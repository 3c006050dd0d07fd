"""An engine in a child process, driven over JSON lines: how the bench runs an engine that must
not live in its own process (vLLM, which needs its own environment) and how it measures any
engine's start-up and memory from a cold process (ours too, with ``engine_worker``).

The protocol is ``vllm_worker``'s docstring: the child writes one ``ready`` line once its
engine is loaded, then answers each ``generate`` line with one ``result`` (or ``error``) line;
``exit`` or end of input ends it. The child's stderr goes to a log file whose tail is quoted
in every error, so a failed start says why.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from draftmesh.bench.memory import process_tree_memory

LOG_TAIL_CHARS = 2000


class WorkerError(RuntimeError):
    """The worker could not start, died, timed out or failed a request."""


class WorkerProcess:
    """One child engine process (``command``), started at construction.

    ``ready_s``: seconds from spawn to its ready line (the engine loaded);
    ``first_result_s``: ``ready_s`` plus the time its first request took (what a user who sends
    a request as soon as the engine is up waits for; idle time between the two, e.g. while the
    bench starts another worker, is not counted);
    ``ready``: the ready line's fields (load time in the child, versions, pid).
    """

    def __init__(
        self,
        command: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        start_timeout_s: float = 600.0,
        request_timeout_s: float = 600.0,
        name: str = "worker",
    ) -> None:
        self.name = name
        self.command = list(command)
        self.request_timeout_s = request_timeout_s
        self.first_result_s: float | None = None
        self._broken = False
        """Timed out or broke the protocol: ``close`` kills it without waiting for an exit."""
        self._log = tempfile.NamedTemporaryFile(prefix=f"draftmesh-{name}-", suffix=".log", delete=False)
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._t0 = time.perf_counter()
        try:
            self._proc = subprocess.Popen(
                self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                env=None if env is None else dict(env), text=True, bufsize=1, start_new_session=True,
            )
        except OSError as exc:
            self._log.close()
            raise WorkerError(f"{name}: cannot start {self.command[0]}: {exc.strerror or exc}") from exc
        threading.Thread(target=self._read, daemon=True, name=f"{name}-stdout").start()
        try:
            self.ready = self._expect("ready", start_timeout_s, "start")
        except BaseException:
            self.close()
            raise
        self.ready_s = time.perf_counter() - self._t0

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def log_path(self) -> str:
        return self._log.name

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def log_tail(self) -> str:
        with contextlib.suppress(OSError):
            text = Path(self._log.name).read_text(errors="replace")
            return text[-LOG_TAIL_CHARS:].strip()
        return ""

    def _fail(self, what: str) -> WorkerError:
        self._broken = True
        tail = self.log_tail()
        return WorkerError(f"{self.name}: {what}" + (f"; the end of its log:\n{tail}" if tail else ""))

    def _expect(self, event: str, timeout_s: float, what: str) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._fail(f"no {event!r} within {timeout_s:.0f} s ({what})")
            try:
                line = self._lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                code = self._proc.wait()
                raise self._fail(f"exited with status {code} before {event!r} ({what})")
            try:
                msg = json.loads(line)
            except ValueError:
                raise self._fail(f"wrote a line that is not JSON: {line[:200]!r}") from None
            if msg.get("event") == event:
                return msg
            if msg.get("event") == "error":
                raise WorkerError(f"{self.name}: {what}: {msg.get('message')}")
            raise self._fail(f"sent {msg.get('event')!r} where {event!r} was due ({what})")

    def generate(self, request_id: str, prompt_ids: Sequence[int], max_new_tokens: int,
                 stop_token_ids: Sequence[int] = ()) -> dict[str, Any]:
        """One greedy generation: the result line (``token_ids``, ``seconds`` in the child, ...)."""
        msg = {"op": "generate", "id": request_id, "prompt_ids": list(prompt_ids),
               "max_new_tokens": int(max_new_tokens), "stop_token_ids": list(stop_token_ids)}
        sent = time.perf_counter()
        try:
            assert self._proc.stdin is not None
            self._proc.stdin.write(json.dumps(msg) + "\n")
            self._proc.stdin.flush()
        except (OSError, ValueError) as exc:  # a broken pipe, or closed already
            raise self._fail(f"cannot send request {request_id!r}: {exc}") from exc
        result = self._expect("result", self.request_timeout_s, f"request {request_id!r}")
        if result.get("id") != request_id:
            raise self._fail(f"answered {result.get('id')!r} to request {request_id!r}")
        if self.first_result_s is None:
            self.first_result_s = self.ready_s + (time.perf_counter() - sent)
        return result

    def closed_loop(self, pass_id: str, requests: Sequence[dict[str, Any]], concurrency: int,
                    timeout_s: float | None = None) -> dict[str, Any]:
        """Every request once with ``concurrency`` in flight inside the worker (the vLLM worker's
        ``closed_loop`` op): its ``closed_loop_result`` line (per-request results, ``seconds``)."""
        msg = {"op": "closed_loop", "id": pass_id, "concurrency": int(concurrency), "requests": list(requests)}
        try:
            assert self._proc.stdin is not None
            self._proc.stdin.write(json.dumps(msg) + "\n")
            self._proc.stdin.flush()
        except (OSError, ValueError) as exc:
            raise self._fail(f"cannot send pass {pass_id!r}: {exc}") from exc
        wait = timeout_s if timeout_s is not None else self.request_timeout_s
        result = self._expect("closed_loop_result", wait, f"pass {pass_id!r}")
        if result.get("id") != pass_id:
            raise self._fail(f"answered {result.get('id')!r} to pass {pass_id!r}")
        return result

    def memory(self) -> dict[str, Any] | None:
        """Memory of the worker and every process it started (vLLM's engine core is one)."""
        return process_tree_memory(self._proc.pid)

    def close(self, timeout_s: float = 20.0) -> None:
        """Ask the worker to exit, kill its process group if it does not within ``timeout_s``,
        and kill what is left of the group either way (vLLM's engine core is a child)."""
        descendants = self._descendants()
        if self._proc.poll() is None and not self._broken:
            with contextlib.suppress(OSError, ValueError):
                assert self._proc.stdin is not None
                self._proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self._proc.stdin.close()
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, signal.SIGKILL)
        self._proc.wait()
        if descendants:  # gone before we return, not just signalled (a worker's memory is large)
            import psutil  # lazy: only a worker that started children needs it

            psutil.wait_procs(descendants, timeout=10)
        with contextlib.suppress(OSError, ValueError):
            if self._proc.stdin is not None:
                self._proc.stdin.close()
        self._log.close()
        with contextlib.suppress(OSError):
            os.unlink(self._log.name)

    def _descendants(self) -> list:
        try:
            import psutil  # lazy: optional, as for memory()
        except ImportError:
            return []
        try:
            return psutil.Process(self._proc.pid).children(recursive=True)
        except psutil.Error:
            return []

    def __enter__(self) -> "WorkerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
