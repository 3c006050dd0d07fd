"""The tree attention kernel: each token attends over its own row's cache and its own ancestors
only (float64 reference, NaN everywhere else in the slab), bitwise the same alone or in any step
and any thread count; and where it applies (fp32 short rows) versus where SDPA stays."""

from __future__ import annotations

import pytest
import torch

from draftmesh import tree_attention
from draftmesh.batch_kv import LONG_ROW_TOKENS, RowInput, SlotKVCache, _ancestors
from draftmesh.packed_linear import cpu_isa
from tests.tiny_models import tiny_target

HQ, HK, CAP = 4, 2, 64


@pytest.fixture
def kernel() -> tree_attention.TreeAttention:
    if cpu_isa() not in tree_attention.VECTOR_FLOATS:
        pytest.skip("this CPU runs no build")
    loaded = tree_attention.kernel()
    assert loaded is not None, "`make setup` builds the native library on this CPU (is a C++ compiler there?)"
    return loaded


# (row, cached length, parents of the step's tokens): a root alone, a tree with a second
# root-level branch, a fresh prompt's chain, a row with an empty cache and a tree.
ROWS = [
    (0, 10, [-1]),
    (1, 20, [-1, 0, 0, 1, 1, 2, -1, 6]),
    (2, 0, [-1, 0, 1, 2, 3]),
    (3, 0, [-1, 0, 0]),
]


def slab_and_queries(dim: int, rows=ROWS, seed: int = 0):
    """A slab whose only finite entries are each row's cache and new tokens; queries per token."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.full((len(ROWS), HK, CAP, dim), float("nan"))
    values = torch.full((len(ROWS), HK, CAP, dim), float("nan"))
    total = sum(len(p) for _, _, p in rows)
    for row, length, parents in rows:
        n = length + len(parents)
        keys[row, :, :n] = torch.randn((HK, n, dim), generator=gen)
        values[row, :, :n] = torch.randn((HK, n, dim), generator=gen)
    return keys, values, torch.randn((total, HQ, dim), generator=gen)


def plan_rows(rows=ROWS):
    first, out = 0, []
    for row, length, parents in rows:
        out.append((row, length, first, parents))
        first += len(parents)
    return out


def reference(keys, values, q, rows, scale):
    """softmax(q k / sqrt(d)) v in float64 over the row's cache and the token's ancestors."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    for row, length, first, parents in rows:
        anc = _ancestors(parents)
        for i in range(len(parents)):
            slots = list(range(length)) + [length + j for j in range(len(parents)) if anc[i, j]]
            for h in range(HQ):
                k = keys[row, h // (HQ // HK), slots].double()
                v = values[row, h // (HQ // HK), slots].double()
                w = torch.softmax(k @ q[first + i, h].double() * scale, dim=0)
                out[first + i, h] = w @ v
    return out


def test_each_token_sees_its_rows_cache_and_its_ancestors_only(kernel):
    dim = 2 * kernel.vector
    keys, values, q = slab_and_queries(dim)
    out = torch.full_like(q, float("nan"))
    kernel.plan(plan_rows()).run(q, out, keys, values, None)
    assert torch.isfinite(out).all(), "a token read a slot outside its row's cache and ancestors"
    torch.testing.assert_close(out.double(), reference(keys, values, q, plan_rows(), dim ** -0.5), rtol=1e-5, atol=1e-5)
    scaled = torch.empty_like(q)
    kernel.plan(plan_rows()).run(q, scaled, keys, values, 0.3)  # an explicit scale is the one used
    torch.testing.assert_close(scaled.double(), reference(keys, values, q, plan_rows(), 0.3), rtol=1e-5, atol=1e-5)


def test_a_tokens_output_is_bitwise_the_same_alone_in_any_step_and_thread_count(kernel):
    dim = 4 * kernel.vector
    keys, values, q = slab_and_queries(dim, seed=1)
    together = torch.empty_like(q)
    kernel.plan(plan_rows()).run(q, together, keys, values, None)
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2, 3):
            torch.set_num_threads(n_threads)
            first = 0
            for row, length, parents in ROWS:  # each row alone, its tokens at their own offsets
                alone = torch.empty_like(q)
                kernel.plan([(row, length, first, parents)]).run(q, alone, keys, values, None)
                sl = slice(first, first + len(parents))
                assert torch.equal(alone[sl], together[sl]), (n_threads, row)
                first += len(parents)
    finally:
        torch.set_num_threads(threads)


def test_fp32_short_rows_use_the_kernel_and_prefill_chunks_and_float64_keep_sdpa(kernel, monkeypatch):
    def view(dtype, tokens_per_row):
        kv = SlotKVCache(layers=1, kv_heads=HK, head_dim=2 * kernel.vector, dtype=dtype, max_bytes=1 << 30)
        kv.ensure(2, 128)
        kv.add_row(), kv.add_row()
        return kv.view([RowInput.chain(r, list(range(n))) for r, n in enumerate(tokens_per_row)], attention=kernel)

    short = view(torch.float32, [1, 4])
    assert short.native is not None and short.groups == []
    mixed = view(torch.float32, [1, LONG_ROW_TOKENS + 1])
    assert mixed.native is not None and len(mixed.native.items) == 1 and len(mixed.groups) == 1
    exact = view(torch.float64, [1, 4])
    assert exact.native is None and len(exact.groups) == 1
    assert tiny_target("llama", dtype=torch.float32, hidden_size=64).tree_attention is kernel
    monkeypatch.setenv(tree_attention.ENV, "off")
    monkeypatch.setattr(tree_attention, "_looked", False)
    monkeypatch.setattr(tree_attention, "_kernel", None)
    assert tree_attention.kernel() is None
    assert tiny_target("llama", dtype=torch.float32, hidden_size=64).tree_attention is None


def test_a_library_built_from_older_source_is_not_called(kernel, monkeypatch, caplog):
    """A library whose calling convention is not this module's (an editable install not rebuilt) would
    read its arguments wrongly: SDPA attends instead, with a warning that says to rebuild."""
    monkeypatch.setattr(tree_attention, "_kernel", None)
    monkeypatch.setattr(tree_attention, "_looked", False)
    monkeypatch.setattr(tree_attention, "_abi", lambda lib: None)
    with caplog.at_level("WARNING", logger="draftmesh.tree_attention"):
        assert tree_attention.kernel() is None
    assert "pip install -e ." in caplog.text
    monkeypatch.setattr(tree_attention, "_looked", False)
    monkeypatch.setattr(tree_attention, "_abi", lambda lib: tree_attention.ABI)
    assert tree_attention.kernel() is not None
