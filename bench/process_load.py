"""``python -m draftmesh.bench.process_load --pid P [--seconds S]``: what a process tree takes from
the box while it looks idle: CPU share and wakeups per second (context switches) of every thread of
``P`` and its descendants, over ``S`` seconds, from ``/proc`` (Linux). On two shared cores a
neighbour that wakes often costs the forward more than its CPU share says: each wakeup can
preempt one of the forward's two OpenMP threads, and the other then waits at the next barrier.
The figures on idle meshes and idle vLLM workers in BENCHMARKS.md come from this."""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class ThreadSample:
    pid: int
    tid: int
    name: str
    switches: int
    """voluntary + involuntary context switches so far"""
    cpu_ticks: int
    """user + system time so far, in clock ticks"""


@dataclass(frozen=True)
class ThreadLoad:
    pid: int
    tid: int
    name: str
    wakeups_per_s: float
    cpu_percent: float
    """of one core"""


def process_tree(root: int) -> set[int]:
    """``root`` and every live descendant (through each thread's ``children``)."""
    pids, frontier = {root}, [root]
    while frontier:
        pid = frontier.pop()
        try:
            tids = os.listdir(PROC / str(pid) / "task")
        except OSError:
            continue
        for tid in tids:
            try:
                children = (PROC / str(pid) / "task" / tid / "children").read_text().split()
            except OSError:
                continue
            for child in map(int, children):
                if child not in pids:
                    pids.add(child)
                    frontier.append(child)
    return pids


def sample(pids: set[int]) -> dict[tuple[int, int], ThreadSample]:
    """Every thread of ``pids`` now (threads that end meanwhile are skipped)."""
    out = {}
    for pid in pids:
        try:
            tids = os.listdir(PROC / str(pid) / "task")
        except OSError:
            continue
        for tid in map(int, tids):
            base = PROC / str(pid) / "task" / str(tid)
            try:
                status = (base / "status").read_text()
                stat = (base / "stat").read_text().rsplit(")", 1)[1].split()
                name = (base / "comm").read_text().strip()
            except OSError:
                continue
            fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
            switches = int(fields["voluntary_ctxt_switches"]) + int(fields["nonvoluntary_ctxt_switches"])
            out[(pid, tid)] = ThreadSample(pid, tid, name, switches, int(stat[11]) + int(stat[12]))
    return out


def measure(root: int, seconds: float) -> list[ThreadLoad]:
    """Each thread's wakeups per second and CPU share over ``seconds``, busiest waker first."""
    if seconds <= 0:
        raise ValueError(f"--seconds must be > 0, got {seconds}")
    if not (PROC / str(root)).exists():
        raise ValueError(f"--pid: no process {root}")
    pids = process_tree(root)  # threads and processes started meanwhile have no first sample: not counted
    before = sample(pids)
    t0 = time.monotonic()
    time.sleep(seconds)
    after = sample(pids)
    elapsed = time.monotonic() - t0
    loads = [ThreadLoad(s.pid, s.tid, s.name, (s.switches - before[k].switches) / elapsed,
                        100.0 * (s.cpu_ticks - before[k].cpu_ticks) / TICKS / elapsed)
             for k, s in after.items() if k in before]
    return sorted(loads, key=lambda t: (-t.wakeups_per_s, -t.cpu_percent))


def format_loads(loads: list[ThreadLoad], top: int = 12) -> str:
    procs = {t.pid for t in loads}
    lines = [f"{sum(t.wakeups_per_s for t in loads):.0f} wakeups/s, {sum(t.cpu_percent for t in loads):.1f}% of "
             f"one core, {len(loads)} threads in {len(procs)} processes"]
    lines += [f"  {t.wakeups_per_s:8.1f}/s  {t.cpu_percent:5.1f}%  pid {t.pid} tid {t.tid} {t.name}"
              for t in loads[:top]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pid", type=int, required=True, help="the root of the process tree")
    parser.add_argument("--seconds", type=float, default=10.0, help="how long to watch (default: %(default)s)")
    parser.add_argument("--top", type=int, default=12, help="threads listed (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        print(format_loads(measure(args.pid, args.seconds), args.top))
    except ValueError as exc:
        parser.exit(2, f"draftmesh.bench.process_load: error: {exc}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
