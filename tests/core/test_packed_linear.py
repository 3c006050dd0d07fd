"""The packed GEMM kernel: the product of F.linear, bitwise the same for a row alone or in any batch,
and wired into every fp32 CPU target (float64 and unsupported CPUs keep F.linear)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from draftmesh import packed_linear
from draftmesh.packed_linear import LIBRARIES, PackedGemm, cpu_isa, library_path, use_packed_linears
from tests.tiny_models import tiny_target

RUNNABLE = {"avx512": ("AVX512",), "avx2": ("AVX2", "AVX512")}
"""ISA build -> the torch CPU capabilities (prefixes) that can run it."""


def runnable_builds() -> list[str]:
    capability = torch.backends.cpu.get_cpu_capability()
    return [isa for isa, caps in RUNNABLE.items() if capability.startswith(caps)]


@pytest.fixture(params=runnable_builds() or [pytest.param(None, marks=pytest.mark.skip("CPU runs no build"))])
def gemm(request) -> PackedGemm:
    path = library_path(request.param)
    assert path is not None, f"`make setup` builds the {request.param} kernel on this CPU (is a C++ compiler there?)"
    return PackedGemm(path, request.param)


def test_the_kernel_for_this_cpu_is_built_and_loaded():
    """make setup builds it; a missing build would silently make every step slower."""
    isa = cpu_isa()
    if isa is None:
        pytest.skip("this CPU has no AVX2")
    loaded = packed_linear.kernel()
    assert loaded is not None and loaded.isa == isa


@pytest.mark.parametrize("bias", [False, True])
def test_equals_the_float64_product_for_every_row_count(gemm, bias):
    torch.manual_seed(0)
    # a zero-padded last block; an odd K over several of the 8 KB chunks that panels of 9-32 rows
    # walk (43 k's a chunk in the AVX-512 build, 128 in the AVX2 one), the last one partial
    n, k = 3 * gemm.block + 5, 301
    weight = torch.randn(n, k)
    b = torch.randn(n) if bias else None
    packed = gemm.pack(weight)
    assert packed.shape == (4, k, gemm.block)
    # 1..9 cover every register tile (and MRMAX + 1); 9..32 rows are walked in chunks, 33 whole;
    # 64/65/130 cross the 64-row panels
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 17, 32, 33, 64, 65, 130):
        x = torch.randn(rows, k)
        got = gemm.mm(x, packed, n, b)
        want = F.linear(x.double(), weight.double(), None if b is None else b.double())
        assert got.shape == (rows, n) and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)  # outputs ~ sqrt(k) = 17
    assert gemm.mm(torch.randn(2, 0, k), packed, n, b).shape == (2, 0, n)  # no rows: nothing to do
    assert gemm.mm(torch.randn(2, 3, k), packed, n, b).shape == (2, 3, n)  # leading dims kept


def test_a_row_is_bitwise_the_same_alone_in_any_batch_and_any_thread_count(gemm):
    """What makes the linears add no batch-dependent rounding to a request's logits."""
    torch.manual_seed(1)
    n, k = 2 * gemm.block + 3, 300  # K over several chunks (see above)
    weight, bias = torch.randn(n, k), torch.randn(n)
    packed = gemm.pack(weight)
    rows = torch.randn(70, k)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([gemm.mm(rows[i : i + 1], packed, n, bias) for i in range(len(rows))])
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            for size in (2, 5, 8, 9, 16, 32, 33, 70):
                for start in (0, 70 - size):
                    got = gemm.mm(rows[start : start + size], packed, n, bias)
                    assert torch.equal(got, alone[start : start + size]), (t, size, start)
    finally:
        torch.set_num_threads(threads)


