"""The forward-cost probe's shapes (``draftmesh.bench.forward_cost``): the same tokens as chains over
eight rows, as one row's chain and as one row's tree, each a valid forward of the batched target."""

from __future__ import annotations

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
