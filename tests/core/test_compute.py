"""Every torch forward of the process runs on one thread (libgomp slows every parallel region
down once several threads have run them; see draftmesh.compute)."""

from __future__ import annotations

import multiprocessing
import threading

import pytest
import torch

from draftmesh import compute
from draftmesh.io_struct import GenerationRequest
from draftmesh.verify.decoder import SpeculativeDecoder
from thread_width import process_width


def test_run_is_one_thread_nests_and_raises():
    here = threading.get_ident()
    idents = {compute.run(threading.get_ident) for _ in range(3)}
    assert len(idents) == 1 and here not in idents
    assert compute.run(lambda: compute.run(threading.get_ident)) == idents.pop()  # nested: direct, no deadlock
    with pytest.raises(ZeroDivisionError):
        compute.run(lambda: 1 / 0)


def test_set_threads_reaches_the_compute_thread():
    before = compute.get_threads()
    try:
        compute.set_threads(2)
        assert compute.run(torch.get_num_threads) == 2 and torch.get_num_threads() == 2
        compute.set_threads(1)
        assert compute.run(torch.get_num_threads) == 1
    finally:
        compute.set_threads(before)


def test_requests_from_many_threads_run_their_forwards_on_the_compute_thread(tiny):
    seen: set[int] = set()
    hook = tiny.model.get_input_embeddings().register_forward_pre_hook(lambda m, a: seen.add(threading.get_ident()))
    decoder = SpeculativeDecoder(tiny)
    out: dict[int, tuple[int, ...]] = {}

    def call(i: int) -> None:
        out[i] = decoder.generate(GenerationRequest((3, 4, 5 + i), max_new_tokens=6)).token_ids

    try:
        threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        decoder.generate(GenerationRequest((3, 4, 9), max_new_tokens=3))  # and from this thread
    finally:
        hook.remove()
    assert len(out) == 4 and seen == {compute.run(threading.get_ident)}


def _child(queue) -> None:
    queue.put(compute.run(lambda: 41) + 1)


def in_forked_child(target):
    """What ``target(queue)`` puts, run in a forked child (which has none of our threads)."""
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=target, args=(queue,))
    child.start()
    try:
        return queue.get(timeout=30)
    finally:
        child.join(30)
        assert child.exitcode == 0


def test_a_forked_child_gets_a_compute_thread_of_its_own():
    compute.run(lambda: None)  # the parent's thread exists
    assert in_forked_child(_child) == 42


def _child_width(queue) -> None:
    queue.put(compute.get_threads())


def test_a_side_thread_runs_torch_single_threaded_and_the_compute_thread_keeps_its_width():
    """A worker thread's torch at the process's width would start an OpenMP team of its own and
    slow every forward of the compute thread (draftmesh.compute); confined, it starts none. Torch
    then starts new threads at one, but a compute thread started later (a forked child's) keeps
    the width set for it."""
    seen: dict[str, int] = {}

    def side() -> None:
        seen["fresh"] = torch.get_num_threads()  # what a worker thread's torch would use
        compute.confine_side_thread()
        seen["confined"] = torch.get_num_threads()

    with process_width(2):
        thread = threading.Thread(target=side)
        thread.start()
        thread.join(30)
        assert seen == {"fresh": 2, "confined": 1}
        compute.run(compute.confine_side_thread)  # on the compute thread itself: nothing to do
        assert compute.get_threads() == 2
        assert in_forked_child(_child_width) == 2
