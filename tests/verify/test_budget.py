"""The batch's budget: the cost curves, the node choice, and what the scheduler learns of its steps."""

from __future__ import annotations

import random

import pytest

from draftmesh.tree import DraftSequence, TokenTree
from draftmesh.verify.budget import (AskingValue, BatchCost, CostModel, ScoredTree, StepOverhead, TreeCostCorrection,
                                     choose_nodes, key_price, non_decreasing)
from draftmesh.verify.tree_builder import CostAwareTreeBuilder

CURVE = {1: 1.0, 2: 1.1, 4: 1.4, 8: 1.8, 16: 2.1, 32: 2.6, 64: 3.7}


def test_cost_model_interpolates_and_extrapolates():
    cost = CostModel(CURVE)
    assert cost(1) == 1.0 and cost(16) == 2.1
    assert cost(3) == pytest.approx(1.25)
    assert cost(128) == pytest.approx(3.7 + 64 * (3.7 - 2.6) / 32)
    with pytest.raises(ValueError):
        CostModel({2: 1.0})


def test_non_decreasing_pools_the_runs_that_dip_into_their_mean():
    assert non_decreasing([1.0, 1.1, 1.4]) == [1.0, 1.1, 1.4]
    assert non_decreasing([1.0, 0.8, 0.9, 1.2]) == pytest.approx([0.9, 0.9, 0.9, 1.2])
    assert non_decreasing([2.0, 1.0, 3.0, 2.0]) == pytest.approx([1.5, 1.5, 2.5, 2.5])
    rng = random.Random(3)
    for _ in range(100):  # never falls, keeps the sum, and leaves a curve that never fell as it was
        values = [rng.uniform(0.5, 2.0) for _ in range(rng.randint(1, 9))]
        fitted = non_decreasing(values)
        assert all(a <= b + 1e-12 for a, b in zip(fitted, fitted[1:]))
        assert sum(fitted) == pytest.approx(sum(values))
        assert non_decreasing(sorted(values)) == pytest.approx(sorted(values))


def test_a_measured_curve_that_dips_never_makes_a_tree_look_cheaper_than_no_tree():
    """A warm-up whose one-token point was timed high (a 2-core AMD box, 2026-12-04): read as
    measured, 2-8 tokens cost less than 1, so the budget would verify nodes worth nothing, for the
    forward they seem to shorten. Fitted, more tokens never cost less. (Where the fit is flat a few
    nodes still look free: the second sample of the cheap shapes at warm-up is what narrows that.)"""
    dipped = {1: 1.0, 2: 0.856, 4: 0.874, 8: 0.986, 16: 1.333, 32: 2.268, 64: 3.756}
    cost = CostModel(dipped)
    assert [cost(k) for k in (1, 2, 3, 4, 8)] == pytest.approx([0.91, 0.91, 0.91, 0.91, 0.986], abs=1e-3)
    assert all(cost(k) <= cost(k + 1) for k in range(1, 80))
    # one node at 0.01: read as measured, 1.01 tokens for 0.856 against 1 for 1.0 beat a plain step by 18%
    assert (1 + 0.01) / dipped[2] > 1.02 * 1 / dipped[1]
    worthless = ScoredTree(TokenTree.from_sequences([DraftSequence((5,), "s")]), [0.01], [{"s": 1.0}], cap=8)
    assert choose_nodes([worthless], BatchCost(cost), rows=1, base_tokens=1, min_gain=1.02) == [[]]
    batched = BatchCost(cost, {2: {2: 1.146, 4: 1.09, 8: 1.11, 16: 1.6}})
    assert batched(2, 2) <= batched(2, 3) <= batched(2, 4) <= batched(2, 8) < batched(2, 16)


def test_budget_maximizes_expected_tokens_per_unit_of_verify_time():
    """Brute force over prefixes of the score order must agree with the builder's choice."""
    rng = random.Random(0)
    builder = CostAwareTreeBuilder(CURVE)
    for _ in range(50):
        scores = sorted((rng.random() for _ in range(rng.randint(1, 40))), reverse=True)
        chain = TokenTree.from_sequences([DraftSequence(tuple(range(len(scores))), "s")])
        chosen = choose_nodes([ScoredTree(chain, list(scores), [{} for _ in scores], 64)], BatchCost(CostModel(CURVE)),
                              rows=1, base_tokens=1, min_gain=builder.config.min_gain)[0]
        cost = CostModel(CURVE)
        rates = [(1 + sum(scores[:k])) / cost(k + 1) for k in range(len(scores) + 1)]
        best = max(range(len(rates)), key=lambda k: (rates[k], -k))
        want = best if rates[best] >= builder.config.min_gain else 0
        assert len(chosen) == want


