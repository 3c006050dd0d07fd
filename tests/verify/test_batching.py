"""Continuous batching: every request's output equals its own plain batch-1 decoding, whatever
else is in the batch (float64 random-weight Llama and Gemma 3), rows never see each other, the
KV budget holds, prefill is chunked, cancels free their row within one step, and the batch's
budget shrinks trees as the batch grows."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
from scipy.stats import chisquare
from batch_driver import drive, reference_greedy
from tiny_models import tiny_target

from draftmesh.backend import KVState
from draftmesh.batch_kv import RowInput
from draftmesh.draft.base import DraftContext, Proposal
from draftmesh.io_struct import GenerationRequest, SamplingParams, SpeculationParams
from draftmesh.sampling import target_probs
from draftmesh.tree import DraftSequence, TokenTree
from draftmesh.verify.decoder import SpeculativeDecoder
from draftmesh.verify.scheduler import BatchLimits, Busy
from draftmesh.verify.budget import BatchCost, CostModel, ScoredTree, choose_nodes
from draftmesh.verify.tree_builder import CostAwareTreeBuilder, TrieBuilder


class PerRequestScript:
    """Drafts each request's own known continuation, corrupted at random (test double)."""

    name = "scripted"

    def __init__(self, vocab: int, seed: int) -> None:
        self.truth: dict[str, tuple[int, ...]] = {}
        self.vocab = vocab
        self.rng = random.Random(seed)
        self.lock = threading.Lock()

    def propose(self, ctx: DraftContext) -> list[Proposal]:
        with self.lock:
            rng = self.rng
            truth = list(self.truth.get(ctx.request_id, ()))[len(ctx.generated_ids) :]
            chains = []
            for _ in range(rng.randint(0, 3)):
                n = rng.randint(1, 10)
                err = rng.choice([None, 0, 1, 3, 6])
                chain = [truth[i] if i < len(truth) and (err is None or i < err) else rng.randrange(self.vocab)
                         for i in range(n)]
                chains.append(Proposal(self.name, token_ids=tuple(chain), confidence=rng.random()))
            return chains


def random_prompt(rng, vocab, lo=1, hi=40):
    return tuple(rng.randrange(1, vocab) for _ in range(rng.randint(lo, hi)))


@pytest.mark.parametrize("builder", ["cost", "trie"])
def test_every_request_in_a_batch_decodes_as_it_would_alone(tiny, builder):
    """Requests of different lengths join and leave mid-stream, some cancelled, drafts right and
    wrong: each completed greedy output equals its own plain batch-1 output (float64)."""
    rng = random.Random(3)
    script = PerRequestScript(tiny.vocab_size, seed=1)
    b = (CostAwareTreeBuilder({1: 1.0, 64: 1.0}) if builder == "cost" else TrieBuilder(max_nodes=16))
    decoder = SpeculativeDecoder(tiny, [script], b, batch_limits=BatchLimits(prefill_chunk=8, max_batch_tokens=64))
    schedule, want = [], {}
    for i in range(10):
        prompt = random_prompt(rng, tiny.vocab_size)
        n = rng.randint(1, 24)
        req = GenerationRequest(prompt, max_new_tokens=n, request_id=f"r{i}")
        want[i] = reference_greedy(tiny, prompt, n)
        script.truth[f"r{i}"] = want[i]
        cancel = rng.choice([None] * 4 + [rng.randint(1, 6)])
        schedule.append((rng.randint(0, 12), req, cancel))
    results, rows = drive(decoder, schedule)
    assert max(rows) >= 4  # they really were decoded together
    finished = 0
    for i, result in results.items():
        if result is None:
            assert schedule[i][2] is not None  # only cancelled requests have no result
            continue
        finished += 1
        assert result.token_ids == want[i], f"request {i}"
    assert finished >= 5
    assert decoder.scheduler.kv.rows == 0  # every row freed


