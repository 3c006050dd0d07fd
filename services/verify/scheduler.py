"""Continuous batching: every active request of a replica in one target forward per step.

Each step the scheduler (1) drops cancelled requests and admits waiting ones in arrival
order while the KV budget allows, (2) gives prefilling requests chunks of their prompt
(bounded tokens per forward, so a long prompt never stalls the others' decoding), (3) asks
each decoding request's sources (where asking pays at the batch's size: ``AskingValue``) and
builds its candidate tree, (4) picks the batch's nodes
with one budget (``choose_nodes``: expected committed tokens of the whole batch per unit of
step time: the batched forward's measured cost, plus what recent steps spent outside their
forward), (5) runs one forward over every row, (6) lets each
request accept under its own policy and RNG, commit its KV and emit. Requests join and
leave between steps.

No loop of its own: whichever waiting caller finds the step lock free runs the next step for
everyone (``next_event``), so in-process callers and the replica's request threads share one
loop; a cancel waits for at most the running step, then frees the row. The step itself (and a
cancel's row release) runs on the process's compute thread (``draftmesh.compute``): torch's
OpenMP is twice as slow once several threads have run its parallel regions.

KV memory: one slab (``SlotKVCache``) bounded, together with the prefix pool's caches, by
``kv_budget_bytes``. A request reserves a row of ``prompt + max_new_tokens + tree`` tokens; it
waits (bounded queue, first come first served) until that fits, and is refused at once with
``Busy`` when it could never fit or the queue is full.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from draftmesh import compute
from draftmesh.backend import COST_CONTEXT, ForwardInterrupted, KVState
from draftmesh.batch_kv import SlotKVCache
from draftmesh.io_struct import GenerationRequest, GenerationResult, StepEvent
from draftmesh.verify.budget import (AskingValue, BatchCost, CostModel, ScoredTree, StepOverhead, TreeCostCorrection,
                                     choose_nodes, key_price)
from draftmesh.verify.request_run import RequestRun, StepPlan

log = logging.getLogger(__name__)


class Busy(Exception):
    """The replica cannot take the request now (KV budget or queue): RESOURCE_EXHAUSTED."""


@dataclass(frozen=True)
class BatchLimits:
    kv_budget_bytes: int = 2 << 30
    max_batch_tokens: int = 512
    """Tokens per forward (roots, trees and prefill chunks together)."""
    prefill_chunk: int = 128
    """At most this many prompt tokens of one request per step."""
    prefill_while_decoding: int = 32
    """Prompt tokens per step (all prefilling requests together) while other rows decode."""
    max_rows: int = 32
    max_waiting: int = 256


@dataclass
class Ticket:
    """A caller's handle on its request: the events the steps produced for it."""

    run: RequestRun
    events: deque = field(default_factory=deque)
    done: bool = False
    error: BaseException | None = None
    cancelled: bool = False
    enqueued_at: float = field(default_factory=time.perf_counter)
    admitted_at: float | None = None
    interrupted: bool = False
    """Its last prefill chunk's forward was interrupted for a newcomer: the next one runs through."""


@dataclass
class SchedulerStats:
    steps: int = 0
    forward_tokens: int = 0
    forward_rows: int = 0
    drafted_rows: int = 0
    admitted: int = 0
    finished: int = 0
    cancelled: int = 0
    refused: int = 0
    interrupted: int = 0
    """Prefill-only forwards stopped between layers so that a newcomer's first token need not wait."""
    wait_s_total: float = 0.0
    max_rows_seen: int = 0
    step_s_total: float = 0.0
    """Wall time inside steps that ran a forward (drafting, the forward, acceptance, KV upkeep)."""
    forward_s_total: float = 0.0
    """Of which in the forwards themselves."""