def test_the_budget_weighs_the_steps_time_outside_the_forward():
    """With an overhead o (time a step spends outside its forward), the kept prefix maximizes
    (1 + kept scores) / (cost + o): brute force agrees, and a fixed cost makes trees pay sooner."""
    rng = random.Random(2)
    cost = CostModel(CURVE)
    for _ in range(50):
        overhead = rng.choice([0.0, 0.05, 0.3, 1.0])
        scores = sorted((rng.random() for _ in range(rng.randint(1, 40))), reverse=True)
        chain = TokenTree.from_sequences([DraftSequence(tuple(range(len(scores))), "s")])
        chosen = choose_nodes([ScoredTree(chain, list(scores), [{} for _ in scores], 64)], BatchCost(cost),
                              rows=1, base_tokens=1, min_gain=1.02, overhead=overhead)[0]
        rates = [(1 + sum(scores[:k])) / (cost(k + 1) + overhead) for k in range(len(scores) + 1)]
        best = max(range(len(rates)), key=lambda k: (rates[k], -k))
        assert len(chosen) == (best if rates[best] >= 1.02 * rates[0] else 0)
    # one node at 0.12: 1.12 / 1.1 misses the 2% gain over a plain step; with a step twice its forward it pays
    one = ScoredTree(TokenTree.from_sequences([DraftSequence((7,), "s")]), [0.12], [{}], 64)
    assert choose_nodes([one], BatchCost(cost), rows=1, base_tokens=1, min_gain=1.02) == [[]]
    assert choose_nodes([one], BatchCost(cost), rows=1, base_tokens=1, min_gain=1.02, overhead=1.0) == [[0]]


def test_step_overhead_is_the_recent_time_outside_the_forward_per_batch_size_in_forward_units():
    overhead = StepOverhead(unit_s=0.02, halflife=1.0)
    assert overhead(4) == 0.0  # nothing measured yet
    overhead.record(step_s=0.05, forward_s=0.04, rows=2)  # 10 ms outside: 0.5 of a 20 ms forward
    assert overhead(2) == pytest.approx(0.5)
    assert overhead(1) == overhead(4) == pytest.approx(0.5)  # the nearest batch size measured
    overhead.record(step_s=0.03, forward_s=0.03, rows=2)  # halflife 1: halfway to 0
    assert overhead(2) == pytest.approx(0.25)
    overhead.record(step_s=0.01, forward_s=0.02, rows=2)  # a clock that ran backwards counts as 0
    assert overhead(2) == pytest.approx(0.125)
    overhead.record(step_s=0.06, forward_s=0.04, rows=6)  # 1.0 at 6 rows
    assert overhead(4) == pytest.approx(0.5625)  # between two measured sizes: interpolated
    assert overhead(8) == pytest.approx(1.0)
    unknown = StepOverhead(unit_s=None)  # the target's cost not measured: the budget weighs the forward alone
    unknown.record(step_s=1.0, forward_s=0.0, rows=1)
    assert unknown(8) == 0.0


def test_step_overhead_of_a_big_batch_is_what_its_steps_spent_not_rows_times_a_small_ones():
    """Measured on a 2-core box: ~4 ms outside the forward at 1 row, ~6 ms at 8. After a pass's first
    1-row steps, an 8-row step's overhead must read ~6 ms (0.19 of a 32 ms forward), not 8 x 4 ms:
    that overstated every step's price and made the budget buy trees that did not pay."""
    unit = 0.032
    overhead = StepOverhead(unit_s=unit)
    for _ in range(3):
        overhead.record(step_s=unit + 0.004, forward_s=unit, rows=1)
    for _ in range(40):
        overhead.record(step_s=0.05 + 0.006, forward_s=0.05, rows=8)
    assert overhead(1) == pytest.approx(0.004 / unit)
    assert overhead(8) == pytest.approx(0.006 / unit)


def test_step_overhead_leaves_out_the_steps_that_admitted_a_request():
    overhead = StepOverhead(unit_s=0.02)
    overhead.record(step_s=0.5, forward_s=0.1, rows=4, steady=False)  # a slab grown, traces started
    assert overhead(4) == 0.0
    overhead.record(step_s=0.103, forward_s=0.1, rows=4)
    assert overhead(4) == pytest.approx(0.15)


