"""Memory of processes the bench started (a mesh, an engine worker): resident and proportional
set sizes summed over a set of processes, read with psutil."""

from __future__ import annotations

from typing import Any, Iterable


def processes_memory(procs: Iterable) -> dict[str, Any]:
    """``rss_mb`` sums resident set sizes (shared pages counted once per process), ``pss_mb``
    proportional set sizes (shared pages split; None where unreadable), ``processes`` and their
    names; processes that ended meanwhile are skipped."""
    import psutil

    rss = pss = 0
    count, pss_ok = 0, True
    names: dict[str, int] = {}
    for proc in procs:
        try:
            rss += proc.memory_info().rss
            name = proc.name()
        except psutil.Error:
            continue
        count += 1
        names[name] = names.get(name, 0) + 1
        try:
            pss += proc.memory_full_info().pss
        except (psutil.Error, AttributeError):
            pss_ok = False
    return {
        "rss_mb": round(rss / 2**20, 1),
        "pss_mb": round(pss / 2**20, 1) if pss_ok and count else None,
        "processes": count,
        "process_names": dict(sorted(names.items())),
    }


def process_tree_memory(pid: int) -> dict[str, Any] | None:
    """``processes_memory`` of ``pid`` and all its descendants; None without psutil or when
    the process is gone."""
    try:
        import psutil
    except ImportError:
        return None
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    return processes_memory(procs)
