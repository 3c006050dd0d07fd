"""The batched KV cache of a verifier replica, and one forward over every active request.

Layout: one preallocated slab per layer, ``[rows, kv_heads, capacity, head_dim]``; each
active request owns a row, rows ``0..n-1`` are in use and stay contiguous (a request that
leaves hands its row to the last one), and each row has its own length. A step feeds the
model a *ragged* batch: every row's new tokens (a prefill chunk, the pending root, the
draft tree, or any chain-then-tree mix) concatenated into one sequence of T tokens, so the
projections and MLP run over exactly T tokens, with no padding between rows.

Attention is the only part that needs the rows apart. ``BatchView`` is passed to the model
as its ``cache`` (or to ``draftmesh.direct_decoder``): its ``update`` writes each new
key/value into its row at the row's next slot and returns a marker instead of tensors;
``attend`` (reached through ``batched_attention``, registered as the model's attention
implementation, falling back to SDPA for any other cache) then attends on views of the slab,
no copy of the cache. Rows with a few tokens (roots, trees) go to the tree attention kernel
(``draftmesh.tree_attention``: each token reads its own row's cache and ancestors) where it
applies, else to one SDPA *group* (queries padded to the group's widest row); each long
prefill chunk gets an SDPA group of its own (so a 2k-token prompt never pads the others'
queries). The mask of a row lets each of its tokens see the row's committed cache and its
own ancestors among the row's new tokens, nothing of another row: padded queries see only
key 0 of their row, and unused slab memory is zeros, so no NaN or value crosses rows.

Why not transformers' paged cache (``generation/continuous_batching``): it packs requests
into one ragged row too, but gathers every request's pages into one key sequence per layer
and masks the whole batch's keys for each query; tree verification needs per-node ancestor
masks, which its paged SDPA path does not build, and on CPU the gather copies the batch's
whole KV per layer per step. Slots with per-row lengths keep attention on views.

After acceptance a row keeps its committed prefix plus the accepted path, moved to
contiguous slots (``commit``): the row then equals a fresh prefill of the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from draftmesh.tree_attention import AttentionPlan, TreeAttention

ATTENTION_NAME = "draftmesh_batched"
LONG_ROW_TOKENS = 48
"""A row with more new tokens than this (a prefill chunk) gets its own attention group."""
CAPACITY_STEP = 64
"""Slab capacity grows in multiples of this many tokens per row."""


@dataclass
class RowInput:
    """One row's new tokens for a step: ``parents[i]`` is the index of token i's parent among
    these tokens, -1 for a token that follows the row's cache directly. Positions are the
    row's length plus the depth (0 for tokens whose parent is -1)."""

    row: int
    tokens: Sequence[int]
    parents: Sequence[int]
    logits_from: int = 0
    """Logits are returned for tokens ``[logits_from, len(tokens))`` (a pure prefill chunk: none)."""

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents) or not self.tokens:
            raise ValueError("a row input needs one parent per token and at least one token")

    @classmethod
    def chain(cls, row: int, tokens: Sequence[int], logits_from: int | None = None) -> "RowInput":
        n = len(tokens)
        return cls(row, list(tokens), list(range(-1, n - 1)), n if logits_from is None else logits_from)


def _depths(parents: Sequence[int]) -> list[int]:
    depths: list[int] = []
    for p in parents:
        depths.append(0 if p < 0 else depths[p] + 1)
    return depths