def _table(rows: int, tokens: int) -> float:
    """A made-up warm-up table: 1 for a plain forward of 8 rows, 0.05 a token beyond it."""
    return 1.0 + 0.05 * (tokens - rows)


def test_tree_cost_correction_starts_at_the_table():
    corr = TreeCostCorrection(unit_s=0.03)
    assert corr.factor(8) == 1.0  # nothing learned: the table itself
    unknown = TreeCostCorrection(unit_s=None)  # no unit (cost not measured): nothing learned
    unknown.record(_table, 8, 8, 20, 1.0)
    assert unknown.factor(8) == 1.0


def test_tree_cost_correction_learns_what_tree_tokens_really_cost():
    """Forwards without trees as the table says; with trees, their tree part twice the table's."""
    unit = 0.03
    corr = TreeCostCorrection(unit_s=unit, prior=0.5)
    for _ in range(200):
        corr.record(_table, 8, 8, 8, unit * 1.0)
        corr.record(_table, 8, 8, 20, unit * (1.0 + 2 * 0.05 * 12))
    assert corr.scale(8) == pytest.approx(1.0)
    assert corr.factor(8) == pytest.approx(2.0, rel=0.02)
    assert corr.factor(6) == corr.factor(8)  # a batch size not seen with trees: the nearest one's


def test_tree_cost_correction_does_not_blame_the_trees_for_a_loaded_box():
    """Every forward 1.5x the table (another process took the CPU): the trees cost what the table says."""
    unit = 0.03
    corr = TreeCostCorrection(unit_s=unit, prior=0.5)
    for _ in range(200):
        corr.record(_table, 4, 4, 4, unit * 1.5)
        corr.record(_table, 4, 4, 10, unit * 1.5 * (1.0 + 0.05 * 6))
    assert corr.scale(4) == pytest.approx(1.5)
    assert corr.factor(4) == pytest.approx(1.0, rel=0.02)


def test_tree_cost_correction_is_bounded_and_a_dearer_tree_part_shrinks_the_budgets_trees():
    unit = 0.03
    corr = TreeCostCorrection(unit_s=unit, prior=0.5, bounds=(0.5, 4.0))
    for _ in range(200):
        corr.record(_table, 2, 2, 2, unit)
        corr.record(_table, 2, 2, 6, unit * (1.0 + 10 * 0.05 * 4))  # ten times the table's tree part
    assert corr.factor(2) == 4.0
    # a node worth 0.3 of a token pays against the table at 2 rows, not against four times its price
    cand = ScoredTree(TokenTree.from_sequences([DraftSequence((5,), "s")]), [0.3], [{"s": 1.0}], cap=8)
    assert choose_nodes([cand, None], _table, rows=2, base_tokens=2, min_gain=1.02) == [[0], []]
    assert choose_nodes([cand, None], _table, rows=2, base_tokens=2, min_gain=1.02,
                        tree_factor=corr.factor(2)) == [[], []]


def test_tree_factor_scales_only_what_the_trees_add_to_the_forward():
    """A plain 2-row forward costs 1.0 and a tree token 0.05 (``_table``): a node worth 0.2 of a token
    makes 2.2 / (1 + 0.05 f) tokens per unit against a plain 2, so it pays below f = 2 only. Were the
    factor to scale the whole forward, it could not change the choice at all."""
    cand = ScoredTree(TokenTree.from_sequences([DraftSequence((5,), "s")]), [0.2], [{"s": 1.0}], cap=8)
    kept = [choose_nodes([cand, None], _table, rows=2, base_tokens=2, min_gain=1.0, tree_factor=f)[0] for f in (1, 1.5, 2.5, 4)]
    assert kept == [[0], [0], [], []]


def test_a_steps_prefill_does_not_make_its_tree_tokens_look_cheap():
    """Two decoding rows share the forward with a 60-token prompt chunk (``_table``: 1 + 0.05 a token
    beyond the rows). Against that step's own rate (2 tokens for 4 units) a node worth 0.05 of a
    token looked worth its 0.05 units; at the rate the batch decodes at (2 a unit) it is not, and a
    node worth 0.3 still is."""
    def cand(score):
        return ScoredTree(TokenTree.from_sequences([DraftSequence((5,), "s")]), [score], [{"s": 1.0}], cap=8)

    step = dict(rows=3, base_tokens=62, min_gain=1.0, prefill_tokens=60, decoding_rows=2)
    assert choose_nodes([cand(0.05), None], _table, rows=3, base_tokens=62, min_gain=1.0) == [[0], []]  # the step's own rate
    assert choose_nodes([cand(0.05), None], _table, **step) == [[], []]
    assert choose_nodes([cand(0.3), None], _table, **step) == [[0], []]


