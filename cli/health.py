"""`draftmesh health`: is a running mesh's gRPC front door up and serving the draftmesh app?

One line and an exit code (a container health check's contract) around
``draftmesh.serve_health.check_health``, which says what is asked and why.
"""

from __future__ import annotations

import argparse
import sys

from draftmesh.serve_health import (DEFAULT_ADDR, DEFAULT_APPLICATION, DEFAULT_TIMEOUT_S, HEALTHZ_METHOD,
                                    LIST_APPLICATIONS_METHOD, HealthStatus, check_health)

__all__ = ["DEFAULT_ADDR", "DEFAULT_APPLICATION", "DEFAULT_TIMEOUT_S", "HEALTHZ_METHOD", "LIST_APPLICATIONS_METHOD",
           "HealthStatus", "add_health_arguments", "check_health", "run_health_cli"]


def add_health_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `draftmesh health`."""
    parser.add_argument("--addr", default=DEFAULT_ADDR, help=f"the mesh's gRPC host:port (default {DEFAULT_ADDR})")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help=f"seconds for both calls together (default {DEFAULT_TIMEOUT_S:g})")
    parser.add_argument("--application", default=DEFAULT_APPLICATION,
                        help=f"the Serve application that must be listed (default {DEFAULT_APPLICATION})")


def run_health_cli(args: argparse.Namespace) -> int:
    """Print one line; 0 when healthy, 1 when not (a container health check's contract)."""
    status = check_health(args.addr, args.application, args.timeout)
    if status.healthy:
        print(f"healthy: {status.message}", flush=True)
        return 0
    print(f"unhealthy: {status.message}", file=sys.stderr, flush=True)
    return 1
