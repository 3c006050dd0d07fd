"""The few-rows linear computes the same product as F.linear, and is wired into every target."""

import torch
import torch.nn.functional as F
from torch import nn

from draftmesh import small_linear
from draftmesh.small_linear import small_rows_linear, use_small_rows_linear


def test_small_rows_linear_equals_f_linear_for_every_row_count_and_shape():
    torch.manual_seed(0)
    for bias in (False, True):
        lin = nn.Linear(96, 40, bias=bias)
        for rows in (1, 2, 3, 5, 8, 13, 32, 33):
            for shape in ((rows, 96), (1, rows, 96)):
                x = torch.randn(*shape)
                got = small_rows_linear(lin, x)
                assert got.shape == F.linear(x, lin.weight, lin.bias).shape
                torch.testing.assert_close(got, F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


def test_small_rows_take_the_transposed_product_and_float64_keeps_f_linear(monkeypatch):
    calls = []
    real_mm = torch.mm
    monkeypatch.setattr(small_linear.torch, "mm", lambda a, b: calls.append(tuple(b.shape)) or real_mm(a, b))
    lin = nn.Linear(16, 8)
    small_rows_linear(lin, torch.randn(1, 3, 16))
    assert calls == [(16, 3)]
    one = torch.randn(1, 1, 16)
    got = small_rows_linear(lin, one)  # one row: stacked twice, not the one-column (GEMV) product
    assert calls == [(16, 3), (16, 2)] and got.shape == (1, 1, 8) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(one, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    small_rows_linear(lin, torch.randn(1, small_linear.MAX_ROWS + 1, 16))
    small_rows_linear(lin.double(), torch.randn(1, 3, 16, dtype=torch.float64))
    assert calls == [(16, 3), (16, 2)]


def test_every_linear_of_a_target_is_routed(tiny):
    model = tiny.model
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    assert linears and all(getattr(m, "_draftmesh_small_rows", False) for m in linears)
    assert use_small_rows_linear(model) == 0  # idempotent