def test_with_prefill_the_kept_nodes_are_worth_their_time_at_the_batchs_decoding_rate():
    """Brute force: the decoding rows' best rate without the chunks is the price; the kept prefix
    maximizes the kept scores minus the price times what they add to the real forward."""
    rng = random.Random(3)
    for _ in range(200):
        rows, prefill = rng.randint(1, 8), rng.randint(1, 200)
        scores = sorted((rng.random() for _ in range(rng.randint(1, 30))), reverse=True)
        chain = TokenTree.from_sequences([DraftSequence(tuple(range(len(scores))), "s")])
        batch = BatchCost(CostModel(CURVE), {r: {r * k: CURVE[1] + 0.1 * r + 0.02 * r * k * k for k in (1, 2, 4, 8)} for r in (2, 4, 8)})
        factor = rng.choice([1.0, 1.7])
        chunk_price = rng.choice([1.0, 0.79])
        kept = choose_nodes([ScoredTree(chain, list(scores), [{} for _ in scores], 64)], batch, rows=rows + 1,
                            base_tokens=rows + prefill, min_gain=1.0, prefill_tokens=prefill, decoding_rows=rows,
                            tree_factor=factor, overhead=0.1, chunk_price=chunk_price)[0]

        def forward(r, base, k):
            return batch(r, base) + factor * (batch(r, base + k) - batch(r, base))

        price = max((rows + sum(scores[:k])) / (forward(rows, rows, k) + 0.1) for k in range(len(scores) + 1))
        real = rows + prefill * chunk_price  # the real forward's tokens as the table counts them
        net = [sum(scores[:k]) - price * (forward(rows + 1, real, k) - forward(rows + 1, real, 0))
               for k in range(len(scores) + 1)]
        assert net[len(kept)] == pytest.approx(max(net))


def test_a_prefill_chunks_tokens_are_read_off_the_table_without_their_logits():
    """The table's tokens all have logits; a chunk's never reach the output head. A decoding row
    beside a 20-token chunk, on a table that turns steep past 20 tokens (1 + 0.01 a token, then
    0.2): counted as table tokens the forward is already on the steep part and no node of 0.9 pays;
    at 0.8 a chunk token (a head of a fifth of the work) it holds 17, and three nodes fit below the
    bend."""
    def cost(rows, tokens):
        return 1 + 0.01 * tokens if tokens <= 20 else 1.2 + 0.2 * (tokens - 20)

    chain = TokenTree.from_sequences([DraftSequence(tuple(range(8)), "s")])
    cand = ScoredTree(chain, [0.9] * 8, [{} for _ in range(8)], 64)
    step = dict(rows=2, base_tokens=21, min_gain=1.0, prefill_tokens=20, decoding_rows=1)
    assert choose_nodes([cand, None], cost, **step) == [[], []]
    assert choose_nodes([cand, None], cost, **step, chunk_price=1.0) == [[], []]
    assert choose_nodes([cand, None], cost, **step, chunk_price=0.8) == [[0, 1, 2], []]


def test_a_rows_cache_beyond_the_tables_prices_its_tokens_by_the_measured_slope():
    assert key_price(None, 5000, 128) == 0.0  # not measured
    assert key_price(0.0, 5000, 128) == 0.0  # flat or not measurable
    assert key_price(1e-4, 100, 128) == 0.0  # shorter than the table's: the table's own price
    assert key_price(1e-4, 1128, 128) == pytest.approx(0.1)


def _chain_candidate(n: int = 6, top: float = 0.9) -> ScoredTree:
    chain = TokenTree.from_sequences([DraftSequence(tuple(range(1, n + 1)), "s")])
    return ScoredTree(chain, [top ** (i + 1) for i in range(n)], [{} for _ in range(n)], 64)


def test_of_two_equal_trees_the_budget_buys_the_short_rows_nodes_first():
    """Two rows with the same candidates: priced alike the nodes alternate by score; when one row's
    cache makes each of its tokens dear, the other row's nodes come first, fewer of the long row's
    are kept, and each row's kept nodes are still a prefix of its chain (ancestor-closed)."""
    table = BatchCost(CostModel({1: 1.0, 64: 1.0}), {2: {2: 1.0, 4: 1.1, 8: 1.3, 16: 1.7}})
    same = choose_nodes([_chain_candidate(), _chain_candidate()], table, rows=2, base_tokens=2, min_gain=1.0)
    assert same[0] == same[1] and same[0]
    dear = choose_nodes([_chain_candidate(), _chain_candidate()], table, rows=2, base_tokens=2, min_gain=1.0,
                        node_prices=[0.0, 0.2], base_keys=0.2)
    assert len(dear[0]) >= len(same[0]) and len(dear[1]) < len(same[1])
    for kept in dear:
        assert kept == list(range(len(kept)))
    # no prices: the order by score, exactly as before
    assert choose_nodes([_chain_candidate(), _chain_candidate()], table, rows=2, base_tokens=2, min_gain=1.0,
                        node_prices=[0.0, 0.0]) == same