class BatchScheduler:
    """The batch of one decoder (``SpeculativeDecoder``: its target, sources, builder, prefix pool)."""

    def __init__(self, decoder: Any, limits: BatchLimits | None = None, observer: Any = None) -> None:
        self.decoder = decoder
        self.limits = limits or BatchLimits()
        self.kv: SlotKVCache = decoder.target.new_batch_cache(self.limits.kv_budget_bytes)
        self.observer = observer
        """Optional: ``observer.batch(rows=, tokens=, queued=, kv_bytes=, speculating=)`` after each step."""
        self._waiting: deque[Ticket] = deque()
        self._active: list[Ticket] = []
        self._lock = threading.Lock()  # the queues
        self._step_lock = threading.Lock()  # one step at a time
        self._progress = threading.Condition(threading.Lock())
        self.stats = SchedulerStats()
        self._cost: BatchCost | None = None
        self._overhead: StepOverhead | None = None
        self._correction: TreeCostCorrection | None = None
        self.asking = AskingValue()
        """Whether asking the sources pays, per batch size, measured on the steps (``_asks_this_step``)."""
        self._turns: dict[int, int] = {}
        """rows -> steps at that batch size: which of them probe."""

    # ------------------------------------------------------------------ callers
    def submit(self, run: RequestRun) -> Ticket:
        need = self._row_tokens(run.req)
        if self.kv.fresh_bytes_for(1, need) > self.limits.kv_budget_bytes:
            self.stats.refused += 1
            raise Busy(f"the request needs {need} tokens of KV ({need * self.kv.bytes_per_token} bytes), over the "
                       f"replica's budget of {self.limits.kv_budget_bytes} bytes (engine.kv_budget_bytes)")
        ticket = Ticket(run)
        with self._lock:
            if len(self._waiting) >= self.limits.max_waiting:
                self.stats.refused += 1
                raise Busy(f"the replica's queue is full ({self.limits.max_waiting} waiting requests)")
            self._waiting.append(ticket)
        return ticket

    def next_event(self, ticket: Ticket) -> StepEvent | GenerationResult:
        """The ticket's next event, running steps (for every request) whenever nobody else is."""
        while True:
            if ticket.events:
                return ticket.events.popleft()
            if ticket.error is not None:
                raise ticket.error
            if ticket.done:
                raise RuntimeError("no more events: the request has finished")
            if self._step_lock.acquire(blocking=False):
                stepped = True
                try:
                    if not ticket.events and ticket.error is None:
                        stepped = self.step()
                finally:
                    self._step_lock.release()
                with self._progress:
                    self._progress.notify_all()
                    if not stepped:  # nothing could run (waiting for room): do not spin
                        self._progress.wait(timeout=0.01)
            else:
                with self._progress:
                    if not ticket.events and ticket.error is None:
                        self._progress.wait(timeout=0.05)

    def cancel(self, ticket: Ticket) -> None:
        """Stop the request: at once if it waits, else within the running step; frees its row."""
        if ticket.done:
            return
        ticket.cancelled = True
        with self._lock:
            waiting = ticket in self._waiting
            if waiting:
                self._waiting.remove(ticket)
                ticket.done = True
                self.stats.cancelled += 1
        if waiting:
            self.decoder.end_request(ticket.run)
            return
        with self._step_lock:
            compute.run(self._drop_cancelled)

    def active_count(self) -> int:
        with self._lock:
            return len(self._active) + len(self._waiting)

    # ------------------------------------------------------------------ the step
    @compute.on_compute_thread
    def step(self) -> bool:
        """One forward for every active request; False when there was nothing to do."""
        t_step = time.perf_counter()
        self._drop_cancelled()
        admitted = self.stats.admitted
        self._admit()
        steady = self.stats.admitted == admitted  # no admission work in this step's time
        runs = [t for t in self._active if t.error is None and not t.done]
        if not runs:
            return False
        decoder = self.decoder
        limits = self.limits
        decoding = [t for t in runs if t.run.to_prefill == 0]
        prefilling = [t for t in runs if t.run.to_prefill > 0]
        base_tokens = len(decoding)
        # Prefill shares the forward with decoding rows. Shortest remaining prompt first: a prompt
        # that fits one chunk is prefilled at once and decodes next step. Once any row decodes this
        # step, a longer prompt advances by at most prefill_while_decoding tokens (it must not
        # stretch every streaming request's step), and the oldest prompt always advances (a few
        # tokens are kept for it), so no long prompt starves behind a stream of short ones.
        left = max(1, limits.max_batch_tokens - base_tokens)
        stepping: list[Ticket] = []
        to_draft: list[Ticket] = []
        for t in decoding:
            t.run.plan = StepPlan(chunk=[], decode=True)
            to_draft.append(t)
        order = sorted(prefilling, key=lambda t: t.run.to_prefill)
        oldest = prefilling[0] if prefilling else None
        reserve = min(8, left - 1) if oldest is not None and order[0] is not oldest else 0
        left -= reserve
        busy = bool(decoding)
        first_token_due = False
        for t in order:
            run = t.run
            if t is oldest:
                left, reserve = left + reserve, 0
            if t.interrupted and first_token_due:
                continue  # it was stopped for a newcomer: it sits out the newcomer's first step, once
            n = self._plan_chunk(run, left, busy)
            if n is None:
                continue
            left -= n
            finishes = run.plan.decode
            busy = busy or finishes
            first_token_due = first_token_due or finishes
            base_tokens += n + (1 if finishes else 0)
            (to_draft if finishes else stepping).append(t)
        candidates: list[ScoredTree | None] = []
        drafted: list[Ticket] = []
        # Every request's sources are asked first, then collected against one deadline: the step
        # waits at most one source deadline whatever its batch, and the calls' hand-offs overlap.
        asked: list[tuple[Ticket, bool]] = []
        asking = self._asks_this_step(len(runs))
        first_asks = False  # a request's first ask builds its sources' state: not what asking costs a step
        for t in to_draft:  # the last prefill chunk, the root and a tree can share one forward
            try:
                drafting = decoder.ask_sources(t.run, len(runs), asking=asking)
                asked.append((t, drafting))
                first_asks = first_asks or (drafting and t.run.asks == 1)
            except Exception as exc:  # one request's fault: it fails, the batch goes on
                self._fail(t, exc)
        deadline_at = decoder.caller.deadline_at()
        for t, drafting in asked:
            run = t.run
            try:
                cand = decoder.candidates(run, self.kv.lengths[run.row] + len(run.plan.chunk), deadline_at) if drafting else None
            except Exception as exc:
                self._fail(t, exc)
                continue
            stepping.append(t)
            if isinstance(cand, ScoredTree):
                candidates.append(cand)
                drafted.append(t)
            else:
                base_tokens += len(run.plan.tree)
        # Requests that arrived while the sources drafted (a client sending its next request as soon
        # as its last one's result came) join this forward with their first chunk instead of waiting
        # a whole step for the next admission: measured at C=8 over the 30 public items, newcomers
        # waited a median 65 ms (a step) to be admitted beside drafting sources, 0.2 ms without.
        for t in self._admit_late(runs):
            steady = False
            n = self._plan_chunk(t.run, left, busy)
            if n is None:
                continue  # no room left in this forward: planned at the next step, like any admitted request
            left -= n
            base_tokens += n + (1 if t.run.plan.decode else 0)
            stepping.append(t)
        kept = 0
        price = {id(t): self._key_prices(t) for t in stepping}  # (its first token, each further one)
        chunk_tokens = sum(len(t.run.plan.chunk) for t in stepping)  # they have no logits: cheaper than the table's
        tree_keys = 0.0
        if candidates:
            keep = choose_nodes(candidates, self._batch_cost(), rows=len(stepping), base_tokens=base_tokens,
                                min_gain=decoder.builder.config.min_gain, max_tokens=limits.max_batch_tokens,
                                overhead=self._step_overhead()(len(stepping)),
                                tree_factor=self._tree_correction().factor(len(stepping)),
                                prefill_tokens=chunk_tokens, chunk_price=self._chunk_price(),
                                decoding_rows=sum(1 for t in stepping if t.run.plan.decode),
                                node_prices=[price[id(t)][1] for t in drafted],
                                base_keys=sum(price[id(t)][0] + price[id(t)][1] * len(t.run.plan.tree)
                                              for t in stepping if t.run.plan.decode))
            for t, cand, k in zip(drafted, candidates, keep):
                t.run.plan.tree = cand.select(k)
                tree_keys += price[id(t)][1] * len(k)
            kept = sum(len(k) for k in keep)
        if not stepping:
            return False
        for t in stepping:
            decoder.prepare_verify(t.run)
        inputs = [t.run.row_input() for t in stepping]
        bases = [self.kv.lengths[t.run.row] for t in stepping]
        tokens = sum(len(i.tokens) for i in inputs)
        # A forward of prefill chunks only (nobody's token is due in it) may stop between two layers
        # when a short request arrives, so that the newcomer's first token does not wait for the whole
        # chunk; a chunk is interrupted at most once, so a long prompt still advances.
        interruptible = all(not t.run.plan.decode and not t.interrupted for t in stepping)
        t0, t0_ns = time.perf_counter(), time.time_ns()
        try:
            logits = decoder.target.forward_batch(self.kv, inputs, interrupt=self._newcomer_ready if interruptible else None)
        except ForwardInterrupted:
            for t, base in zip(stepping, bases):
                self.kv.lengths[t.run.row] = base
                t.run.plan = None
                t.interrupted = True
            self.stats.interrupted += 1
            return True
        except Exception as exc:  # the forward itself failed: every request in it fails, the replica goes on
            log.exception("batched forward over %d rows (%d tokens) failed", len(inputs), tokens)
            for t, base in zip(stepping, bases):
                self.kv.lengths[t.run.row] = base
                self._fail(t, exc)
            return True
        verify_s = time.perf_counter() - t0
        speculating = sum(1 for t in stepping if t.run.plan is not None and len(t.run.plan.tree))
        emitted = 0
        for t, base, lg in zip(stepping, bases, logits):
            t.interrupted = False
            run = t.run
            plan = run.plan
            try:
                event = run.complete(self.kv, base, lg, verify_s)
                if plan.chunk and run.to_prefill == 0:
                    decoder.trace_prefill(run, done=True)
                if event is not None:
                    decoder.observe_step(run, plan, len(stepping), t0_ns)
                    t.events.append(event)
                    emitted += event.record.emitted
                if run.finish is not None:
                    self._finish(t)
            except Exception as exc:
                plan.span.end()
                self._fail(t, exc)
        st = self.stats
        st.steps += 1
        st.forward_tokens += tokens
        st.forward_rows += len(inputs)
        st.drafted_rows += speculating
        st.max_rows_seen = max(st.max_rows_seen, len(inputs))
        st.forward_s_total += verify_s
        step_s = time.perf_counter() - t_step
        st.step_s_total += step_s
        self._step_overhead().record(step_s, verify_s, len(inputs), steady=steady)
        if steady and chunk_tokens == 0 and asking is not None and not first_asks:
            self.asking.record(len(runs), asking, emitted, step_s)
        if chunk_tokens == 0:  # see TreeCostCorrection: a prompt chunk's error swamps a tree's part
            self._tree_correction().record(self._batch_cost(), len(inputs), tokens - kept, tokens, verify_s,
                                           base_keys=sum(price[id(t)][0] + price[id(t)][1] * (len(i.tokens) - 1)
                                                         for t, i in zip(stepping, inputs)) - tree_keys,
                                           tree_keys=tree_keys)
        if self.observer is not None:
            self.observer.batch(rows=len(inputs), tokens=tokens, queued=len(self._waiting),
                                kv_bytes=self.kv.allocated_bytes, speculating=speculating)
        return True

    # ------------------------------------------------------------------ admission and exits
    def _row_tokens(self, req: GenerationRequest) -> int:
        """KV slots a request can need: prompt, output and one step's tree beyond it."""
        return len(req.prompt_ids) + req.max_new_tokens + self.decoder.builder.max_nodes + 2

    def _newcomer_ready(self) -> bool:
        """Whether the queue's head could join now and take its first token at the next step (its
        prompt fits one chunk): what a prefill-only forward is interrupted for. Asked between layers."""
        limits = self.limits
        with self._lock:
            if not self._waiting or len(self._active) >= limits.max_rows:
                return False
            req = self._waiting[0].run.req
        if len(req.prompt_ids) - 1 > limits.prefill_chunk:
            return False
        return self._grown_slab(req)[1] <= limits.kv_budget_bytes

    def _grown_slab(self, req: GenerationRequest) -> tuple[int, int]:
        """Tokens per row, and the slab's bytes, once ``req`` has a row too."""
        need = max(self.kv.token_capacity, self._row_tokens(req))
        return need, self.kv.bytes_for(self.kv.rows + 1, need)

    def _pool_bytes(self) -> int:
        pool = self.decoder.kv_pool
        return pool.stats()["cached_tokens"] * self.kv.bytes_per_token if pool is not None else 0

    def _admit(self) -> None:
        kv, limits, pool = self.kv, self.limits, self.decoder.kv_pool
        while True:
            with self._lock:
                if not self._waiting or len(self._active) >= limits.max_rows:
                    return
                ticket = self._waiting[0]
                if kv.rows == 0 and kv.bytes_for(1, self._row_tokens(ticket.run.req)) > limits.kv_budget_bytes:
                    kv.release()  # an idle slab shaped for earlier requests: start again at this one's size
                need, slab = self._grown_slab(ticket.run.req)
                if slab + self._pool_bytes() > limits.kv_budget_bytes and pool is not None:
                    pool.shrink_to(max(0, (limits.kv_budget_bytes - slab) // kv.bytes_per_token))
                if slab + self._pool_bytes() > limits.kv_budget_bytes:
                    return  # it waits for a row to end
                self._waiting.popleft()
                self._active.append(ticket)
            run = ticket.run
            try:
                kv.ensure(kv.rows + 1, need)
                row = kv.add_row()
                cached: list[int] = []
                if pool is not None:  # the tenant's longest shared prefix, copied: the pooled entry stays
                    state, cached = pool.lookup(run.req.tenant, run.prompt[:-1])
                    if cached:
                        kv.load_row(row, state.cache, len(cached))
                run.attach(row, cached)
            except Exception as exc:
                self._fail(ticket, exc)
                continue
            self.decoder.trace_prefill(run, done=run.to_prefill == 0)
            ticket.admitted_at = time.perf_counter()
            self.stats.admitted += 1
            self.stats.wait_s_total += ticket.admitted_at - ticket.enqueued_at

    def _plan_chunk(self, run: RequestRun, room: int, busy: bool) -> int | None:
        """Plan the next chunk of ``run``'s prompt into this step, within ``room`` tokens (at most
        ``prefill_while_decoding`` of a longer prompt while rows decode, ``busy``): the chunk's
        tokens (its root follows when the prompt ends: ``plan.decode``), None when none fit."""
        limits = self.limits
        cap = limits.prefill_while_decoding if busy and run.to_prefill > limits.prefill_chunk else limits.prefill_chunk
        n = min(run.to_prefill, room, cap)
        if run.to_prefill and n <= 0:
            return None
        start = len(run.cached)
        run.plan = StepPlan(chunk=run.prompt[start : start + n], decode=n == run.to_prefill)
        return n

    def _admit_late(self, planned: list[Ticket]) -> list[Ticket]:
        """Admit who is waiting now, within the step (``_admit``'s rules); the tickets admitted."""
        with self._lock:
            if not self._waiting:
                return []
        seen = {id(t) for t in planned}
        self._admit()
        return [t for t in self._active if id(t) not in seen and t.error is None and not t.done]

    def _drop_cancelled(self) -> None:
        for t in [t for t in self._active if t.cancelled]:
            self._release(t)
            t.done = True
            self.stats.cancelled += 1
            self.decoder.end_request(t.run)

    def _finish(self, ticket: Ticket) -> None:
        run = ticket.run
        pool = self.decoder.kv_pool
        if pool is not None and run.row is not None and pool.keeps(run.req.session_id):
            pool.checkin(run.req.tenant, run.cached, KVState(self.kv.export_row(run.row), self.kv.lengths[run.row]),
                         session_id=run.req.session_id)
            # pooled entries and the slab share one budget
            pool.shrink_to(max(0, (self.limits.kv_budget_bytes - self.kv.allocated_bytes) // self.kv.bytes_per_token))
        self._release(ticket)
        self.decoder.end_request(run)
        ticket.events.append(run.final_result())
        ticket.done = True
        self.stats.finished += 1

    def _fail(self, ticket: Ticket, exc: BaseException) -> None:
        self._release(ticket)
        ticket.error = exc
        ticket.done = True
        self.decoder.end_request(ticket.run)

    def _release(self, ticket: Ticket) -> None:
        with self._lock:
            if ticket in self._active:
                self._active.remove(ticket)
        row = ticket.run.row
        if row is None:
            return
        ticket.run.row = None
        moved = self.kv.drop_row(row)
        if moved is not None:
            for t in self._active:
                if t.run.row == moved:
                    t.run.row = row
                    break

    def _key_prices(self, ticket: Ticket) -> tuple[float, float]:
        """What the ticket's row's first token and each further one cost this step beyond the
        budget's table, for the keys its cache holds past the table's (``TorchTarget.key_cost``)."""
        plan = ticket.run.plan
        cached = self.kv.lengths[ticket.run.row] + (len(plan.chunk) if plan is not None else 0)
        slopes = getattr(self.decoder.target, "key_cost", None)
        if slopes is None:
            return 0.0, 0.0
        return key_price(slopes.row, cached, COST_CONTEXT), key_price(slopes.token, cached, COST_CONTEXT)

    def _asks_this_step(self, rows: int) -> bool | None:
        """Whether this step's requests may ask their sources (as their rests allow): always in a batch
        smaller than ``rest_min_rows`` or with ``asking_probe_every`` 0 (then None: nothing to
        measure); else as ``AskingValue`` says asking pays at ``rows`` (every other step until it
        knows), with one step in twice ``asking_probe_every`` asking nobody where it pays and one in
        ``asking_probe_every`` asking where it does not, so that both stay measured."""
        decoder = self.decoder
        every = decoder.asking_probe_every
        if not every or not decoder.sources or not decoder.rests_at(rows):
            return None
        turn = self._turns[rows] = self._turns.get(rows, 0) + 1
        pays = self.asking.pays(rows)
        if pays is None:  # nothing measured yet: both kinds of step in turn
            return turn % 2 == 1
        if pays:
            return turn % (2 * every) != 0
        return turn % every == 0

    def _chunk_price(self) -> float:
        """A prefill chunk's token against one of the budget's table (which has logits for every
        token): the chunk's never reach the output head (``TorchTarget.head_share``)."""
        return 1.0 - getattr(self.decoder.target, "head_share", 0.0)

    def _step_overhead(self) -> StepOverhead:
        """The steps' time outside the forward, in the budget's unit (a batch-1 one-token forward,
        known once the target's cost was measured), which the budget adds to every forward it weighs."""
        if self._overhead is None or self._overhead.unit_s is None:
            self._overhead = StepOverhead(self._cost_unit())
        return self._overhead

    def tree_cost_factors(self) -> dict[int, float]:
        """Per batch size measured with trees: what their tree tokens cost against the warm-up table."""
        c = self._correction
        return {rows: c.factor(rows) for rows in sorted(c.trees)} if c is not None else {}

    def _tree_correction(self) -> TreeCostCorrection:
        """What the budget learns of its trees' real cost against the warm-up table, from the timed forwards."""
        if self._correction is None or self._correction.unit_s is None:
            self._correction = TreeCostCorrection(self._cost_unit())
        return self._correction

    def _cost_unit(self) -> float | None:
        """The budget's unit in seconds: the target's batch-1 one-token forward, None until measured."""
        target = self.decoder.target
        return getattr(target, "batch_step_seconds", None) or getattr(target, "step_seconds", None)

    def _batch_cost(self) -> BatchCost:
        if self._cost is None:
            single = getattr(self.decoder.builder, "cost", None) or CostModel(self.decoder.target.cost_curve or {1: 1.0})
            self._cost = BatchCost(single, self.decoder.target.batch_cost)
        return self._cost
