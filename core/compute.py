"""One thread for the process's torch compute.

PyTorch's CPU wheel parallelizes through libgomp, which gives every OS thread that starts a
parallel region a team of worker threads of its own. Idle workers spin between regions, which
is what makes a forward of hundreds of small regions fast; but once the process holds more
such threads than CPUs, libgomp stops the spinning for everyone, and each region wakes its
workers through the kernel. Requests arrive on many threads (a replica's request threads, gRPC
handlers, bench clients), and the step runs on whichever caller finds the batch free, so the
second thread to run a forward doubled every forward: measured on a 2-core box, a one-token
SmolLM2-135M forward took 41 ms on the thread that loaded the model and 80 ms on any other
(46 ms there single-threaded). Every forward, measurement and model load of a target therefore
runs on this one long-lived thread; calls made on it run directly (no deadlock on nesting).

A draft source that runs a model is called here too (``draftmesh.draft.base.propose_on_compute``).
Worker threads that may still run torch (the sources' pool, a draft service's request threads)
do so single-threaded (``confine_side_thread``): with one side thread's team alive, a one-token
SmolLM2-135M step on the compute thread went from 34.9 to 52.9 ms on a 2-core box, and with the
side thread at one thread it stayed at 33.4.
"""

from __future__ import annotations

import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None
_ident: int | None = None
_width: int | None = None
"""The compute thread's intra-op width once known (``set_threads``, or what ``confine_side_thread``
found): applied when the thread starts, since torch starts new threads at its latest setting."""


def _start(fn: Callable[..., T], args, kwargs) -> T:
    global _ident
    _ident = threading.get_ident()
    return fn(*args, **kwargs)


def _init_compute_thread() -> None:
    if _width is not None:
        import torch

        torch.set_num_threads(_width)


def run(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` on the compute thread; its result, or its exception."""
    global _executor
    if threading.get_ident() == _ident:
        return fn(*args, **kwargs)
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="draftmesh-compute",
                                           initializer=_init_compute_thread)
        executor = _executor
    return executor.submit(_start, fn, args, kwargs).result()


def on_compute_thread(fn: Callable[..., T]) -> Callable[..., T]:
    """Decorate a function (or method) so that it always runs on the compute thread."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        return run(fn, *args, **kwargs)

    return wrapper


def set_threads(n: int) -> None:
    """``torch.set_num_threads(n)`` for the compute thread and the caller: OpenMP keeps the
    width of parallel regions per thread, so setting it elsewhere leaves the compute thread's."""
    import torch  # lazy: the module itself is plain threading

    global _width
    _width = n
    torch.set_num_threads(n)
    run(torch.set_num_threads, n)


def get_threads() -> int:
    """The compute thread's intra-op width."""
    import torch

    return run(torch.get_num_threads)


def confine_side_thread() -> None:
    """Make the calling thread's torch ops single-threaded (a no-op on the compute thread).

    For the initializer of worker pools whose tasks may run torch (draft sources): libgomp gives
    each thread that starts a parallel region a team of its own, and once the process holds more
    team threads than CPUs it stops their spinning, the compute thread's included, so that every
    region of every forward wakes its workers through the kernel. A side thread at one thread
    starts no team. ``torch.set_num_threads`` also sets the width torch starts later threads at;
    the compute thread keeps its own (``_width``, applied when it starts)."""
    global _width
    if threading.get_ident() == _ident:
        return
    import torch

    with _lock:
        if _width is None:
            _width = torch.get_num_threads()  # this thread's first torch call: the process's width
    torch.set_num_threads(1)


def _after_fork_in_child() -> None:  # the child has none of the parent's threads
    global _executor, _ident, _lock
    _executor, _ident, _lock = None, None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; the platform's processor or machine elsewhere): what a
    timing of the compute depends on, for the bench's report and the cost cache's fingerprint."""
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def usable_cpus() -> int | None:
    """CPUs this process may run on (its affinity where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
