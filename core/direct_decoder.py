"""The batched forward of a Llama-family decoder, run directly over its weights.

A decode or verify step on the CPU is a few rows through 30 layers; once the linears read their
weights at memory speed (``draftmesh.packed_linear``), a good part of what is left is the price of
getting there: transformers' layer, attention, MLP and norm modules, their decorators, keyword
plumbing and attention-interface lookup, around some 45 small tensor ops per layer. This module
runs the same math as ``LlamaDecoderLayer`` with none of that, over a ``BatchView`` of the slab:

- q, k and v come from **one** product over their weights packed side by side, and so do the
  MLP's gate and up (the packed kernel computes every output as its own FMA chain, so the fused
  product is bitwise the three or two separate ones, and the separate modules keep working on
  views of the fused weights: no second copy);
- the rotary tables are computed once per forward for all layers, as the model does;
- attention is ``batch_kv.attend``, as on the model's path (the tree attention kernel for decode
  and tree rows, SDPA for prefill chunks);
- between the products, where the native library is built and the target is fp32 on the CPU,
  ``DecoderOps`` (``csrc/decoder_ops.cpp``) does each RMSNorm, the rotary embedding of q and k
  with both KV writes, and the SiLU gate in one call each: ~10 calls a layer instead of ~45 ops.

With torch ops between the products (``ops`` None: float64, no build) each op is the one
transformers runs, in the same order and dtype, so the forward is bitwise the model's own
batched forward; with the native ops it equals it to fp32 rounding, and a row's logits are
bitwise the same alone or beside any other rows (``tests/core/test_direct_decoder.py``). Where
its assumptions do not hold (another architecture, a sliding window, an activation other than
SiLU) ``for_model`` returns None and the target keeps the model's forward.
"""

from __future__ import annotations

import ctypes
from typing import Callable, Sequence

import torch
from torch import nn

from draftmesh import packed_linear
from draftmesh.batch_kv import BatchView, attend
from draftmesh.tree_attention import VECTOR_FLOATS


class FusedProjection:
    """Several linears over the same input as one packed product, split after."""

    def __init__(self, linears: Sequence[nn.Linear]) -> None:
        self.linears = list(linears)
        self.sizes = [m.out_features for m in self.linears]
        self.gemm = None
        gemm = getattr(self.linears[0], "_draftmesh_gemm", None)
        biases = [m.bias for m in self.linears]
        if (
            gemm is not None
            and all(getattr(m, "_draftmesh_gemm", None) is gemm for m in self.linears)
            and all(n % gemm.block == 0 for n in self.sizes[:-1])  # no padded block inside the fused one
            and (all(b is None for b in biases) or all(b is not None for b in biases))
        ):
            self.gemm = gemm
            parts = [m.packed_weight for m in self.linears]
            shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
            self.packed = torch.cat(parts, out=packed_linear.weight_buffer(shape))
            self.bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
            start = 0
            for m in self.linears:  # each module now multiplies by its part of the fused weights
                blocks = m.packed_weight.shape[0]
                m.packed_weight = self.packed[start : start + blocks]
                start += blocks
            self.out_features = sum(self.sizes)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.gemm is None:
            return tuple(m(x) for m in self.linears)
        return self.product(x).split(self.sizes, dim=-1)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """The fused product, unsplit: (..., sum of the out features)."""
        return self.gemm.mm(x, self.packed, self.out_features, self.bias)


