"""The direct batched forward of Llama-family targets: with torch ops between the products it is
bitwise the model's own batched forward (fp32 with the packed kernel and tree attention, and
float64); with the native ops it equals it to fp32 rounding and a row's logits are bitwise the same
alone or beside any other rows; its fused projections are the separate ones over shared weights;
other architectures keep the model's forward."""

from __future__ import annotations

import pytest
import torch

from draftmesh.backend import TorchTarget
from draftmesh.batch_kv import RowInput
from tests.tiny_models import tiny_target

# q (96) and k / v (48) and gate / up (192) are whole packed blocks on both builds (48 and 16
# columns): the fused products apply; head_dim 16 suits the tree attention kernel on both.
FUSABLE = dict(hidden_size=96, intermediate_size=192, num_attention_heads=6, num_key_value_heads=3)


def two_steps(target: TorchTarget) -> list[torch.Tensor]:
    """A prompt chunk, a fresh short prompt, then a tree, a root and a long chunk in one step."""
    fwd = TorchTarget.forward_batch.__wrapped__
    kv = target.new_batch_cache(max_bytes=1 << 30)
    kv.ensure(3, 192)
    for _ in range(3):
        kv.add_row()
    v = target.vocab_size
    out = fwd(target, kv, [RowInput.chain(0, [(7 * i) % v for i in range(60)], logits_from=55),
                           RowInput.chain(1, [5, 6, 7])])
    out += fwd(target, kv, [RowInput(0, [9, 10, 11, 12, 13], [-1, 0, 0, 1, -1]), RowInput.chain(1, [8], logits_from=0),
                            RowInput.chain(2, [(3 * i) % v for i in range(70)], logits_from=0)])
    return out


@pytest.mark.parametrize("dtype,attention", [(torch.float32, "tree"), (torch.float32, "sdpa"), (torch.float64, "sdpa")])
def test_the_direct_forward_is_bitwise_the_models_own(dtype, attention):
    target = tiny_target("llama", dtype=dtype, **FUSABLE)
    assert target.direct is not None
    target.direct.ops = None  # torch ops between the products
    if attention == "sdpa":
        target.tree_attention = None
    direct = two_steps(target)
    target.direct = None  # the model's modules, through its attention interface
    own = two_steps(target)
    assert len(direct) == len(own) == 5
    for a, b in zip(direct, own):
        assert torch.equal(a, b)


@pytest.fixture
def native_target() -> TorchTarget:
    target = tiny_target("llama", dtype=torch.float32, **FUSABLE)
    if not target.packed_linears:
        pytest.skip("no native library on this CPU")
    assert target.direct.ops is not None and target.tree_attention is not None
    return target


def test_the_native_ops_give_the_models_forward_to_fp32_rounding(native_target):
    native = two_steps(native_target)
    native_target.direct = None
    own = two_steps(native_target)
    for a, b in zip(native, own):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_a_rows_logits_are_bitwise_the_same_alone_or_beside_any_rows(native_target):
    """Greedy output cannot depend on what else is in the batch, not even by fp32 rounding."""
    fwd = TorchTarget.forward_batch.__wrapped__
    v = native_target.vocab_size
    prompt = [(5 * i + 1) % v for i in range(30)]
    tree = RowInput(0, [4, 9, 2, 7, 3], [-1, 0, 0, 1, 2], logits_from=0)

    def row_logits(others: int, threads: int) -> list[torch.Tensor]:
        kv = native_target.new_batch_cache(max_bytes=1 << 30)
        kv.ensure(1 + others, 96)
        for _ in range(1 + others):
            kv.add_row()
        got = []
        saved = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:  # the row's prompt (short chunks: tree attention), then its tree, each beside the others' tokens
            for chunk in (prompt[:16], prompt[16:]):
                extra = [RowInput.chain(r, [(r * 11 + j) % v for j in range(r + 1)], logits_from=0) for r in range(1, 1 + others)]
                got.append(fwd(native_target, kv, [RowInput.chain(0, chunk, logits_from=len(chunk) - 1), *extra])[0])
            extra = [RowInput(r, [3, 5, 6], [-1, 0, 0], logits_from=0) for r in range(1, 1 + others)]
            got.append(fwd(native_target, kv, [tree, *extra])[0])
        finally:
            torch.set_num_threads(saved)
        return got

    alone = row_logits(0, 1)
    for others, threads in ((3, 1), (7, 2), (0, 2)):
        for a, b in zip(alone, row_logits(others, threads)):
            assert torch.equal(a, b), (others, threads)


def test_fused_projections_share_the_modules_weights():
    target = tiny_target("llama", dtype=torch.float32, **FUSABLE)
    if not target.packed_linears:
        pytest.skip("no packed kernel on this CPU")
    attn = target.model.get_decoder().layers[0].self_attn
    qkv = target.direct.qkv[0]
    assert qkv.gemm is not None and target.direct.gate_up[0].gemm is not None
    start = qkv.packed.data_ptr()
    end = start + qkv.packed.numel() * qkv.packed.element_size()
    for m in (attn.q_proj, attn.k_proj, attn.v_proj):  # views into the fused weights: no second copy
        assert start <= m.packed_weight.data_ptr() < end
    x = torch.randn(5, FUSABLE["hidden_size"])
    for fused, module in zip(qkv(x), (attn.q_proj, attn.k_proj, attn.v_proj)):
        assert torch.equal(fused, module(x))


def test_other_architectures_keep_the_models_forward():
    assert tiny_target("llama").direct is not None
    assert tiny_target("gemma3").direct is None
    assert tiny_target("llama", hidden_act="gelu").direct is None
