"""SourceCaller's busy state: per (request, source), and a cap per source across requests."""

from __future__ import annotations

import threading
import time

from draftmesh.draft.base import DraftContext, Proposal
from draftmesh.verify.source_caller import SourceCaller
from thread_width import ComputeBoundSource, ThreadWidthSource, compute_thread, process_width


class GatedSource:
    """Answers at once, except for contexts of the request ids in ``slow``: those block until ``gate`` opens."""

    def __init__(self, name: str, slow: set[str]) -> None:
        self.name, self.slow, self.gate = name, slow, threading.Event()

    def propose(self, ctx: DraftContext) -> list[Proposal]:
        if ctx.request_id in self.slow:
            self.gate.wait(10)
        return [Proposal(self.name, token_ids=(7, 8))]


def ctx(rid: str) -> DraftContext:
    return DraftContext(token_ids=(1, 2, 3), prompt_len=3, request_id=rid)


def test_a_slow_call_for_one_request_is_not_busy_for_another():
    src = GatedSource("rag", slow={"a"})
    caller = SourceCaller(deadline_s=0.05)
    try:
        assert caller.call([src], ctx("a")).failed == {"rag": "timeout"}
        assert caller.call([src], ctx("a")).failed == {"rag": "busy"}  # still running for a
        got = caller.call([src], ctx("b"))  # the old code answered "busy" here: keyed by source name only
        assert got.failed == {} and [p.token_ids for p in got.proposals["rag"]] == [(7, 8)]
    finally:
        src.gate.set()
        caller.close()


def test_one_source_holds_at_most_max_per_source_calls():
    src = GatedSource("remote", slow={f"r{i}" for i in range(10)})
    other = GatedSource("history", slow=set())
    caller = SourceCaller(deadline_s=0.02, max_workers=4, max_per_source=2)
    try:
        outcomes = [caller.call([src, other], ctx(f"r{i}")) for i in range(5)]
        assert [o.failed.get("remote") for o in outcomes] == ["timeout", "timeout", "busy", "busy", "busy"]
        # the other source keeps its workers: answered for every request
        assert all(o.proposals.get("history") for o in outcomes)
    finally:
        src.gate.set()
        caller.close()


def test_finished_requests_are_forgotten():
    src = GatedSource("s", slow={"a"})
    caller = SourceCaller(deadline_s=0.02)
    try:
        caller.call([src], ctx("a"))
        caller.call([src], ctx("b"))  # answered in time: nothing kept
        assert caller.running() == 1
        src.gate.set()
        time.sleep(0.1)
        caller.forget("a")  # its late answer can serve nobody now
        assert caller.running() == 0
    finally:
        src.gate.set()
        caller.close()


def test_a_forgotten_call_still_running_counts_against_the_cap():
    src = GatedSource("remote", slow={"a", "b", "c"})
    caller = SourceCaller(deadline_s=0.02, max_per_source=2)
    try:
        caller.call([src], ctx("a"))
        caller.call([src], ctx("b"))
        caller.forget("a")
        caller.forget("b")  # the requests ended, their calls still hang
        assert caller.call([src], ctx("c")).failed == {"remote": "busy"}
        src.gate.set()
        time.sleep(0.1)
        assert caller.call([src], ctx("c")).failed == {}  # returned: pruned, the cap is free again
        assert caller.running() == 0
    finally:
        src.gate.set()
        caller.close()


def test_sources_on_the_pool_run_torch_single_threaded():
    """At the process's width each pool thread would start an OpenMP team of its own, which slowed
    the compute thread's forwards by half (draftmesh.compute)."""
    src = ThreadWidthSource()
    caller = SourceCaller(deadline_s=5.0, max_workers=2)
    try:
        with process_width(2):
            for rid in ("a", "b", "c"):
                assert caller.call([src], ctx(rid)).failed == {}
        assert src.widths == [1, 1, 1]
    finally:
        caller.close()


def test_a_compute_bound_source_runs_on_the_compute_thread_while_the_others_use_the_pool():
    """A draft model on a pool thread would compute beside the target's forward on the same cores
    (a one-token forward 24 -> 53 ms, draft.base); on the compute thread they take turns."""
    from draftmesh import compute

    model, rag = ComputeBoundSource(), GatedSource("rag", slow=set())
    caller = SourceCaller(deadline_s=5.0)
    try:
        in_step = compute.run(caller.call, [model, rag], ctx("a"))  # as a step asks them
        elsewhere = caller.call([model], ctx("b"))  # from another thread it still runs there
        assert model.threads == [compute_thread()] * 2
        assert in_step.failed == {} and sorted(in_step.proposals) == ["llm", "rag"]
        assert [p.token_ids for p in elsewhere.proposals["llm"]] == [(9,)]
    finally:
        caller.close()


def test_an_inline_source_is_called_on_the_collecting_thread_and_the_others_on_the_pool():
    """A lookup cheaper than the pool's hand-off (``inline = True``, the recycle source) skips it."""

    class Where:
        def __init__(self, name: str, inline: bool) -> None:
            self.name, self.inline, self.threads = name, inline, []

        def propose(self, ctx: DraftContext) -> list[Proposal]:
            self.threads.append(threading.current_thread())
            return [Proposal(self.name, token_ids=(5,))]

    lookup, pooled = Where("lookup", inline=True), Where("pooled", inline=False)
    caller = SourceCaller(deadline_s=5.0)
    try:
        answers = caller.call([lookup, pooled], ctx("a"))
        assert sorted(answers.proposals) == ["lookup", "pooled"] and answers.failed == {}
        assert lookup.threads == [threading.current_thread()]
        assert pooled.threads and pooled.threads[0] is not threading.current_thread()
    finally:
        caller.close()
