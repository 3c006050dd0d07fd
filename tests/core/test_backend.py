"""Tree attention and KV compaction against sequential decoding (float64, random weights)."""

from __future__ import annotations

import random

import torch

from draftmesh.backend import KVState
from draftmesh.tree import TokenTree


def random_tree(rng: random.Random, vocab: int, n: int, max_depth: int = 6) -> TokenTree:
    tree = TokenTree()
    while len(tree) < n:
        candidates = [-1] + [i for i, d in enumerate(tree.depths) if d < max_depth]
        parent = rng.choice(candidates)
        tree.add(parent, rng.randrange(vocab), "test")
    return tree


def sequential_logits(target, prefix: list[int], path_tokens: list[int]) -> torch.Tensor:
    """Logits after each of prefix[-1], path_tokens... by plain one-token steps."""
    state = KVState()
    target.prefill(state, prefix[:-1])
    rows = [target.step(state, prefix[-1])[0]]
    for tok in path_tokens:
        rows.append(target.step(state, tok)[0])
    return torch.stack(rows)


def test_tree_logits_equal_sequential_decoding(tiny):
    rng = random.Random(1)
    # contexts longer than the sliding window (8) exercise the Gemma 3 window in the tree mask
    for context_len in (1, 5, 30):
        prompt = [rng.randrange(1, tiny.vocab_size) for _ in range(context_len)]
        tree = random_tree(rng, tiny.vocab_size, 12)
        state = KVState()
        tiny.prefill(state, prompt[:-1])
        logits = tiny.forward_tree(state, prompt[-1], tree)
        assert logits.shape == (len(tree) + 1, tiny.vocab_size)
        for node in range(len(tree)):
            path = tree.path_to(node)
            seq = sequential_logits(tiny, prompt, [tree.tokens[i] for i in path])
            torch.testing.assert_close(logits[1 + node], seq[-1], rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(logits[0], seq[0], rtol=1e-9, atol=1e-9)


def test_deep_tree_crossing_the_sliding_window(tiny):
    """A chain deeper than the window: nodes must stop seeing far ancestors too."""
    rng = random.Random(2)
    prompt = [rng.randrange(1, tiny.vocab_size) for _ in range(20)]
    tree = TokenTree()
    node = -1
    for _ in range(14):
        node = tree.add(node, rng.randrange(1, tiny.vocab_size), "chain")
    state = KVState()
    tiny.prefill(state, prompt[:-1])
    logits = tiny.forward_tree(state, prompt[-1], tree)
    seq = sequential_logits(tiny, prompt, tree.tokens)
    torch.testing.assert_close(logits, seq, rtol=1e-9, atol=1e-9)


def test_commit_keeps_only_the_accepted_path_and_equals_a_fresh_prefill(tiny):
    rng = random.Random(3)
    for trial in range(6):
        prompt = [rng.randrange(1, tiny.vocab_size) for _ in range(rng.randrange(2, 25))]
        tree = random_tree(rng, tiny.vocab_size, rng.randrange(1, 16))
        leaf = rng.randrange(len(tree))
        path = tree.path_to(leaf)
        state = KVState()
        tiny.prefill(state, prompt[:-1])
        base = state.length
        tiny.forward_tree(state, prompt[-1], tree)
        tiny.commit(state, base, [0] + [1 + i for i in path])
        fresh = KVState()
        tiny.prefill(fresh, prompt + [tree.tokens[i] for i in path])
        assert state.length == fresh.length == len(prompt) + len(path)
        for got, want in zip(state.cache.layers, fresh.cache.layers):
            assert got.keys.shape == want.keys.shape
            torch.testing.assert_close(got.keys, want.keys, rtol=1e-9, atol=1e-9)
            torch.testing.assert_close(got.values, want.values, rtol=1e-9, atol=1e-9)


def test_commit_of_nothing_rolls_back_the_whole_tree(tiny):
    prompt = [3, 4, 5, 6]
    tree = random_tree(random.Random(4), tiny.vocab_size, 5)
    state = KVState()
    tiny.prefill(state, prompt[:-1])
    before = [layer.keys.clone() for layer in state.cache.layers]
    tiny.forward_tree(state, prompt[-1], tree)
    tiny.commit(state, 3, [])
    assert state.length == 3
    for got, want in zip(state.cache.layers, before):
        torch.testing.assert_close(got.keys, want)


def test_cost_curve_is_relative_to_a_single_token_step(tiny):
    curve = tiny.measure_cost_curve(sizes=(1, 4, 16), context=16, repeats=2)
    assert set(curve) == {1, 4, 16}
    assert curve[1] == 1.0
    assert all(v > 0 for v in curve.values())
    assert tiny.step_seconds and tiny.step_seconds > 0


def test_the_cheap_shapes_and_the_unit_are_timed_twice_a_round(tiny, monkeypatch):
    """Every point of the tables is divided by the one-token unit and the budget reads the small
    shapes most: they get twice the samples of the big ones (``CHEAP_COST_TOKENS``)."""
    from collections import Counter

    from draftmesh.backend import CHEAP_COST_TOKENS

    shapes = Counter()
    real = tiny.forward_batch
    monkeypatch.setattr(tiny, "forward_batch", lambda kv, inputs, **k: (
        shapes.update([(len(inputs), len(inputs[0].tokens))]) if inputs[0].logits_from == 0 else None, real(kv, inputs, **k))[1])
    tiny.measure_batch_cost(rows=(2, 8), per_row=(1, 4), context=8, repeats=2)
    assert shapes == {(1, 1): 6, (2, 1): 6, (2, 4): 6, (8, 1): 6, (8, 4): 3}
    assert 8 * 4 > CHEAP_COST_TOKENS >= 8 * 1
    tokens = Counter()
    real_tree = tiny.forward_tree
    monkeypatch.setattr(tiny, "forward_tree", lambda state, root, tree, **k: (
        tokens.update([1 + len(tree)]), real_tree(state, root, tree, **k))[1])
    tiny.measure_cost_curve(sizes=(1, 4, 32), context=40, repeats=2)
    assert tokens == {1: 6, 4: 6, 32: 3}


def test_a_rows_longer_cache_is_measured_as_a_cost_per_token_and_key():
    """Where attention dominates (a small model of wide heads, 2048 cached keys against 128), the
    same forwards over the longer cache cost more: the row's first token and its further ones each
    get a slope, what the budget prices a row's root and its tree nodes by; a model whose context
    cannot hold the longer cache is not measured (zeros)."""
    from tiny_models import tiny_target

    from draftmesh.backend import KeyCost

    wide = tiny_target(dtype=torch.float32, hidden_size=256, intermediate_size=64, num_attention_heads=4,
                       num_key_value_heads=4, max_position_embeddings=4096)
    slopes = wide.measure_key_cost(long_context=2048, repeats=5)
    assert slopes == wide.key_cost and slopes.row > 0 and slopes.token > 0
    short = tiny_target()  # 256 positions
    assert short.measure_key_cost() == KeyCost(0.0, 0.0) == short.key_cost


def test_the_budgets_costs_are_measured_once_per_target(monkeypatch):
    from tiny_models import tiny_target

    tiny = tiny_target()  # its own: the session's tiny targets keep no measured costs
    calls = []
    for name in ("measure_cost_curve", "measure_batch_cost", "measure_key_cost"):
        real = getattr(tiny, name)
        monkeypatch.setattr(tiny, name, lambda *a, _real=real, _name=name, **k: (calls.append(_name), _real(*a, **k))[1])
    tiny.ensure_costs()
    tiny.ensure_costs()
    assert sorted(calls) == ["measure_batch_cost", "measure_cost_curve", "measure_key_cost"]
    assert tiny.cost_curve and tiny.batch_cost and tiny.key_cost is not None


def test_the_heads_share_of_a_tokens_work_counts_each_weight_matrix_once():
    """A prefill chunk's tokens skip the output head; its share is the head's multiply-adds over a
    token's, from the shapes: 3 layers of q, k, v, o (32x32, 16x32, 16x32, 32x32) and gate, up,
    down (64x32 each), and a 64x32 head. Tied to the embeddings, the one matrix is the head's work."""
    from tiny_models import tiny_target

    layer = 32 * 32 + 16 * 32 + 16 * 32 + 32 * 32 + 3 * 64 * 32
    head = 64 * 32
    tiny = tiny_target(tie_word_embeddings=False)
    assert tiny.model.get_output_embeddings().weight is not tiny.model.get_input_embeddings().weight
    assert tiny.head_share == head / (3 * layer + head)  # the untied input embeddings: only looked up
    tied = tiny_target(tie_word_embeddings=True)
    assert tied.model.get_output_embeddings().weight is tied.model.get_input_embeddings().weight
    assert tied.head_share == tiny.head_share