class DecoderOps:
    """``csrc/decoder_ops.cpp``: RMSNorm, rotary plus the KV writes, and the SiLU gate, one call each."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        p, n, f, i = ctypes.c_void_p, ctypes.c_long, ctypes.c_float, ctypes.c_int
        self._rms = self._bind(lib.dm_rms_norm, [p, n, n, p, f, p, i])
        self._rope = self._bind(lib.dm_rope_store, [p, n, n, n, n, p, p, p, p, p, n, p, p, i])
        self._silu = self._bind(lib.dm_silu_mul, [p, n, n, p, i])

    @staticmethod
    def _bind(fn, argtypes):
        fn.restype, fn.argtypes = None, argtypes
        return fn

    def rms_norm(self, x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        out = torch.empty_like(x)
        self._rms(x.data_ptr(), x.shape[0], x.shape[1], norm.weight.data_ptr(), norm.variance_epsilon,
                  out.data_ptr(), torch.get_num_threads())
        return out

    def rope_store(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
                   keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Rotates q into a new (T, heads, D) tensor, and k (rotated) and v into their slab slots."""
        total, dim = qkv.shape[0], keys.shape[-1]
        q = torch.empty((total, heads, dim), dtype=qkv.dtype)
        self._rope(qkv.data_ptr(), total, heads, kv_heads, dim, cos.data_ptr(), sin.data_ptr(), q.data_ptr(),
                   keys.data_ptr(), values.data_ptr(), keys.shape[2], rows.data_ptr(), slots.data_ptr(),
                   torch.get_num_threads())
        return q

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        total, width = gate_up.shape
        out = torch.empty((total, width // 2), dtype=gate_up.dtype)
        self._silu(gate_up.data_ptr(), total, width // 2, out.data_ptr(), torch.get_num_threads())
        return out


def _rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``LlamaRMSNorm.forward``, op for op."""
    dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + norm.variance_epsilon)
    return norm.weight * h.to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_rotary_pos_emb`` for one tensor: ``x * cos + rotate_half(x) * sin``."""
    half = x.shape[-1] // 2
    return (x * cos) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)


class DirectDecoder:
    """A Llama-family decoder stack's batched forward, straight over its modules' weights."""

    def __init__(self, decoder: nn.Module, config) -> None:
        self.decoder = decoder
        self.layers = list(decoder.layers)
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.qkv = [FusedProjection([l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj]) for l in self.layers]
        self.gate_up = [FusedProjection([l.mlp.gate_proj, l.mlp.up_proj]) for l in self.layers]
        self.ops = self._native_ops(config)
        """The native steps between the products (None: the same steps as torch ops, bitwise the model's)."""

    def _native_ops(self, config) -> "DecoderOps | None":
        build = packed_linear.native_build()
        fused = all(p.gemm is not None for p in self.qkv + self.gate_up)  # fp32 on the CPU, packed
        if build is None or not fused or config.hidden_size % VECTOR_FLOATS[build[1]]:
            return None
        return DecoderOps(packed_linear.native_library(build[0]))

    @classmethod
    def for_model(cls, model: nn.Module) -> "DirectDecoder | None":
        """The direct forward for ``model``, or None where it would not be the model's own math."""
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm

        decoder = model.get_decoder()
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        layers = getattr(decoder, "layers", None)
        if not layers or any(type(layer) is not LlamaDecoderLayer for layer in layers):
            return None
        if type(decoder.norm) is not LlamaRMSNorm or len(layers) != config.num_hidden_layers:
            return None
        if getattr(config, "sliding_window", None) or getattr(config, "pretraining_tp", 1) not in (None, 1):
            return None
        if getattr(config, "hidden_act", None) != "silu" or getattr(config, "mlp_bias", False):
            return None
        return cls(decoder, config)

    @torch.inference_mode()
    def __call__(self, view: BatchView, before_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """The final-normed hidden states (T, hidden) of the view's T new tokens; their keys and
        values are written into the view's rows. ``before_layer(i)`` runs before each layer."""
        decoder, kv = self.decoder, view.kv
        h = decoder.embed_tokens(view.input_ids[0])
        total = h.shape[0]
        cos, sin = decoder.rotary_emb(h, view.position_ids)
        cos, sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)  # (T, 1, D): every head alike
        rows, slots = view.write_rows, view.write_pos
        if self.ops is not None:
            return self._native(view, h, cos[:, 0].contiguous(), sin[:, 0].contiguous(), before_layer)
        for i, layer in enumerate(self.layers):
            if before_layer is not None:
                before_layer(i)
            attn = layer.self_attn
            q, k, v = self.qkv[i](_rms_norm(layer.input_layernorm, h))
            q = _rotate(q.view(total, self.heads, self.head_dim), cos, sin)
            k = _rotate(k.view(total, self.kv_heads, self.head_dim), cos, sin)
            kv.keys[i][rows, :, slots] = k
            kv.values[i][rows, :, slots] = v.view(total, self.kv_heads, self.head_dim)
            o = attend(view, i, q, attn.scaling, sliding=False)
            h = h + attn.o_proj(o.reshape(total, -1))
            gate, up = self.gate_up[i](_rms_norm(layer.post_attention_layernorm, h))
            h = h + layer.mlp.down_proj(layer.mlp.act_fn(gate) * up)
        return decoder.norm(h)

    def _native(self, view: BatchView, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                before_layer: Callable[[int], None] | None) -> torch.Tensor:
        """The same layers with ``DecoderOps`` between the products: ~10 calls a layer instead of ~45."""
        ops, kv = self.ops, view.kv
        for i, layer in enumerate(self.layers):
            if before_layer is not None:
                before_layer(i)
            attn = layer.self_attn
            qkv = self.qkv[i].product(ops.rms_norm(h, layer.input_layernorm))
            q = ops.rope_store(qkv, cos, sin, self.heads, self.kv_heads, kv.keys[i], kv.values[i],
                               view.write_rows, view.write_pos)
            o = attend(view, i, q, attn.scaling, sliding=False)
            h = h + attn.o_proj(o.view(h.shape[0], -1))
            gate_up = self.gate_up[i].product(ops.rms_norm(h, layer.post_attention_layernorm))
            h = h + layer.mlp.down_proj(ops.silu_mul(gate_up))
        return ops.rms_norm(h, self.decoder.norm)
