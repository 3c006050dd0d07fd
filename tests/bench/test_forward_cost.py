"""The forward-cost probe's shapes (``draftmesh.bench.forward_cost``): the same tokens as chains over
eight rows, as one row's chain and as one row's tree, each a valid forward of the batched target."""

from __future__ import annotations

import threading

import pytest
from tiny_models import tiny_target

from draftmesh.bench.forward_cost import SHAPES, TREE_PARENTS, shape_inputs, shape_probe


def test_the_shapes_hold_the_same_tokens_and_the_tree_branches():
    totals = {name: sum(abs(n) for n in shape) for name, shape in SHAPES.items()}
    base, *others = SHAPES
    assert totals[base] == len(SHAPES[base]) == 8
    assert {totals[name] for name in others} == {19}
    assert all(p < i for i, p in enumerate(TREE_PARENTS)) and TREE_PARENTS[0] == -1
    assert len(set(TREE_PARENTS[1:])) < len(TREE_PARENTS) - 1, "a node with two children: a tree, not a chain"
    (tree_row,) = [r for r in shape_inputs(SHAPES[others[-1]], vocab=64) if len(r.tokens) > 1]
    assert list(tree_row.parents) == list(TREE_PARENTS) and tree_row.logits_from == 0


def test_the_probe_times_every_shape_on_a_real_batched_forward():
    found = shape_probe(tiny_target("llama"), rounds=2, context=20)
    assert list(found) == list(SHAPES)
    assert all(ms > 0 for ms in found.values())


def test_bad_shape_contexts_are_a_usage_error_before_any_model_loads(capsys):
    from draftmesh.bench.forward_cost import main

    for bad in ("x", "150,0", ""):
        with pytest.raises(SystemExit) as exit_:
            main(["--shape-probe-only", "--model", "/nonexistent/model", "--shape-contexts", bad])
        assert exit_.value.code == 2
        assert "--shape-contexts" in capsys.readouterr().err


def test_the_cache_is_primed_on_the_compute_thread_whoever_asks():
    """A prefill on the probe's main thread would start a second OpenMP team and slow every forward
    timed after it (``primed_cache``'s docstring)."""
    from draftmesh import compute
    from draftmesh.backend import TorchTarget
    from draftmesh.bench.forward_cost import primed_cache

    target = tiny_target("llama")
    seen: list[int] = []

    def forward(t, kv, inputs):
        seen.append(threading.get_ident())
        return TorchTarget.forward_batch.__wrapped__(t, kv, inputs)

    kv = primed_cache(target, forward, rows=2, context=5, room=3)
    assert kv.lengths == [5, 5]
    assert seen and set(seen) == {compute.run(threading.get_ident)} != {threading.get_ident()}
