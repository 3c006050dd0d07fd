"""Draft sources for the mesh fault tests, deployed as Serve draft deployments by factory path.

Ray workers import this module by name (the mesh fixture puts tests/ on their PYTHONPATH),
exactly as a user's own ``factory: package.module:callable`` source would be imported.
"""

from __future__ import annotations

import time


class RaisingSource:
    name = "boom"

    def propose(self, ctx):
        raise RuntimeError("this draft source always fails")


class HangingSource:
    name = "stuck"

    def propose(self, ctx):
        time.sleep(3600)
        return []


def raising(env, **options):
    return RaisingSource()


def hanging(env, **options):
    return HangingSource()