def test_packing_a_model_drops_its_own_weights_and_keeps_a_tied_one(gemm):
    torch.manual_seed(2)
    embed = nn.Embedding(50, 24)
    head = nn.Linear(24, 50, bias=False)
    head.weight = embed.weight  # tied, as in SmolLM2
    model = nn.ModuleDict({"embed": embed, "up": nn.Linear(24, 40), "head": head, "f64": nn.Linear(24, 8).double()})
    x = torch.randn(3, 24)
    want_up, want_head = model["up"](x), model["head"](x)
    assert use_packed_linears(model, gemm) == 2  # up and head; the float64 layer keeps F.linear
    assert model["up"].weight is None and model["head"].weight is embed.weight
    assert not any(key.endswith("packed_weight") for key in model.state_dict())
    torch.testing.assert_close(model["up"](x), want_up, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model["head"](x), want_head, rtol=1e-5, atol=1e-5)
    assert model["f64"](x.double()).dtype == torch.float64
    with pytest.raises(TypeError, match="packed fp32 CPU weights"):
        model["up"](x.double())
    assert use_packed_linears(model, gemm) == 0  # idempotent


def test_fp32_targets_run_packed_and_float64_ones_keep_f_linear():
    if packed_linear.kernel() is None:
        pytest.skip("no kernel for this CPU")
    fp32 = tiny_target("llama", dtype=torch.float32)
    linears = [m for m in fp32.model.modules() if type(m) is nn.Linear]
    assert fp32.packed_linears == len(linears) > 0
    assert all(getattr(m, "_draftmesh_gemm", None) is not None for m in linears)
    assert tiny_target("llama").packed_linears == 0  # float64: the exactness proofs' dtype


def test_the_env_switch_turns_the_kernel_off_or_picks_a_build(monkeypatch):
    monkeypatch.setattr(packed_linear, "_looked", False)
    monkeypatch.setattr(packed_linear, "_kernel", None)
    monkeypatch.setenv(packed_linear.ENV_ISA, "off")
    assert cpu_isa() is None and packed_linear.kernel() is None
    assert tiny_target("llama", dtype=torch.float32).packed_linears == 0
    monkeypatch.setattr(packed_linear, "_looked", False)
    monkeypatch.setenv(packed_linear.ENV_ISA, "sse9")
    with pytest.raises(ValueError, match=re.escape(f"{packed_linear.ENV_ISA}='sse9': expected one of {sorted(LIBRARIES)}")):
        packed_linear.kernel()


def _huge_pages_of(t: torch.Tensor) -> int:
    """Bytes of ``t``'s mapping backed by transparent huge pages (/proc/self/smaps)."""
    addr, total, inside = t.data_ptr(), 0, False
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and line.startswith("AnonHugePages:"):
                total += int(line.split()[1]) * 1024
    return total


def test_packed_weights_sit_on_their_own_huge_page_aligned_mapping_and_outlive_it():
    """Packed weights are streamed once a step: they get their own mapping, starting on a 2 MiB
    boundary and advised onto transparent huge pages (fewer TLB misses), sized to the tensor's
    last 4 KiB page; views keep it alive after the tensor itself is gone."""
    import gc

    small = packed_linear.weight_buffer((3, 64, 48))  # under 2 MiB: an ordinary tensor
    assert small.shape == (3, 64, 48) and small.dtype == torch.float32
    t = packed_linear.weight_buffer((37, 576, 48))  # 3.9 MiB
    assert t.shape == (37, 576, 48) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % packed_linear.HUGE_PAGE == 0
    t.fill_(2.0)
    part = t[3:5]
    del t
    gc.collect()
    assert float(part.sum()) == 2.0 * 2 * 576 * 48
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as fh:
            thp = fh.read()
    except OSError:
        thp = "[never]"  # no THP here: the mapping stays on small pages
    if "[never]" not in thp:
        assert _huge_pages_of(part) >= packed_linear.HUGE_PAGE  # the one whole extent (3.9 MiB from a boundary)


@pytest.mark.parametrize("rows", [1, 12, 40])
def test_no_input_features_gives_the_bias(gemm, rows):
    """K = 0: every output is the empty sum plus the bias (a chunked panel must still write its sums)."""
    n = gemm.block + 3
    bias = torch.randn(n)
    packed = gemm.pack(torch.empty(n, 0))
    got = gemm.mm(torch.empty(rows, 0), packed, n, bias)
    assert torch.equal(got, bias.expand(rows, n))
    assert torch.equal(gemm.mm(torch.empty(rows, 0), packed, n, None), torch.zeros(rows, n))