def _ancestors(parents: Sequence[int]) -> torch.Tensor:
    """(n, n) bool: [i, j] when j is i or an ancestor of i."""
    n = len(parents)
    if all(p == i - 1 for i, p in enumerate(parents)):
        return torch.ones((n, n), dtype=torch.bool).tril_()
    anc = torch.zeros((n, n), dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            anc[i] = anc[p]
        anc[i, i] = True
    return anc


class SlotKVCache:
    """Per-layer slabs of K/V for up to ``rows`` requests, bounded by ``max_bytes``."""

    def __init__(self, *, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"the KV budget must be > 0 bytes, got {max_bytes}")
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.max_bytes = max_bytes
        self.bytes_per_token = layers * 2 * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.row_capacity = 0
        self.token_capacity = 0
        self.lengths: list[int] = []

    @classmethod
    def for_model(cls, model, *, max_bytes: int) -> "SlotKVCache":
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        param = next(model.parameters())
        return cls(layers=cfg.num_hidden_layers, kv_heads=getattr(cfg, "num_key_value_heads", heads) or heads,
                   head_dim=head_dim, dtype=param.dtype, device=param.device, max_bytes=max_bytes)

    # ------------------------------------------------------------------ capacity
    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def allocated_bytes(self) -> int:
        return self.row_capacity * self.token_capacity * self.bytes_per_token

    @property
    def used_bytes(self) -> int:
        return sum(self.lengths) * self.bytes_per_token

    def bytes_for(self, rows: int, tokens: int) -> int:
        """The slab's size once it holds ``rows`` rows of ``tokens`` capacity each."""
        r = max(self.row_capacity, _pow2(rows))
        t = max(self.token_capacity, -(-tokens // CAPACITY_STEP) * CAPACITY_STEP)
        return r * t * self.bytes_per_token

    def fresh_bytes_for(self, rows: int, tokens: int) -> int:
        """What a slab of just ``rows`` rows of ``tokens`` would take (whatever is allocated now)."""
        return _pow2(rows) * (-(-tokens // CAPACITY_STEP) * CAPACITY_STEP) * self.bytes_per_token

    def ensure(self, rows: int, tokens: int) -> None:
        """Grow the slab to hold ``rows`` rows of ``tokens`` each (doubling rows, whole steps of
        tokens); MemoryError when that would exceed the budget (callers check ``bytes_for`` first)."""
        if rows <= self.row_capacity and tokens <= self.token_capacity:
            return
        need = self.bytes_for(rows, tokens)
        if need > self.max_bytes:
            raise MemoryError(f"a KV slab of {need} bytes exceeds the budget of {self.max_bytes}")
        r = max(self.row_capacity, _pow2(rows))
        t = max(self.token_capacity, -(-tokens // CAPACITY_STEP) * CAPACITY_STEP)
        shape = (r, self.kv_heads, t, self.head_dim)
        used_t = max(self.lengths, default=0)
        for store in (self.keys, self.values):
            for i in range(self.layers):
                new = torch.zeros(shape, dtype=self.dtype, device=self.device)
                if i < len(store):
                    new[: self.rows, :, :used_t] = store[i][: self.rows, :, :used_t]
                    store[i] = new
                else:
                    store.append(new)
        self.row_capacity, self.token_capacity = r, t

    def release(self) -> None:
        """Free the slab (no rows may be in use)."""
        if self.lengths:
            raise RuntimeError(f"cannot release a KV slab with {self.rows} rows in use")
        self.keys, self.values = [], []
        self.row_capacity = self.token_capacity = 0

    # ------------------------------------------------------------------ rows
    def add_row(self) -> int:
        if self.rows >= self.row_capacity:
            raise MemoryError("no free KV row: call ensure() first")
        self.lengths.append(0)
        return self.rows - 1

    def drop_row(self, row: int) -> int | None:
        """Free ``row``; the last row moves into it. Returns the moved row's old index, or None."""
        last = self.rows - 1
        if not 0 <= row <= last:
            raise IndexError(f"row {row} is not in use ({self.rows} rows)")
        moved = None
        if row != last:
            n = self.lengths[last]
            for store in (self.keys, self.values):
                for layer in store:
                    layer[row, :, :n] = layer[last, :, :n]
            self.lengths[row] = n
            moved = last
        self.lengths.pop()
        return moved

    def load_row(self, row: int, cache: DynamicCache, n: int) -> None:
        """Copy the first ``n`` entries of a cache (a pooled entry's shared prefix) into ``row``."""
        if n > self.token_capacity:
            raise MemoryError(f"row capacity {self.token_capacity} < {n} cached tokens")
        for i, layer in enumerate(cache.layers):
            self.keys[i][row, :, :n] = layer.keys[0, :, :n]
            self.values[i][row, :, :n] = layer.values[0, :, :n]
        self.lengths[row] = n

    def export_row(self, row: int) -> DynamicCache:
        """A copy of the row's committed KV as a cache of its own (for the prefix pool)."""
        n = self.lengths[row]
        cache = DynamicCache()
        for i in range(self.layers):
            cache.update(self.keys[i][row : row + 1, :, :n].clone(), self.values[i][row : row + 1, :, :n].clone(), i)
        return cache

    def commit(self, row: int, base: int, keep: Sequence[int]) -> None:
        """Keep the row's slots ``[0, base)`` plus ``base + keep`` (offsets), contiguously."""
        keep = list(keep)
        if keep != list(range(len(keep))):
            src = torch.tensor([base + k for k in keep], device=self.device)
            dst = slice(base, base + len(keep))
            for store in (self.keys, self.values):
                for layer in store:
                    layer[row, :, dst] = layer[row].index_select(1, src)
        self.lengths[row] = base + len(keep)

    # ------------------------------------------------------------------ a step
    def view(self, inputs: Sequence[RowInput], sliding_window: int | None = None,
             attention: TreeAttention | None = None) -> "BatchView":
        """The step's plan; ``attention`` (the tree attention kernel) attends the short rows where it applies."""
        return BatchView(self, inputs, sliding_window, attention)


@dataclass
class _Group:
    r0: int
    r1: int
    q_index: torch.Tensor  # (G, Q) flat token index of each query slot (padding: 0)
    mask: torch.Tensor  # (G, 1, Q, K) bool
    sliding_mask: torch.Tensor | None
    src: torch.Tensor  # indices into the group's G*Q outputs that are real
    dest: torch.Tensor  # their flat token index
    kmax: int


@dataclass
class _LayerRef:
    """What ``BatchView.update`` hands the attention function instead of key/value tensors."""

    view: "BatchView"
    layer: int


class BatchView:
    """One step's plan over a ``SlotKVCache``: where each new token goes, and the attention groups."""

    def __init__(self, kv: SlotKVCache, inputs: Sequence[RowInput], sliding_window: int | None,
                 attention: TreeAttention | None = None) -> None:
        self.kv = kv
        rows = [i.row for i in inputs]
        if len(set(rows)) != len(rows):
            raise ValueError(f"a row appears twice in one step: {rows}")
        tokens, positions, w_rows, w_pos, need = [], [], [], [], []
        self.offsets: list[int] = []
        self.depths: list[list[int]] = []
        for inp in inputs:
            length = kv.lengths[inp.row]
            if length + len(inp.tokens) > kv.token_capacity:
                raise MemoryError(f"row {inp.row}: {length} + {len(inp.tokens)} tokens exceed capacity {kv.token_capacity}")
            depths = _depths(inp.parents)
            self.offsets.append(len(tokens))
            self.depths.append(depths)
            need.extend(range(len(tokens) + inp.logits_from, len(tokens) + len(inp.tokens)))
            tokens.extend(int(t) for t in inp.tokens)
            positions.extend(length + d for d in depths)
            w_rows.extend([inp.row] * len(inp.tokens))
            w_pos.extend(range(length, length + len(inp.tokens)))
        dev = kv.device
        self.inputs = list(inputs)
        self.input_ids = torch.tensor([tokens], dtype=torch.long, device=dev)
        self.position_ids = torch.tensor([positions], dtype=torch.long, device=dev)
        self.write_rows = torch.tensor(w_rows, dtype=torch.long, device=dev)
        self.write_pos = torch.tensor(w_pos, dtype=torch.long, device=dev)
        self.logit_index = torch.tensor(need, dtype=torch.long, device=dev)
        self.native: AttentionPlan | None = None
        """The short rows' tokens when ``draftmesh.tree_attention`` attends them (else they form a group)."""
        self.groups = self._groups(sliding_window, attention)

    def _groups(self, window: int | None, native: TreeAttention | None) -> list[_Group]:
        kv = self.kv
        short = [(k, i) for k, i in enumerate(self.inputs) if len(i.tokens) <= LONG_ROW_TOKENS]
        long = [(k, i) for k, i in enumerate(self.inputs) if len(i.tokens) > LONG_ROW_TOKENS]
        groups = []
        if short and window is None and native is not None and native.supports(kv.dtype, kv.device, kv.head_dim):
            self.native = native.plan([(i.row, kv.lengths[i.row], self.offsets[k], i.parents) for k, i in short])
        elif short:
            groups.append(self._group(short, 0, kv.rows, window))
        for k, inp in long:
            groups.append(self._group([(k, inp)], inp.row, inp.row + 1, window))
        return groups

    def _group(self, members, r0: int, r1: int, window: int | None) -> _Group:
        kv = self.kv
        q = max(len(i.tokens) for _, i in members)
        kmax = max(kv.lengths[i.row] + len(i.tokens) for _, i in members)
        g = r1 - r0
        q_index = torch.zeros((g, q), dtype=torch.long)
        visible = torch.zeros((g, q, kmax), dtype=torch.bool)
        visible[:, :, 0] = True  # padding queries (and rows with no tokens this step) see key 0 only
        sliding = visible.clone() if window else None
        src, dest = [], []
        for k, inp in members:
            r, n, length = inp.row - r0, len(inp.tokens), kv.lengths[inp.row]
            off = self.offsets[k]
            q_index[r, :n] = torch.arange(off, off + n)
            vis = torch.zeros((n, kmax), dtype=torch.bool)
            vis[:, :length] = True
            vis[:, length : length + n] = _ancestors(inp.parents)
            visible[r, :n] = vis
            if window:
                depths = torch.tensor(self.depths[k])
                q_pos = length + depths
                k_pos = torch.arange(kmax)
                k_pos[length : length + n] = q_pos
                sliding[r, :n] = vis & ((q_pos[:, None] - k_pos[None, :]) < window)
            src.extend(range(r * q, r * q + n))
            dest.extend(range(off, off + n))
        dev = kv.device
        return _Group(r0, r1, q_index.to(dev), visible[:, None].to(dev),
                      None if sliding is None else sliding[:, None].to(dev),
                      torch.tensor(src, device=dev), torch.tensor(dest, device=dev), kmax)

    # The model calls this once per layer with the new tokens' keys and values (1, H, T, D).
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        kv = self.kv
        kv.keys[layer_idx][self.write_rows, :, self.write_pos] = key_states[0].transpose(0, 1)
        kv.values[layer_idx][self.write_rows, :, self.write_pos] = value_states[0].transpose(0, 1)
        ref = _LayerRef(self, layer_idx)
        return ref, ref

    def advance(self) -> None:
        """Count every row's new tokens as cached (``commit`` then keeps the accepted ones)."""
        for inp in self.inputs:
            self.kv.lengths[inp.row] += len(inp.tokens)


def attend(view: "BatchView", layer: int, q: torch.Tensor, scaling: float | None, sliding: bool) -> torch.Tensor:
    """Attention of the view's T new tokens, queries ``q`` (T, Hq, D), over the slab of ``layer``:
    SDPA per group of rows on views of the slab, each row's own mask. Returns (T, Hq, D)."""
    keys, values = view.kv.keys[layer], view.kv.values[layer]
    total, heads, dim = q.shape
    out = q.new_empty((total, heads, dim))
    if view.native is not None:
        view.native.run(q.contiguous(), out, keys, values, scaling)
    for g in view.groups:
        qg = q[g.q_index].transpose(1, 2)  # (G, Hq, Q, D)
        mask = g.sliding_mask if sliding and g.sliding_mask is not None else g.mask
        o = F.scaled_dot_product_attention(
            qg, keys[g.r0 : g.r1, :, : g.kmax], values[g.r0 : g.r1, :, : g.kmax],
            attn_mask=mask, scale=scaling, enable_gqa=heads != keys.shape[1],
        )
        out[g.dest] = o.transpose(1, 2).reshape(-1, heads, dim)[g.src]
    return out


def batched_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """``attend`` for the model's attention modules; plain SDPA for any other cache."""
    if not isinstance(key, _LayerRef):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if kwargs.get("softcap") is not None:
        raise ValueError("batched attention does not support attention logit soft-capping")
    sliding = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    return attend(key.view, key.layer, query[0].transpose(0, 1), scaling, bool(sliding)).unsqueeze(0), None


AttentionInterface.register(ATTENTION_NAME, batched_attention)
AttentionMaskInterface.register(ATTENTION_NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
# Outside a batched step (a DynamicCache) the model builds SDPA masks and runs SDPA, as before.


def use_batched_attention(model) -> None:
    """Make ``model`` run ``batched_attention`` (SDPA for every other cache)."""
    for cfg in {id(c): c for c in _configs(model.config)}.values():
        cfg._attn_implementation = ATTENTION_NAME


def _configs(cfg):
    yield cfg
    for name in ("text_config", "get_text_config"):
        sub = getattr(cfg, name, None)
        sub = sub() if callable(sub) else sub
        if sub is not None and sub is not cfg:
            yield sub


def _pow2(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p
