"""The process's handlers of the fatal signals (SIGSEGV and kin), saved to be put back.

Why: ``ray.init`` installs Ray's own handlers for these signals and ``ray.shutdown`` resets them to
the default action, dropping whatever was there before (Python's ``faulthandler``, which
``faulthandler.is_enabled()`` still reports as on). A native crash after a Ray shutdown then kills
the process with no traceback at all: three clean-clone CI runs ended so, after every test had
passed, with nothing to say where. Saved before Ray starts and restored after it stops, the
handlers print the crashing threads again.

The handlers are C-level (``sigaction``), which Python's ``signal`` module cannot read back, so they
are copied as opaque ``struct sigaction`` bytes through libc. Linux and macOS; elsewhere a no-op.
"""

from __future__ import annotations

import ctypes
import signal
import sys
from dataclasses import dataclass, field

FATAL_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGSEGV", "SIGFPE", "SIGABRT", "SIGBUS", "SIGILL") if hasattr(signal, name)
)
"""The signals ``faulthandler`` handles."""

_SIGACTION_BYTES = 512
"""Room for a ``struct sigaction`` (152 bytes on Linux x86-64, less on macOS), copied as it is."""


def _libc():
    if not sys.platform.startswith(("linux", "darwin")):
        return None
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


@dataclass
class FatalSignalHandlers:
    """A snapshot of the fatal signals' handlers (``save``), to ``restore`` once another library
    has replaced them."""

    saved: dict[int, ctypes.Array] = field(default_factory=dict)

    @classmethod
    def save(cls) -> "FatalSignalHandlers":
        libc = _libc()
        saved: dict[int, ctypes.Array] = {}
        if libc is not None:
            for sig in FATAL_SIGNALS:
                action = ctypes.create_string_buffer(_SIGACTION_BYTES)
                if libc.sigaction(int(sig), None, action) == 0:
                    saved[int(sig)] = action
        return cls(saved)

    def restore(self) -> None:
        libc = _libc()
        if libc is None:
            return
        for sig, action in self.saved.items():
            libc.sigaction(sig, action, None)
