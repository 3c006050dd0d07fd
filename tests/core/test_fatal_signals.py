"""FatalSignalHandlers puts back the fatal signals' handlers another library reset (Ray's shutdown
does), so that a native crash still prints faulthandler's traceback. Each case crashes a child
process on purpose."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CRASH = textwrap.dedent("""
    import ctypes, faulthandler, signal, sys
    from draftmesh.fatal_signals import FatalSignalHandlers

    faulthandler.enable()
    handlers = FatalSignalHandlers.save()
    signal.signal(signal.SIGSEGV, signal.SIG_DFL)  # what ray.shutdown leaves behind
    if sys.argv[1] == "restore":
        handlers.restore()
    ctypes.string_at(0)  # a read of address 0: SIGSEGV
""")


def crash(mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CRASH, mode], capture_output=True, text=True, timeout=60)


def test_a_restored_handler_prints_the_crash():
    done = crash("restore")
    assert done.returncode < 0  # killed by the signal, after the dump
    assert "Fatal Python error: Segmentation fault" in done.stderr, done.stderr


def test_a_reset_handler_crashes_silently():
    """The control: what the process does without the restore (the silent CI deaths)."""
    done = crash("reset")
    assert done.returncode < 0
    assert "Fatal Python error" not in done.stderr, done.stderr
