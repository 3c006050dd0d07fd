"""A draft source that records the torch width its calls run at: the llm source runs its model in
``propose``, on whatever worker thread calls it (see ``draftmesh.compute.confine_side_thread``)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from draftmesh import compute
from draftmesh.draft.base import DraftContext, Proposal


class ThreadWidthSource:
    name = "llm"

    def __init__(self, env=None, **options) -> None:  # also a Serve draft deployment's factory
        self.widths: list[int] = []

    def propose(self, ctx: DraftContext) -> list[Proposal]:
        self.widths.append(torch.get_num_threads())
        return []


@contextmanager
def process_width(n: int) -> Iterator[None]:
    """The process's torch width set to ``n`` (so that a new worker thread would start at it)."""
    before = compute.get_threads()
    compute.set_threads(n)
    try:
        yield
    finally:
        compute.set_threads(before)


class ComputeBoundSource:
    """A source that says it runs a model (``compute_bound``): records the threads it ran on."""

    name = "llm"
    compute_bound = True

    def __init__(self, env=None, **options) -> None:
        import threading

        self._ident = threading.get_ident
        self.threads: list[int] = []

    def propose(self, ctx: DraftContext) -> list[Proposal]:
        self.threads.append(self._ident())
        return [Proposal(self.name, token_ids=(9,))]


def compute_thread() -> int:
    import threading

    return compute.run(threading.get_ident)