def test_mixed_greedy_and_sampled_requests_keep_greedy_exact_and_stop_strings(tiny):
    rng = random.Random(5)
    plain = SpeculativeDecoder(tiny)
    script = PerRequestScript(tiny.vocab_size, seed=2)
    decoder = SpeculativeDecoder(tiny, [script], TrieBuilder(max_nodes=12))
    schedule, want = [], {}
    for i in range(8):
        prompt = random_prompt(rng, tiny.vocab_size, 3, 30)
        greedy = i % 2 == 0
        free = plain.generate(GenerationRequest(prompt, max_new_tokens=16))
        words = free.text.split()
        stop = (words[len(words) // 2],) if greedy and i % 4 == 0 and len(words) > 3 else ()
        req = GenerationRequest(prompt, max_new_tokens=16, stop=stop, request_id=f"m{i}",
                                sampling=SamplingParams() if greedy else SamplingParams(0.9, seed=i))
        script.truth[f"m{i}"] = free.token_ids
        if greedy:
            want[i] = plain.generate(GenerationRequest(prompt, max_new_tokens=16, stop=stop))
        schedule.append((i, req, None))
    results, _ = drive(decoder, schedule)
    for i, w in want.items():
        assert results[i].token_ids == w.token_ids and results[i].text == w.text and results[i].finish_reason == w.finish_reason


def test_eos_inside_a_tree_ends_the_request_there(tiny, monkeypatch):
    """A draft running through EOS: the output stops at EOS, exactly as plain decoding."""
    rng = random.Random(11)
    prompt = random_prompt(rng, tiny.vocab_size, 2, 20)
    free = reference_greedy(tiny, prompt, 30)
    monkeypatch.setattr(tiny, "eos_token_ids", frozenset({free[5]}))  # a token the model does emit
    want = reference_greedy(tiny, prompt, 30)
    assert want[-1] == free[5] and len(want) <= 6

    class ThroughEos:
        name = "through"

        def propose(self, ctx):
            rest = list(want[len(ctx.generated_ids) :]) + [5, 6, 7]
            return [Proposal("through", token_ids=tuple(rest[:12]))]

    decoder = SpeculativeDecoder(tiny, [ThroughEos()], TrieBuilder(max_nodes=16))
    other = GenerationRequest(random_prompt(rng, tiny.vocab_size), max_new_tokens=20, request_id="other")
    results, _ = drive(decoder, [(0, GenerationRequest(prompt, max_new_tokens=30, request_id="eos"), None), (0, other, None)])
    assert results[0].token_ids == want and results[0].finish_reason == "eos"
    assert results[1].token_ids == reference_greedy(tiny, other.prompt_ids, 20)


def test_rows_never_see_each_other(tiny):
    """A row's logits are the same alone and beside other rows of any length and tree (float64)."""
    rng = random.Random(0)
    prompt = list(random_prompt(rng, tiny.vocab_size, 20, 20))
    tree = TokenTree.from_sequences([DraftSequence((4, 5, 6), "a"), DraftSequence((4, 9), "b"), DraftSequence((7,), "c")])

    def row_input(row):
        return RowInput(row, [prompt[-1], *tree.tokens], [-1] + [p + 1 if p >= 0 else 0 for p in tree.parents])

    alone = tiny.new_batch_cache(1 << 28)
    alone.ensure(1, 64)
    alone.add_row()
    tiny.forward_batch(alone, [RowInput.chain(0, prompt[:-1])])
    want = tiny.forward_batch(alone, [row_input(0)])[0]
    crowd = tiny.new_batch_cache(1 << 28)
    crowd.ensure(4, 128)
    for _ in range(4):
        crowd.add_row()
    others = [random_prompt(rng, tiny.vocab_size, 1, 60) for _ in range(3)]
    tiny.forward_batch(crowd, [RowInput.chain(0, others[0]), RowInput.chain(1, prompt[:-1]),
                               RowInput.chain(3, others[2])])
    tiny.forward_batch(crowd, [RowInput.chain(2, others[1])])
    got = tiny.forward_batch(crowd, [RowInput(0, [3, 4, 5], [-1, 0, 0]), row_input(1),
                                     RowInput.chain(2, [8] * 50, logits_from=50), RowInput(3, [9], [-1])])
    assert torch.allclose(got[1], want, atol=1e-9, rtol=0)
    # and the sequential truth: the tree's logits equal decoding each path one token at a time
    for i in range(len(tree)):
        path = [tree.tokens[j] for j in tree.path_to(i)]
        state = KVState()
        tiny.prefill(state, prompt + path[:-1])
        assert torch.allclose(got[1][1 + i], tiny.step(state, path[-1])[0], atol=1e-9, rtol=0)


def test_a_long_prompt_is_prefilled_in_chunks_while_others_stream(tiny):
    rng = random.Random(8)
    long_prompt = random_prompt(rng, tiny.vocab_size, 200, 200)
    short = random_prompt(rng, tiny.vocab_size, 5, 5)
    decoder = SpeculativeDecoder(tiny, batch_limits=BatchLimits(prefill_chunk=16, max_batch_tokens=32))
    sched = decoder.scheduler
    long_t = decoder.submit(GenerationRequest(long_prompt, max_new_tokens=4, request_id="long"))
    sched.step()
    short_t = decoder.submit(GenerationRequest(short, max_new_tokens=8, request_id="short"))
    steps = 0
    while not short_t.events:
        sched.step()
        steps += 1
    assert steps <= 2  # its first token came while the long prompt was still prefilling
    assert long_t.run.to_prefill > 0 and not long_t.events
    while not (long_t.done and short_t.done):
        before = long_t.run.to_prefill
        sched.step()
        if before:  # the oldest prompt advances every step, however many shorter ones come
            assert long_t.run.to_prefill < before or long_t.events
    assert long_t.events[-1].token_ids == reference_greedy(tiny, long_prompt, 4)
    assert short_t.events[-1].token_ids == reference_greedy(tiny, short, 8)


def test_a_newcomer_interrupts_a_prefill_only_forward_between_layers(tiny):
    """A short request arriving while a prefill chunk computes takes its first token in the very
    next forward, alone: the chunk stops between two layers (once: the prompt's next chunk runs
    through whatever arrives) and the prompt sits out that step. Outputs stay each request's own
    batch-1 greedy."""
    rng = random.Random(9)
    long_prompt = random_prompt(rng, tiny.vocab_size, 120, 120)
    shorts = [random_prompt(rng, tiny.vocab_size, 5, 5) for _ in range(2)]
    decoder = SpeculativeDecoder(tiny, batch_limits=BatchLimits(prefill_chunk=32))
    sched = decoder.scheduler
    long_t = decoder.submit(GenerationRequest(long_prompt, max_new_tokens=4, request_id="long"))
    sched.step()  # the first chunk
    due: list[GenerationRequest] = []
    arrivals: list = []

    check = tiny._check_interrupt  # asked before every layer of a forward that may be interrupted

    def arrive(index):  # a request comes in just before layer 1 of the running forward
        if index == 1 and due:
            arrivals.append(decoder.submit(due.pop()))
        check(index)

    tiny._check_interrupt = arrive
    try:
        before = long_t.run.to_prefill
        due.append(GenerationRequest(shorts[0], max_new_tokens=1, request_id="short0"))
        sched.step()
        assert arrivals and sched.stats.interrupted == 1
        assert long_t.run.to_prefill == before and sched.kv.lengths[long_t.run.row] == len(long_t.run.cached)
        tokens = sched.stats.forward_tokens
        sched.step()  # the newcomer's first step: its prompt and root only
        assert arrivals[0].events and sched.stats.forward_tokens - tokens == len(shorts[0])
        assert long_t.run.to_prefill == before and arrivals[0].done
        due.append(GenerationRequest(shorts[1], max_new_tokens=3, request_id="short1"))
        sched.step()  # the prompt's next chunk runs through, though another newcomer came meanwhile
        assert len(arrivals) == 2 and long_t.run.to_prefill == before - 32 and sched.stats.interrupted == 1
        while not (long_t.done and all(t.done for t in arrivals)):
            sched.step()
    finally:
        del tiny._check_interrupt
    assert long_t.events[-1].token_ids == reference_greedy(tiny, long_prompt, 4)
    for short, t in zip(shorts, arrivals):
        assert t.events[-1].token_ids == reference_greedy(tiny, short, len(t.events[-1].token_ids))
    assert len(arrivals[1].events[-1].token_ids) == 3


def test_the_kv_budget_queues_then_refuses(tiny):
    probe = tiny.new_batch_cache(1 << 30)
    small_need = 4 + 20 + CostAwareTreeBuilder({1: 1.0}).max_nodes + 2  # prompt, output, a step's tree
    budget = probe.bytes_for(2, small_need)  # two such rows, no more
    decoder = SpeculativeDecoder(tiny, batch_limits=BatchLimits(kv_budget_bytes=budget, max_waiting=2))
    sched = decoder.scheduler
    with pytest.raises(Busy, match="kv_budget_bytes"):
        decoder.submit(GenerationRequest(tuple(range(1, 6)), max_new_tokens=250))
    reqs = [GenerationRequest((3, 4, 5, 6 + i), max_new_tokens=20, request_id=f"q{i}") for i in range(4)]
    tickets = [decoder.submit(r) for r in reqs[:2]]
    sched.step()
    tickets += [decoder.submit(r) for r in reqs[2:]]  # these two wait for a free row
    with pytest.raises(Busy, match="queue is full"):
        decoder.submit(GenerationRequest((3, 4), max_new_tokens=5))
    sched.step()
    assert sched.kv.rows == 2 and len(sched._waiting) == 2
    while not all(t.done for t in tickets):
        sched.step()
        assert sched.kv.allocated_bytes <= budget and sched.kv.rows <= 2
    for r, t in zip(reqs, tickets):
        assert t.events[-1].token_ids == reference_greedy(tiny, r.prompt_ids, 20)


def test_a_cancel_frees_its_row_within_the_step(tiny):
    decoder = SpeculativeDecoder(tiny)
    sched = decoder.scheduler
    tickets = [decoder.submit(GenerationRequest((3, 4, 5 + i), max_new_tokens=100)) for i in range(3)]
    sched.step()
    sched.step()
    assert sched.kv.rows == 3
    sched.cancel(tickets[1])
    assert sched.kv.rows == 2 and tickets[1].done
    while not (tickets[0].done and tickets[2].done):
        sched.step()
    assert tickets[2].events[-1].token_ids == reference_greedy(tiny, (3, 4, 7), 100)


def test_concurrent_callers_share_the_forwards(tiny):
    """Callers on their own threads (the replica's way): one batch, each output its own."""
    decoder = SpeculativeDecoder(tiny)
    rng = random.Random(2)
    prompts = [random_prompt(rng, tiny.vocab_size, 2, 30) for _ in range(6)]
    out: dict[int, tuple[int, ...]] = {}

    def call(i):
        out[i] = decoder.generate(GenerationRequest(prompts[i], max_new_tokens=30)).token_ids

    threads = [threading.Thread(target=call, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(out[i] == reference_greedy(tiny, prompts[i], 30) for i in range(6))
    stats = decoder.batch_stats()
    assert stats["max_rows"] >= 2 and stats["steps"] < 6 * 30  # forwards were shared
    assert stats["active_rows"] == 0


VOCAB = 16
PROMPT = (3, 7, 2, 9)


def test_sampling_keeps_the_target_law_with_other_requests_in_the_batch():
    """The first token of sampled requests, decoded 4 at a time beside greedy ones with drafts."""
    model = tiny_target("llama", vocab_size=VOCAB, seed=5)
    state = KVState()
    model.prefill(state, list(PROMPT[:-1]))
    params = SamplingParams(temperature=1.0, top_k=8)
    law = target_probs(model.step(state, PROMPT[-1])[0], params)

    class Guess:
        name = "guess"

        def __init__(self):
            self.rng = random.Random(0)

        def propose(self, ctx):
            return [Proposal("guess", token_ids=tuple(self.rng.randrange(VOCAB) for _ in range(2))) for _ in range(3)]

    decoder = SpeculativeDecoder(model, [Guess()], TrieBuilder(max_nodes=8))
    counts = torch.zeros(VOCAB, dtype=torch.float64)
    seed = 0
    for round_ in range(300):
        schedule = []
        for j in range(4):
            seed += 1
            schedule.append((j % 2, GenerationRequest(PROMPT, max_new_tokens=2, request_id=f"s{seed}",
                                                      sampling=SamplingParams(1.0, top_k=8, seed=seed)), None))
        schedule.append((0, GenerationRequest((5, 6, 7, 8, 9)[: 1 + round_ % 5], max_new_tokens=3,
                                              request_id=f"g{round_}"), None))
        results, _ = drive(decoder, schedule)
        for j in range(4):
            counts[results[j].token_ids[0]] += 1
    expected = law * counts.sum()
    support = expected > 0
    assert counts[~support].sum() == 0
    assert chisquare(counts[support].numpy(), expected[support].numpy()).pvalue > 1e-3


def test_the_batch_budget_shrinks_trees_as_the_batch_grows():
    """One cost table: more rows make each node pay for a bigger forward, so fewer nodes are
    kept per request; a steep enough cost keeps none; at batch 1 it is the builder's choice."""
    def linear(t):  # weights read once per forward, then a cost per token
        return 0.9 + 0.1 * t

    single = CostModel({t: linear(t) / linear(1) for t in (1, 2, 4, 8, 16, 32, 64)})
    batched = {r: {r * k: linear(r * k) / linear(1) for k in (1, 2, 4, 8)} for r in (2, 4, 8)}
    cost = BatchCost(single, batched)
    chain = TokenTree.from_sequences([DraftSequence(tuple(range(1, 13)), "s")])

    def cand():
        return ScoredTree(chain, [0.9 ** (i + 1) for i in range(12)], [{} for _ in range(12)], 64)

    kept = []
    for rows in (1, 2, 4, 8):
        keep = choose_nodes([cand() for _ in range(rows)], cost, rows=rows, base_tokens=rows, min_gain=1.02)
        kept.append(sum(len(k) for k in keep) / rows)
    assert kept[0] > 0 and all(a >= b for a, b in zip(kept, kept[1:])) and kept[-1] < kept[0]
    steep = BatchCost(CostModel({1: 1.0, 2: 3.0, 64: 200.0}))
    assert choose_nodes([cand()], steep, rows=1, base_tokens=1, min_gain=1.02) == [[]]
    # batch 1: the same nodes the single-request builder picks
    builder = CostAwareTreeBuilder({1: 1.0, 2: 1.1, 4: 1.2, 8: 1.4, 16: 2.0})
    props = [Proposal("s", token_ids=tuple(range(10, 30)), confidence=0.8)]
    ctx = DraftContext(token_ids=(1, 2, 3), prompt_len=3, request_id="x")
    tree = builder.build(props, ctx)
    sc = builder.candidates(props, ctx)
    keep = choose_nodes([sc], BatchCost(builder.cost), rows=1, base_tokens=1, min_gain=builder.config.min_gain)[0]
    assert sc.select(keep).tokens == tree.tokens and 0 < len(tree) < 20


def _three_scripted_requests(tiny, builder, seed: int):
    """Three requests at once, drafted by a script that knows each one's greedy output: the decoder,
    its results and the outputs wanted (plain batch-1 greedy)."""
    rng = random.Random(seed)
    script = PerRequestScript(tiny.vocab_size, seed=seed)
    # every step asks (no measured switch, ``AskingValue``): what the budget is given at each one
    decoder = SpeculativeDecoder(tiny, [script], builder, asking_probe_every=0)
    schedule, want = [], {}
    for i in range(3):
        prompt = random_prompt(rng, tiny.vocab_size)
        want[i] = reference_greedy(tiny, prompt, 12)
        script.truth[f"r{i}"] = want[i]
        schedule.append((0, GenerationRequest(prompt, max_new_tokens=12, request_id=f"r{i}"), None))
    results, _ = drive(decoder, schedule)
    return decoder, results, want


def test_the_batch_budget_is_given_the_steps_time_outside_the_forward(tiny, monkeypatch):
    """The scheduler measures what its steps spend outside the forward and hands it to the budget,
    in units of the target's one-token forward; outputs stay each request's own plain greedy."""
    import draftmesh.verify.scheduler as scheduler_module

    monkeypatch.setattr(tiny, "batch_step_seconds", 1e-6)  # a tiny unit: any real overhead is large in it
    given = []

    def recording(*args, **kwargs):
        given.append(kwargs["overhead"])
        return choose_nodes(*args, **kwargs)

    monkeypatch.setattr(scheduler_module, "choose_nodes", recording)
    decoder, results, want = _three_scripted_requests(tiny, CostAwareTreeBuilder({1: 1.0, 64: 1.0}), seed=8)
    # the first step admits all three (left out of the average), so the budget weighs the forward
    # alone until a step has decoded without admitting; from then on it is given that step's time
    assert len(given) >= 3 and given[0] == given[1] == 0.0 and all(o > 0 for o in given[2:])
    assert {i: tuple(r.token_ids) for i, r in results.items()} == {i: tuple(w) for i, w in want.items()}


def test_the_batch_budget_weighs_trees_at_their_measured_cost(tiny, monkeypatch):
    """The scheduler times its forwards into the tree-cost correction and, once it has timed trees,
    hands the budget the learned factor for the table's tree part (held at 3 here); outputs stay
    each request's own plain greedy."""
    import draftmesh.verify.scheduler as scheduler_module
    from draftmesh.verify.budget import TreeCostCorrection

    monkeypatch.setattr(TreeCostCorrection, "factor", lambda self, rows: 3.0 if self.trees else 1.0)
    monkeypatch.setattr(tiny, "batch_step_seconds", 1e-3)  # the unit forwards are timed in
    given = []

    def recording(candidates, cost, **kwargs):
        given.append(kwargs)
        return choose_nodes(candidates, cost, **kwargs)

    monkeypatch.setattr(scheduler_module, "choose_nodes", recording)
    decoder, results, want = _three_scripted_requests(tiny, CostAwareTreeBuilder({1: 1.0, 2: 1.2, 8: 1.6, 64: 4.0}),
                                                      seed=9)
    assert {i: tuple(r.token_ids) for i, r in results.items()} == {i: tuple(w) for i, w in want.items()}
    assert decoder.batch_stats()["tree_cost_factors"] and set(decoder.batch_stats()["tree_cost_factors"].values()) == {3.0}
    factors = [kw["tree_factor"] for kw in given]
    assert factors[0] == 1.0 and 3.0 in factors  # nothing timed yet: the warm-up table itself; then the factor
    assert factors == sorted(factors)


def test_the_batch_budget_is_told_which_of_the_steps_tokens_are_prompt_chunks(tiny, monkeypatch):
    """The first step prefills the three prompts at once with their first roots and trees: the budget
    is given those chunks' tokens apart, and the decoding rows; later steps hold no chunk."""
    import draftmesh.verify.scheduler as scheduler_module

    given = []

    def recording(candidates, cost, **kwargs):
        given.append(kwargs)
        return choose_nodes(candidates, cost, **kwargs)

    monkeypatch.setattr(scheduler_module, "choose_nodes", recording)
    decoder, results, want = _three_scripted_requests(tiny, CostAwareTreeBuilder({1: 1.0, 64: 1.0}), seed=10)
    assert {i: tuple(r.token_ids) for i, r in results.items()} == {i: tuple(w) for i, w in want.items()}
    rng = random.Random(10)  # the helper's prompts, drawn again
    prompts = sum(len(random_prompt(rng, tiny.vocab_size)) for _ in range(3))
    first = given[0]
    assert first["decoding_rows"] == first["rows"] == 3
    # every prompt but its last token, which goes in as the row's root
    assert first["prefill_tokens"] == prompts - 3 and first["base_tokens"] == prompts
    assert all(kw["prefill_tokens"] == 0 and kw["decoding_rows"] == kw["rows"] for kw in given[1:])


def test_the_batch_budget_prices_each_rows_tokens_by_its_cache(tiny, monkeypatch):
    """A row whose cache is longer than the budget's table was measured at (``COST_CONTEXT``) gets a
    price per node and for its root from the target's measured slopes, the short row none; the forward's timing is
    recorded with the same prices; outputs stay each request's own plain greedy."""
    import draftmesh.verify.scheduler as scheduler_module
    from draftmesh.backend import COST_CONTEXT, KeyCost
    from draftmesh.verify.budget import TreeCostCorrection

    monkeypatch.setattr(tiny, "key_cost", KeyCost(row=0.004, token=0.002))
    monkeypatch.setattr(tiny, "batch_step_seconds", 1e-3)
    given, recorded = [], []

    def choosing(candidates, cost, **kwargs):
        given.append(kwargs)
        return choose_nodes(candidates, cost, **kwargs)

    real_record = TreeCostCorrection.record

    def recording(self, *args, **kwargs):
        recorded.append(kwargs)
        return real_record(self, *args, **kwargs)

    monkeypatch.setattr(scheduler_module, "choose_nodes", choosing)
    monkeypatch.setattr(TreeCostCorrection, "record", recording)
    rng = random.Random(11)
    script = PerRequestScript(tiny.vocab_size, seed=11)
    decoder = SpeculativeDecoder(tiny, [script], CostAwareTreeBuilder({1: 1.0, 2: 1.05, 8: 1.1, 64: 2.0}))
    prompts = {"long": random_prompt(rng, tiny.vocab_size, COST_CONTEXT + 40, COST_CONTEXT + 40),
               "short": random_prompt(rng, tiny.vocab_size, 10, 10)}
    schedule, want = [], {}
    for i, (name, prompt) in enumerate(prompts.items()):
        new = 12 if name == "long" else 60  # the short one still decodes once the long one's prompt is in
        want[i] = reference_greedy(tiny, prompt, new)
        script.truth[name] = want[i]
        schedule.append((0, GenerationRequest(prompt, max_new_tokens=new, request_id=name), None))
    results, _ = drive(decoder, schedule)
    assert {i: tuple(r.token_ids) for i, r in results.items()} == {i: tuple(w) for i, w in want.items()}
    both = [kw for kw in given if len(kw["node_prices"]) == 2]
    assert both
    for kw in both:  # the long row's: 0.002 a node per key past the table; the short row's none
        short_price, long_price = sorted(kw["node_prices"])
        assert long_price >= 0.002 * 39 and short_price == 0.0  # its cache: the prompt but its last token
        assert kw["base_keys"] >= 2 * long_price  # its root, at the first token's slope
    assert any(kw["tree_keys"] > 0 for kw in recorded) and any(kw["base_keys"] > 0 for kw in recorded)


def test_a_prefill_chunks_tokens_are_priced_without_their_logits_and_kept_out_of_the_correction(tiny, monkeypatch):
    """The budget's table was measured with logits at every token; a prefill chunk's tokens have
    none. A long prompt prefilled in chunks beside a decoding request: the budget is told the chunk
    price (1 - the target's ``head_share``), and exactly the timed forwards without a chunk are
    recorded for the tree-cost correction, with all their tokens; outputs stay each request's
    plain greedy."""
    import draftmesh.verify.scheduler as scheduler_module
    from draftmesh.verify.budget import TreeCostCorrection

    monkeypatch.setattr(tiny, "head_share", 0.25)
    monkeypatch.setattr(tiny, "batch_step_seconds", 1e-3)
    given, recorded, forwards = [], [], []

    def choosing(candidates, cost, **kwargs):
        given.append(kwargs)
        return choose_nodes(candidates, cost, **kwargs)

    real_record, real_forward = TreeCostCorrection.record, tiny.forward_batch

    def recording(self, cost, rows, base_tokens, tokens, forward_s, **kwargs):
        recorded.append((rows, base_tokens, tokens))
        return real_record(self, cost, rows, base_tokens, tokens, forward_s, **kwargs)

    def forwarding(kv, inputs, **kwargs):
        forwards.append([(len(i.tokens), i.logits_from) for i in inputs])
        return real_forward(kv, inputs, **kwargs)

    monkeypatch.setattr(scheduler_module, "choose_nodes", choosing)
    monkeypatch.setattr(TreeCostCorrection, "record", recording)
    monkeypatch.setattr(tiny, "forward_batch", forwarding)
    rng = random.Random(12)
    script = PerRequestScript(tiny.vocab_size, seed=12)
    decoder = SpeculativeDecoder(tiny, [script], CostAwareTreeBuilder({1: 1.0, 2: 1.05, 8: 1.1, 64: 2.0}),
                                 batch_limits=BatchLimits(prefill_chunk=16, prefill_while_decoding=8))
    prompts = {"short": random_prompt(rng, tiny.vocab_size, 6, 6), "long": random_prompt(rng, tiny.vocab_size, 90, 90)}
    schedule, want = [], {}
    for i, (name, prompt) in enumerate(prompts.items()):
        new = 40 if name == "short" else 6
        want[i] = reference_greedy(tiny, prompt, new)
        script.truth[name] = want[i]
        schedule.append((0 if name == "short" else 2, GenerationRequest(prompt, max_new_tokens=new, request_id=name), None))
    results, _ = drive(decoder, schedule)
    assert {i: tuple(r.token_ids) for i, r in results.items()} == {i: tuple(w) for i, w in want.items()}
    assert given and all(kw["chunk_price"] == 0.75 for kw in given)
    chunkless = [shape for shape in forwards if not any(lf for _, lf in shape)]  # a chunk's tokens have no logits
    assert len(forwards) - len(chunkless) >= 5  # the long prompt went in over several steps beside the decoding row
    assert [(rows, tokens) for rows, _, tokens in recorded] == [(len(shape), sum(n for n, _ in shape)) for shape in chunkless]


class _SubmittingSource:
    """On its first call, sends a request to the decoder: a client whose next request arrives while
    a step's sources are drafting."""

    name = "submitting"

    def __init__(self, decoder_ref: list, request: GenerationRequest) -> None:
        self.decoder_ref, self.request, self.ticket = decoder_ref, request, None

    def propose(self, ctx):
        if self.ticket is None:
            self.ticket = self.decoder_ref[0].submit(self.request)
        return []


def test_a_request_that_arrives_while_the_sources_draft_joins_that_steps_forward(tiny):
    """Admission runs again once a step's sources have answered: a request sent meanwhile is
    prefilled in that step's forward (its prompt fits one chunk, so it has its first token) instead
    of waiting a whole step; both outputs stay their own plain greedy."""
    rng = random.Random(13)
    first, late = random_prompt(rng, tiny.vocab_size, 8, 8), random_prompt(rng, tiny.vocab_size, 12, 12)
    ref: list = []
    source = _SubmittingSource(ref, GenerationRequest(late, max_new_tokens=6, request_id="late"))
    decoder = SpeculativeDecoder(tiny, [source], TrieBuilder(max_nodes=8))  # no deadline: sources run inline
    ref.append(decoder)
    ticket = decoder.submit(GenerationRequest(first, max_new_tokens=6, request_id="first"))
    decoder.scheduler.step()  # the first request's prefill; its root comes with it, so its sources are asked
    assert source.ticket is not None and source.ticket.admitted_at is not None
    assert [type(e).__name__ for e in source.ticket.events] == ["StepEvent"]  # its first token, this step
    while not (ticket.done and source.ticket.done):
        decoder.scheduler.step()
    for t, prompt in ((ticket, first), (source.ticket, late)):
        assert t.error is None and tuple(list(t.events)[-1].token_ids) == tuple(reference_greedy(tiny, prompt, 6))


class _LateSource:
    """Answers nothing, always after the step's deadline."""

    name = "late"

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.calls = 0

    def propose(self, ctx):
        self.calls += 1
        time.sleep(self.delay_s)
        return []


def test_a_step_waits_one_source_deadline_whatever_its_batch(tiny):
    """Every request's calls are started before any is awaited: a source that misses the deadline
    for four requests of a batch costs the step one deadline (0.2 s), not four (0.8 s, as it did
    when each request's calls were awaited in turn); the requests still decode their plain output."""
    late = _LateSource(1.0)
    decoder = SpeculativeDecoder(tiny, [late], TrieBuilder(max_nodes=8), source_deadline_s=0.2)
    try:
        rng = random.Random(11)
        prompts = [random_prompt(rng, tiny.vocab_size) for _ in range(4)]
        tickets = [decoder.submit(GenerationRequest(p, max_new_tokens=4, request_id=f"r{i}")) for i, p in enumerate(prompts)]
        t0 = time.perf_counter()
        decoder.scheduler.step()
        first = time.perf_counter() - t0
        assert late.calls == 4  # every request asked it
        assert first < 0.6
        while not all(t.done for t in tickets):
            decoder.scheduler.step()
        for p, t in zip(prompts, tickets):
            result = list(t.events)[-1]
            assert t.error is None and tuple(result.token_ids) == tuple(reference_greedy(tiny, p, 4))
    finally:
        decoder.close()


def test_speculation_off_requests_share_the_batch_with_speculating_ones(tiny):
    rng = random.Random(4)
    script = PerRequestScript(tiny.vocab_size, seed=3)
    decoder = SpeculativeDecoder(tiny, [script], TrieBuilder(max_nodes=8))
    schedule, want = [], {}
    for i in range(4):
        prompt = random_prompt(rng, tiny.vocab_size, 3, 20)
        want[i] = reference_greedy(tiny, prompt, 12)
        script.truth[f"o{i}"] = want[i]
        spec = SpeculationParams(enabled=i % 2 == 0)
        schedule.append((0, GenerationRequest(prompt, max_new_tokens=12, request_id=f"o{i}", speculation=spec), None))
    results, _ = drive(decoder, schedule)
    for i in range(4):
        assert results[i].token_ids == want[i]
        trees = sum(s.tree_size for s in results[i].steps)
        assert (trees > 0) == (i % 2 == 0)


def test_a_request_whose_sources_cannot_be_asked_fails_alone_and_its_draft_span_ends(tiny, monkeypatch):
    """Building one request's draft context raises: that request fails, the other decodes its plain
    output, and the failed request's ``draft`` span is ended (it is ended when the answers are
    collected, which a request that failed while asking never reaches)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    rng = random.Random(12)
    prompts = [random_prompt(rng, tiny.vocab_size) for _ in range(2)]
    script = PerRequestScript(tiny.vocab_size, seed=12)
    decoder = SpeculativeDecoder(tiny, [script], TrieBuilder(max_nodes=8))
    decoder._tracer = provider.get_tracer("test")
    real = decoder._context

    def context(req, *args, **kwargs):
        if req.request_id == "bad":
            raise RuntimeError("no context")
        return real(req, *args, **kwargs)

    monkeypatch.setattr(decoder, "_context", context)
    script.truth["good"] = want = reference_greedy(tiny, prompts[1], 6)
    bad = decoder.submit(GenerationRequest(prompts[0], max_new_tokens=6, request_id="bad"))
    good = decoder.submit(GenerationRequest(prompts[1], max_new_tokens=6, request_id="good"))
    while not (bad.done and good.done):
        decoder.scheduler.step()
    assert isinstance(bad.error, RuntimeError) and good.error is None
    assert tuple(list(good.events)[-1].token_ids) == tuple(want)
    drafts = [s for s in exporter.get_finished_spans() if s.name == "draft"]
    asked = sum(1 for step in good.run.steps if step.draft_s > 0)  # the steps the good request asked its source at
    assert asked >= 1 and len(drafts) == asked + 1  # and the bad request's one
