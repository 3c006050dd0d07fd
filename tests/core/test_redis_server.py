"""How ``draftmesh.redis_server`` starts its children (redis-server, fact-check workers): tied to
the parent's life, and without running fork handlers in the child. The redis-server behaviour
itself (ports, PING, dying with a killed parent) is tested in tests/draft/test_redis_store.py."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from draftmesh import redis_server
from draftmesh.redis_server import dying_with_parent, find_redis_server

CHILD_PROBE = ("import ctypes, os; sig = ctypes.c_int(); "
               "ctypes.CDLL(None).prctl(2, ctypes.byref(sig)); print(os.nice(0), sig.value)")
"""Run as the child: prints its niceness and its parent-death signal (PR_GET_PDEATHSIG = 2)."""

linux = pytest.mark.skipif(sys.platform != "linux", reason="parent-death signal is Linux-only")


@linux
@pytest.mark.skipif(find_redis_server() is None, reason="no redis-server")
def test_starting_redis_runs_no_fork_handler_in_the_child(tmp_path):
    """A preexec_fn made Python fork the whole process and run every at-fork handler in the
    child (gRPC's too, which once killed it before redis-server ran): none may run now."""
    marker = tmp_path / "forked"
    code = textwrap.dedent(f"""
        import os
        from draftmesh.redis_server import EmbeddedRedis
        os.register_at_fork(after_in_child=lambda: open({str(marker)!r}, "a").write(f"{{os.getpid()}}\\n"))
        with EmbeddedRedis() as r:
            print(r.port)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) > 0
    assert not marker.exists(), f"an at-fork handler ran in the child: {marker.read_text()}"


@linux
def test_setpriv_sets_the_parent_death_signal_and_nice_the_niceness():
    if not (redis_server.shutil.which("setpriv") and redis_server.shutil.which("nice")):
        pytest.skip("no setpriv or nice")
    command, setup = dying_with_parent(["redis-server", "--port", "1"])
    assert setup is None
    assert command[1:] == ["--pdeathsig", "TERM", "--", "redis-server", "--port", "1"]
    command, setup = dying_with_parent(["python", "-m", "x"], nice=10)
    assert setup is None and command[-5:] == ["-n", "10", "python", "-m", "x"]
    # and it really does: the child's niceness and parent-death signal, read back from the child
    command, _ = dying_with_parent([sys.executable, "-c", CHILD_PROBE], nice=5)
    niceness, sig = subprocess.run(command, capture_output=True, text=True, check=True).stdout.split()
    assert int(niceness) == os.nice(0) + 5 and int(sig) == int(redis_server.signal.SIGTERM)


@linux
def test_without_setpriv_a_preexec_fn_does_it(monkeypatch):
    monkeypatch.setattr(redis_server.shutil, "which", lambda name: None)
    command, setup = dying_with_parent(["redis-server"], nice=3)
    assert command == ["redis-server"] and setup is not None
    out = subprocess.run([sys.executable, "-c", CHILD_PROBE], preexec_fn=setup, capture_output=True, text=True, check=True)
    niceness, sig = out.stdout.split()
    assert int(niceness) == os.nice(0) + 3 and int(sig) == int(redis_server.signal.SIGTERM)
