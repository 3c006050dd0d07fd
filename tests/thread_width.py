"""Draft sources that record where their calls run: the torch width of a worker thread (a source
that runs torch without saying so, ``draftmesh.compute.confine_side_thread``), or the thread
itself (a compute-bound one, ``draftmesh.draft.base.propose_on_compute``)."""

from __future__ import annotations

import threading
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
        self.threads: list[int] = []

    def propose(self, ctx: DraftContext) -> list[Proposal]:
        self.threads.append(threading.get_ident())
        return [Proposal(self.name, token_ids=(9,))]


def compute_thread() -> int:
    return compute.run(threading.get_ident)
