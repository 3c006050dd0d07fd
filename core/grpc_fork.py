"""gRPC's fork handlers off in every draftmesh process, unless its environment says otherwise.

Why: grpcio's core registers ``pthread_atfork`` handlers ("fork support") that, in the child of a
fork, restart its pollers over state copied from threads that do not exist there. Python runs those
handlers whenever it forks with a ``preexec_fn``, and ``ray.init`` starts every process of a local
Ray node so (its ``preexec_fn`` blocks SIGINT and sets the parent-death signal). With a gRPC server
busy in the same process (the mesh's gateway starts first), the child then aborts or hangs before
it runs the program:

- measured on grpcio 1.85.1 with two threads calling a local server: 122 of 300 ``preexec_fn``
  forks killed by SIGABRT (gRPC: "epoll_wait error: Bad file descriptor"); with the variable
  explicitly 1, the process hung at the fourth fork; with it 0, none of 300 died;
- in CI, the raylet of ``draftmesh demo`` died so twice in a row (no ``raylet.out``: it never ran),
  and ``ray.init`` gave up after its fixed 30 s wait for the node each time: "The current node timed
  out during startup". Other starts lost the dashboard (return code -6) or the GCS (90 s wait).

We never use gRPC in a forked child that does not exec (Ray, Redis and the fact-check workers are
all programs started fresh), so the handlers buy nothing here. The variable must be set before
grpcio loads: importing ``draftmesh`` sets it, and ``handlers_off()`` tells whether that was in
time (a program that imported ``grpc`` first keeps whatever its environment said).
"""

from __future__ import annotations

import os
import sys

ENV = "GRPC_ENABLE_FORK_SUPPORT"
_OFF = {"0", "false", "no", "off"}

_grpc_loaded_first = "grpc" in sys.modules
_value_before = os.environ.get(ENV)
os.environ.setdefault(ENV, "0")  # a user's own setting, either way, is kept


def handlers_off() -> bool:
    """Whether grpcio in this process runs no fork handlers: the variable was off when it loaded
    (or, not loaded yet, is off now)."""
    value = _value_before if _grpc_loaded_first else os.environ.get(ENV)
    return (value or "").strip().lower() in _OFF
