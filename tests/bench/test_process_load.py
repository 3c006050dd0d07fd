"""``draftmesh.bench.process_load``: wakeups and CPU of a real process tree, from /proc."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from draftmesh.bench.process_load import format_loads, main, measure, process_tree

# A child whose second thread wakes every 5 ms, and a parent that only starts it and sleeps.
CHILD = textwrap.dedent("""
    import threading, time
    def tick():
        while True:
            time.sleep(0.005)
    threading.Thread(target=tick, name="ticker", daemon=True).start()
    print("ready", flush=True)
    time.sleep(600)
""")
PARENT = textwrap.dedent("""
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    print(child.pid, flush=True)
    time.sleep(600)
""")


@pytest.fixture
def ticking_tree():
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        yield parent.pid, child
    finally:
        subprocess.run(["pkill", "-P", str(parent.pid)], check=False)
        parent.kill()
        parent.wait()


def test_measures_a_descendants_wakeups_by_thread(ticking_tree):
    parent, child = ticking_tree
    assert {parent, child} <= process_tree(parent)
    loads = measure(parent, 1.0)
    ticker = loads[0]  # the busiest waker comes first: the child's second thread
    assert ticker.pid == child and ticker.tid != child
    assert 60 < ticker.wakeups_per_s < 260  # ~200/s asked; slack for a loaded box
    assert ticker.cpu_percent < 50
    quiet = [t for t in loads if t.pid == parent]
    assert quiet and all(t.wakeups_per_s < 20 for t in quiet)
    text = format_loads(loads, top=1)
    assert "in 2 processes" in text and f"pid {child} tid {ticker.tid}" in text and len(text.splitlines()) == 2


def test_bad_arguments_are_clean_errors(capsys):
    with pytest.raises(ValueError, match="--seconds must be > 0"):
        measure(1, 0)
    with pytest.raises(SystemExit) as exit_:
        main(["--pid", "999999999", "--seconds", "0.1"])
    assert exit_.value.code == 2
    assert "--pid: no process 999999999" in capsys.readouterr().err
