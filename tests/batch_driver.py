"""Drive a decoder's batch step by step, and the plain batch-1 greedy output to compare it with:
shared by the tests of continuous batching and of what a batch's requests do at each step."""

from __future__ import annotations

from draftmesh.backend import KVState
from draftmesh.io_struct import GenerationResult


def reference_greedy(target, prompt, max_new: int) -> tuple[int, ...]:
    """Plain batch-1 greedy decoding on the target's own DynamicCache path (not the batch's)."""
    state = KVState()
    target.prefill(state, list(prompt[:-1]))
    pending, out = prompt[-1], []
    for _ in range(max_new):
        pending = int(target.step(state, pending)[0].argmax())
        out.append(pending)
        if pending in target.eos_token_ids:
            break
    return tuple(out)


def drive(decoder, schedule):
    """Run the scheduler step by step: ``schedule`` is (join_step, request, cancel_step or None).
    Returns each request's GenerationResult (None if cancelled) and the rows of every step."""
    sched = decoder.scheduler
    tickets, results, rows_per_step = {}, {}, []
    step = 0
    while True:
        for i, (join, req, cancel) in enumerate(schedule):
            if join == step:
                tickets[i] = decoder.submit(req)
            if cancel is not None and cancel == step and i in tickets:
                sched.cancel(tickets[i])
        if len(tickets) == len(schedule) and all(t.done for t in tickets.values()):
            break
        sched.step()
        rows_per_step.append(sched.kv.rows)
        step += 1
        assert step < 2000, "the batch did not finish"
    for i, t in tickets.items():
        assert t.error is None, t.error
        events = list(t.events)
        results[i] = events[-1] if events and isinstance(events[-1], GenerationResult) else None
    return results, rows_per_step
