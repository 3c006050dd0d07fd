"""The direct batched forward of Llama-family targets is bitwise the model's own batched forward
(fp32 with the packed kernel and tree attention, and float64), its fused projections are the
separate ones over shared weights, and other architectures keep the model's forward."""

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
    if attention == "sdpa":
        target.tree_attention = None
    direct = two_steps(target)
    target.direct = None  # the model's modules, through its attention interface
    own = two_steps(target)
    assert len(direct) == len(own) == 5
    for a, b in zip(direct, own):
        assert torch.equal(a, b)


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