def test_at_batch_1_a_long_cache_shrinks_the_tree():
    """Each node of a row with a long cache pays its keys too: fewer nodes pay for themselves."""
    cost = BatchCost(CostModel(CURVE))
    short = choose_nodes([_chain_candidate(12, 0.8)], cost, rows=1, base_tokens=1, min_gain=1.02)[0]
    long = choose_nodes([_chain_candidate(12, 0.8)], cost, rows=1, base_tokens=1, min_gain=1.02,
                        node_prices=[0.3], base_keys=0.3)[0]
    assert 0 < len(long) < len(short)


def test_tree_cost_correction_counts_the_rows_caches_as_the_budget_prices_them():
    """Tree tokens that cost the table's price plus their rows' key price: given those prices, the
    correction learns nothing is amiss (factor 1); not given them, it blames the trees."""
    unit = 0.03
    priced, blind = TreeCostCorrection(unit_s=unit, prior=0.5), TreeCostCorrection(unit_s=unit, prior=0.5)
    base_keys, per_token = 0.4, 0.05  # 8 roots at 0.05 each beyond the table
    for _ in range(200):
        for corr, given in ((priced, True), (blind, False)):
            plain_keys = dict(base_keys=base_keys) if given else {}
            tree_keys = dict(base_keys=base_keys, tree_keys=12 * per_token) if given else {}
            corr.record(_table, 8, 8, 8, unit * (1.0 + base_keys), **plain_keys)
            corr.record(_table, 8, 8, 20, unit * (1.0 + base_keys + 12 * (0.05 + per_token)), **tree_keys)
    assert priced.scale(8) == pytest.approx(1.0) and priced.factor(8) == pytest.approx(1.0, rel=0.02)
    assert blind.factor(8) > 1.3


def test_asking_pays_until_both_kinds_of_step_are_measured():
    """No decision before min_steps steps of each kind at a batch size (None); then asking pays unless
    its steps make less than 1 - slack of the silent steps' tokens per second."""
    value = AskingValue(min_steps=4, slack=0.05)
    assert value.pays(8) is None and value.rates(8) is None
    for _ in range(10):
        value.record(8, True, tokens=8, seconds=0.040)  # 200 tokens/s while asking
    for _ in range(3):
        value.record(8, False, tokens=8, seconds=0.025)  # 320 tokens/s without
    assert value.pays(8) is None and value.rates(8) is None  # three silent steps: not measured yet
    for _ in range(2):  # 4 and more, decayed
        value.record(8, False, tokens=8, seconds=0.025)
    assert value.rates(8) == pytest.approx((200.0, 320.0)) and value.pays(8) is False
    slightly = AskingValue(min_steps=4, slack=0.05)
    for _ in range(8):  # asking 3% below the silent steps: within the slack, it still pays
        slightly.record(4, True, tokens=97, seconds=0.5)
        slightly.record(4, False, tokens=100, seconds=0.5)
    assert slightly.pays(4) is True


def test_asking_value_is_kept_per_batch_size_and_follows_the_load():
    """Asking that does not pay at 8 rows says nothing of 4 rows; a batch size not measured reads the
    nearest measured one; once the asking steps at 8 rows make more tokens a second than the silent
    ones (sources that start copying), asking pays there again."""
    value = AskingValue(halflife=16, min_steps=2)
    for _ in range(20):
        value.record(8, True, tokens=8, seconds=0.040)
        value.record(8, False, tokens=8, seconds=0.030)
        value.record(4, True, tokens=7, seconds=0.030)
        value.record(4, False, tokens=4, seconds=0.022)
    assert value.pays(8) is False and value.pays(4) is True
    assert value.pays(7) is False and value.pays(5) is True and value.pays(6) is True  # a tie reads the smaller
    for _ in range(40):  # the trees start paying at 8 rows: 16 tokens a 40 ms step
        value.record(8, True, tokens=16, seconds=0.040)
    assert value.pays(8) is True
