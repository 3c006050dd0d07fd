"""The torch target backend: prefill, one forward over a whole token tree, KV compaction.

The KV cache holds every committed token except the pending one (the tree's root). A
step feeds ``[root] + tree`` with position ids ``L + depth`` and a mask that lets each
node see the whole cache and exactly its ancestors, so the logits at every node equal
what sequential decoding of that node's path would give. After acceptance only the
accepted path's entries are kept, moved to contiguous positions: the cache then equals a
fresh prefill of the same tokens.

The cache is a plain ``DynamicCache`` with full-length layers, even for models with
sliding-window layers (Gemma 3): the window is enforced by the masks we build, which keeps
compaction a simple index operation on every layer alike.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from transformers import DynamicCache

from draftmesh import compute, cost_cache, tree_attention
from draftmesh.batch_kv import RowInput, SlotKVCache, use_batched_attention
from draftmesh.compute import on_compute_thread
from draftmesh.direct_decoder import DirectDecoder
from draftmesh.models import load_model
from draftmesh.packed_linear import use_packed_linears
from draftmesh.tree import TokenTree

log = logging.getLogger(__name__)

COST_CURVE_SIZES = (1, 2, 4, 8, 16, 32, 64)
BATCH_COST_ROWS = (2, 4, 8, 16)
BATCH_COST_TOKENS_PER_ROW = (1, 2, 4, 8)
COST_CONTEXT = 128
"""Cached tokens per row at which the cost curve and the batch table are measured."""
KEY_COST_CONTEXT = 1024
"""The longer cache at which ``measure_key_cost`` times the same forward again."""
CHEAP_COST_TOKENS = 16
"""Forwards of at most this many tokens are timed twice a round when the tables are measured."""


def _twice_if_cheap(shapes: Sequence, tokens: Callable[[Any], int]) -> list:
    """A measuring round's order: every shape, then the cheap ones again (``CHEAP_COST_TOKENS``).

    The budget reads the small shapes most (a tree adds a few tokens to a step) and divides every
    point by the one-token unit, while a few rounds on a shared 2-core box put single points 10-15%
    off; a second sample of the cheap ones, at another place in the round, cost ~1.5 s more at load
    for both tables (2-core AMD box, three warm-ups each way)."""
    return list(shapes) + [s for s in shapes if tokens(s) <= CHEAP_COST_TOKENS]


_MEASUREMENT = {"sizes": COST_CURVE_SIZES, "rows": BATCH_COST_ROWS, "per_row": BATCH_COST_TOKENS_PER_ROW,
                "context": COST_CONTEXT, "key_context": KEY_COST_CONTEXT, "cheap_twice": CHEAP_COST_TOKENS}
"""What ``ensure_costs`` times, part of a cached entry's fingerprint."""


@dataclass(frozen=True)
class KeyCost:
    """What a forward's tokens cost per cached key of their row beyond ``COST_CONTEXT``, in
    batch-1 one-token steps: the row's first token (it brings the row's keys in) and each further
    token of the same row (a tree node: the keys are in cache by then)."""

    row: float
    token: float


class ForwardInterrupted(Exception):
    """A batched forward stopped between two decoder layers because its ``interrupt`` asked.

    Nothing of it is kept: the rows' lengths are as before the call, and what the finished
    layers wrote lies beyond them in the slab (the next forward overwrites it)."""

    def __init__(self, layer: int) -> None:
        super().__init__(f"forward interrupted before decoder layer {layer}")
        self.layer = layer


def head_share(model) -> float:
    """The output head's multiply-adds over all of a token's (every weight matrix is multiplied
    once per token, the input embeddings only looked up): the part of a token's compute that
    positions without logits skip. SmolLM2-135M: 28.3M of 134.5M, 0.21; measured on a 2-core box,
    a forward's token cost 0.34 ms less without its logits, of ~1.75 ms (0.19)."""
    head = model.get_output_embeddings().weight
    inputs = model.get_input_embeddings().weight
    total = sum(p.numel() for p in model.parameters() if p.dim() >= 2 and p is not inputs)
    if head is inputs:  # tied: the one matrix is the head's work, and parameters() yields it once
        total += head.numel()
    return head.numel() / total if total else 0.0


@dataclass
class KVState:
    """One request's cache and how many tokens it holds."""

    cache: DynamicCache = field(default_factory=DynamicCache)
    length: int = 0

    def crop(self, n: int) -> None:
        """Keep the first ``n`` entries: the cache of a prefix is a prefix of the cache."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot crop a cache of {self.length} tokens to {n}")
        for layer in self.cache.layers:
            if getattr(layer, "keys", None) is not None:
                layer.keys = layer.keys[..., :n, :]
                layer.values = layer.values[..., :n, :]
        self.length = n


class TorchTarget:
    """A Hugging Face causal LM used as the target model."""

    def __init__(self, model, tokenizer, *, name: str = "model") -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.config = cfg
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_context = int(getattr(cfg, "max_position_embeddings", 2048))
        self.sliding_window = getattr(cfg, "sliding_window", None)
        layer_types = getattr(cfg, "layer_types", None) or []
        self._mask_by_layer_type = "sliding_attention" in layer_types
        self.eos_token_ids = self._eos_ids()
        self.cost_curve: dict[int, float] = {}
        self.batch_cost: dict[int, dict[int, float]] = {}
        """Rows -> {total tokens: cost relative to a one-token batch-1 step}; rows 1 is ``cost_curve``."""
        self.step_seconds: float | None = None
        self.batch_step_seconds: float | None = None
        """The batch-1 one-token step of the last ``measure_batch_cost`` (its tables' unit)."""
        self.key_cost: KeyCost | None = None
        """What a forward's tokens cost per cached key of their row beyond ``COST_CONTEXT``
        (``measure_key_cost``); None: not measured yet."""
        self.cost_cache: str | None = None
        """A directory where ``ensure_costs`` reads and keeps its measurements (``engine.cost_cache``;
        ``draftmesh.cost_cache``); None: measured in every process."""
        self.costs_from_cache = False
        """Whether ``ensure_costs`` read its costs from ``cost_cache`` rather than timing them."""
        self.head_share = head_share(model)
        """The output head's part of a token's weight work: what a prefill chunk's tokens, which
        never reach the head, save against the tables' tokens (every one of which has logits)."""
        use_batched_attention(model)  # (before packing: packing drops the linears' unpacked weights)
        self.packed_linears = use_packed_linears(model)
        """How many linears run the packed kernel (0: F.linear everywhere; see ``draftmesh.packed_linear``)."""
        self.tree_attention = tree_attention.kernel()
        """Attends the decode and tree rows of a batched step (``draftmesh.tree_attention``); None: SDPA."""
        self.direct = DirectDecoder.for_model(model)
        """The batched forward straight over the weights (``draftmesh.direct_decoder``); None: the model's own."""
        self._interrupt: tuple[int, object] | None = None
        """While a ``forward_batch`` with ``interrupt=`` runs: (its thread, the callable asked before each layer)."""
        for i, layer in enumerate(getattr(model.get_decoder(), "layers", ())):
            layer.register_forward_pre_hook(self._layer_hook(i))

    def _layer_hook(self, index: int):
        def before_layer(module, args):
            self._check_interrupt(index)
        return before_layer

    def _check_interrupt(self, index: int) -> None:
        ask = self._interrupt
        if ask is not None and index > 0 and ask[0] == threading.get_ident() and ask[1]():
            raise ForwardInterrupted(index)

    @classmethod
    @on_compute_thread
    def load(cls, spec: str, *, device: str = "cpu", dtype: torch.dtype | None = None,
             cost_cache: str | None = None) -> "TorchTarget":
        """Loaded on the compute thread, like every forward (see ``draftmesh.compute``)."""
        model, tokenizer = load_model(spec, device=device, dtype=dtype)
        target = cls(model, tokenizer, name=spec)
        target.cost_cache = cost_cache or None
        return target

    def _eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        gen = getattr(self.model, "generation_config", None)
        for value in (getattr(gen, "eos_token_id", None), getattr(self.tokenizer, "eos_token_id", None)):
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(int(v) for v in value)
        return frozenset(ids)

    # ------------------------------------------------------------------ forward passes
    @on_compute_thread
    @torch.inference_mode()
    def prefill(self, state: KVState, token_ids: Sequence[int]) -> None:
        """Append ``token_ids`` to the cache (the model's own causal masks)."""
        if not token_ids:
            return
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)
        pos = torch.arange(state.length, state.length + ids.shape[1], device=self.device).unsqueeze(0)
        self.model(input_ids=ids, position_ids=pos, cache=state.cache, use_cache=True, logits_to_keep=1)
        state.length += ids.shape[1]

    @on_compute_thread
    @torch.inference_mode()
    def step(self, state: KVState, root: int) -> torch.Tensor:
        """Plain decoding: one token, the model's own mask. Returns logits (1, V) in fp32."""
        ids = torch.tensor([[root]], dtype=torch.long, device=self.device)
        pos = torch.tensor([[state.length]], device=self.device)
        out = self.model(input_ids=ids, position_ids=pos, cache=state.cache, use_cache=True)
        state.length += 1
        return out.logits[0].float()

    @on_compute_thread
    @torch.inference_mode()
    def forward_tree(self, state: KVState, root: int, tree: TokenTree) -> torch.Tensor:
        """Logits (1 + N, V) at the root and every node; appends 1 + N entries to the cache."""
        if len(tree) == 0:
            return self.step(state, root)
        length = state.length
        ids = torch.tensor([[root, *tree.tokens]], dtype=torch.long, device=self.device)
        depths = torch.tensor([0, *tree.depths], device=self.device)
        pos = (length + depths).unsqueeze(0)
        mask = self.tree_mask(length, tree)
        out = self.model(input_ids=ids, position_ids=pos, attention_mask=mask, cache=state.cache, use_cache=True)
        state.length += ids.shape[1]
        return out.logits[0].float()

    def tree_mask(self, length: int, tree: TokenTree):
        """Additive 4D mask (1, 1, 1 + N, L + 1 + N); a dict per layer type for hybrid models."""
        n = len(tree) + 1
        visible = torch.zeros((n, length + n), dtype=torch.bool, device=self.device)
        visible[:, : length + 1] = True  # the whole cache and the root
        visible[1:, length + 1 :] = tree.ancestor_matrix().to(self.device)
        masks = {"full_attention": self._additive(visible)}
        if self.sliding_window:
            q_pos = length + torch.tensor([0, *tree.depths], device=self.device)
            k_pos = torch.cat([torch.arange(length + 1, device=self.device), q_pos[1:]])
            in_window = (q_pos[:, None] - k_pos[None, :]) < self.sliding_window
            masks["sliding_attention"] = self._additive(visible & in_window)
            if not self._mask_by_layer_type:  # every layer slides (Mistral-style)
                return masks["sliding_attention"]
        return masks if self._mask_by_layer_type else masks["full_attention"]

    def _additive(self, visible: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device)
        mask.masked_fill_(~visible, torch.finfo(self.dtype).min)
        return mask[None, None]

    # ------------------------------------------------------------------ batched steps
    def new_batch_cache(self, max_bytes: int) -> SlotKVCache:
        return SlotKVCache.for_model(self.model, max_bytes=max_bytes)

    @on_compute_thread
    @torch.inference_mode()
    def forward_batch(self, kv: SlotKVCache, inputs: Sequence[RowInput], interrupt=None) -> list[torch.Tensor]:
        """One forward over every row's new tokens; logits (fp32) per row for its tokens from
        ``logits_from`` on (an empty tensor for a pure prefill chunk). Every token is appended to
        its row; ``kv.commit`` then keeps the accepted ones.

        ``lm_head`` runs only where logits are needed: a prefill chunk's positions never reach it.
        ``interrupt``, a callable, is asked before each decoder layer after the first; when it
        answers true the forward stops there with ``ForwardInterrupted`` and appends nothing (the
        scheduler's way not to make a newcomer wait for a whole prefill chunk).
        """
        view = kv.view(inputs, self.sliding_window or None, self.tree_attention)
        self._interrupt = (threading.get_ident(), interrupt) if interrupt is not None else None
        try:
            if self.direct is not None:
                hidden = self.direct(view, self._check_interrupt)
            else:
                dummy = torch.zeros((1, 1, 1, 1), dtype=torch.bool, device=self.device)  # masks are the view's
                mask = {"full_attention": dummy, "sliding_attention": dummy} if self._mask_by_layer_type else dummy
                hidden = self.model.get_decoder()(
                    input_ids=view.input_ids, position_ids=view.position_ids, attention_mask=mask, cache=view,
                    use_cache=True,
                ).last_hidden_state[0]
        finally:
            self._interrupt = None
        view.advance()
        logits = self.model.get_output_embeddings()(hidden.index_select(0, view.logit_index))
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        logits = logits.float()
        out, start = [], 0
        for inp in inputs:
            n = len(inp.tokens) - inp.logits_from
            out.append(logits[start : start + n])
            start += n
        return out

    @on_compute_thread
    def top2_gap(self, token_ids: Sequence[int]) -> float:
        """Top-1 minus top-2 logit after ``token_ids`` under plain decoding.

        Where this is tiny, fp32 noise between a one-token step and a tree forward can
        flip the argmax: the yardstick for reporting a greedy divergence.
        """
        state = KVState()
        self.prefill(state, token_ids[:-1])
        top = torch.topk(self.step(state, token_ids[-1])[0], 2).values
        return float(top[0] - top[1])

    # ------------------------------------------------------------------ cache upkeep
    def commit(self, state: KVState, base: int, keep: Sequence[int]) -> None:
        """Keep cache[:base] plus the entries at ``base + keep`` (forward offsets), contiguously."""
        keep = list(keep)
        new_len = base + len(keep)
        if keep == list(range(len(keep))):
            state.crop(new_len)
            return
        src = torch.tensor([base + k for k in keep], device=self.device)
        for layer in state.cache.layers:
            layer.keys = torch.cat([layer.keys[..., :base, :], layer.keys.index_select(-2, src)], dim=-2)
            layer.values = torch.cat([layer.values[..., :base, :], layer.values.index_select(-2, src)], dim=-2)
        state.length = new_len

    # ------------------------------------------------------------------ cost curve
    def ensure_costs(self) -> None:
        """What the budget weighs, each measured once per target: the batch-1 cost curve, the
        batched table, and what a row's longer cache adds to them. With ``cost_cache`` set, read
        from there when this machine measured them for the same weights, threads and code, and
        written there after measuring."""
        if self.cost_curve and self.batch_cost and self.key_cost is not None:
            return
        if not self.cost_cache:
            self._measure_costs()
            return
        key = cost_cache.fingerprint(self.model, threads=compute.get_threads(), measurement=_MEASUREMENT)
        with cost_cache.measuring(self.cost_cache):  # one process measures at a time; the next reads it
            stored = cost_cache.load(self.cost_cache, key)
            if stored is not None:
                self.cost_curve, self.batch_cost = stored.cost_curve, stored.batch_cost
                self.key_cost = KeyCost(*stored.key_cost)
                # The tables are ratios; their unit is timed now (~1 s): the budget turns measured
                # seconds into it, and the process that wrote the entry may have run under other load.
                self.measure_units()
                self.costs_from_cache = True
                return
            self._measure_costs()
            try:
                cost_cache.store(self.cost_cache, key, cost_cache.MeasuredCosts(
                    cost_curve=self.cost_curve, step_seconds=self.step_seconds, batch_cost=self.batch_cost,
                    batch_step_seconds=self.batch_step_seconds, key_cost=(self.key_cost.row, self.key_cost.token)))
            except OSError as exc:  # a read-only or full disk costs the next start its ~18 s, nothing more
                log.warning("could not keep the measured forward costs in %s: %s", self.cost_cache, exc)

    def _measure_costs(self) -> None:
        if not self.cost_curve:
            self.measure_cost_curve()
        if not self.batch_cost:
            self.measure_batch_cost()
        if self.key_cost is None:
            self.measure_key_cost()

    @on_compute_thread
    @torch.inference_mode()
    def measure_units(self, context: int = COST_CONTEXT, repeats: int = 7) -> tuple[float, float]:
        """The two tables' units alone: a batch-1 one-token step (``step_seconds``, the cost curve's)
        and the same step through the batched forward (``batch_step_seconds``), interleaved, medians."""
        gen = torch.Generator().manual_seed(1)
        prompt = torch.randint(0, self.vocab_size, (context + 1,), generator=gen).tolist()
        state = KVState()
        self.prefill(state, prompt[: context - 1])
        kv = self.new_batch_cache(max_bytes=1 << 40)
        kv.ensure(1, context + 2)
        kv.add_row()
        self.forward_batch(kv, [RowInput.chain(0, prompt[:context])])
        single, batched = [], []
        for rep in range(repeats + 1):  # the first round warms up
            t0 = time.perf_counter()
            self.step(state, prompt[context - 1])
            t1 = time.perf_counter()
            self.forward_batch(kv, [RowInput.chain(0, prompt[context : context + 1], logits_from=0)])
            t2 = time.perf_counter()
            self.commit(state, context - 1, [])
            kv.commit(0, context, [])
            if rep:
                single.append(t1 - t0)
                batched.append(t2 - t1)
        self.step_seconds, self.batch_step_seconds = statistics.median(single), statistics.median(batched)
        return self.step_seconds, self.batch_step_seconds

    @on_compute_thread
    @torch.inference_mode()
    def measure_cost_curve(
        self, sizes: Sequence[int] = COST_CURVE_SIZES, context: int = COST_CONTEXT, repeats: int = 5
    ) -> dict[int, float]:
        """Time of one forward over k positions (root + k-1 chain nodes) relative to k = 1.

        Interleaved over sizes and reduced by the median so that noise from other
        processes hits every size alike. Stored on the target for tree builders.
        """
        gen = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, self.vocab_size, (context,), generator=gen).tolist()
        base = KVState()
        self.prefill(base, prompt[:-1])
        timings: dict[int, list[float]] = {k: [] for k in sizes}
        for rep in range(repeats + 1):  # the first round warms up
            for k in _twice_if_cheap(sizes, lambda k: k):
                tree = TokenTree()
                node = -1
                for tok in prompt[: k - 1]:
                    node = tree.add(node, tok, "cost")
                t0 = time.perf_counter()
                self.forward_tree(base, prompt[-1], tree)
                elapsed = time.perf_counter() - t0
                self.commit(base, context - 1, [])
                if rep:
                    timings[k].append(elapsed)
        medians = {k: statistics.median(v) for k, v in timings.items()}
        unit = medians[min(sizes)]
        self.cost_curve = {k: medians[k] / unit for k in sizes}
        self.step_seconds = unit
        return self.cost_curve

    @on_compute_thread
    @torch.inference_mode()
    def measure_batch_cost(
        self, rows: Sequence[int] = BATCH_COST_ROWS, per_row: Sequence[int] = BATCH_COST_TOKENS_PER_ROW,
        context: int = COST_CONTEXT, repeats: int = 3,
    ) -> dict[int, dict[int, float]]:
        """Time of one batched forward over ``r`` rows of ``k`` tokens each (a root and a chain),
        relative to a batch-1 one-token step timed in the same rounds (interleaved, medians).
        Stored as ``batch_cost[r][r * k]``; the scheduler's budget reads it."""
        gen = torch.Generator().manual_seed(1)
        prompt = torch.randint(0, self.vocab_size, (context + max(per_row),), generator=gen).tolist()
        top = max(rows)
        kv = self.new_batch_cache(max_bytes=1 << 40)
        kv.ensure(top, context + max(per_row) + 1)
        for _ in range(top):
            kv.add_row()
        for r in range(top):  # fill every row's cache once
            self.forward_batch(kv, [RowInput.chain(r, prompt[:context])])
        shapes = [(1, 1)] + [(r, k) for r in rows for k in per_row]
        timings: dict[tuple[int, int], list[float]] = {s: [] for s in shapes}
        for rep in range(repeats + 1):
            for r, k in _twice_if_cheap(shapes, lambda shape: shape[0] * shape[1]):
                inputs = [RowInput.chain(i, prompt[context : context + k], logits_from=0) for i in range(r)]
                t0 = time.perf_counter()
                self.forward_batch(kv, inputs)
                elapsed = time.perf_counter() - t0
                for i in range(r):
                    kv.commit(i, context, [])
                if rep:
                    timings[(r, k)].append(elapsed)
        unit = statistics.median(timings[(1, 1)])
        self.batch_step_seconds = unit
        table: dict[int, dict[int, float]] = {}
        for r, k in shapes[1:]:
            table.setdefault(r, {})[r * k] = statistics.median(timings[(r, k)]) / unit
        self.batch_cost = table
        return table

    @on_compute_thread
    @torch.inference_mode()
    def measure_key_cost(self, long_context: int = KEY_COST_CONTEXT, tokens: int = 16, repeats: int = 9) -> KeyCost:
        """What a forward's tokens cost per cached key of their row beyond ``COST_CONTEXT``, in
        batch-1 one-token steps at ``COST_CONTEXT`` (stored as ``key_cost``; zeros where the
        model's context is too short to tell).

        The tables above are measured at ``COST_CONTEXT`` cached tokens a row, but attention reads
        every cached key of its row for every token: measured on a 2-core box (SmolLM2-135M fp32),
        a tree token cost ~1.3, 2.0 and 3.3 ms at 150, 600 and 1200 cached tokens. A row's first
        token and its further ones differ: the first brings the row's keys in from memory, the
        others find them in cache (one row's 16 tokens at 1000 keys: the first 1.1e-4 units a key,
        each further one 3.5e-5). So one row is timed with 1 and with ``tokens`` tokens over its
        cache cut to ``COST_CONTEXT`` and to ``long_context`` keys (interleaved, medians), and the
        two slopes are kept: the budget prices a row's root by the first and each tree node by the
        second."""
        context = COST_CONTEXT
        long_context = min(long_context, self.max_context - tokens - 1)
        if long_context < 2 * context:
            self.key_cost = KeyCost(0.0, 0.0)
            return self.key_cost
        gen = torch.Generator().manual_seed(2)
        prompt = torch.randint(0, self.vocab_size, (long_context + tokens,), generator=gen).tolist()
        kv = self.new_batch_cache(max_bytes=1 << 40)
        kv.ensure(1, long_context + tokens + 1)
        kv.add_row()
        for start in range(0, long_context, 256):  # in chunks, as the scheduler prefills
            self.forward_batch(kv, [RowInput.chain(0, prompt[start : min(start + 256, long_context)])])
        shapes = [(cached, k) for cached in (context, long_context) for k in (1, tokens)]
        timings: dict[tuple[int, int], list[float]] = {shape: [] for shape in shapes}
        for rep in range(repeats + 1):
            for cached, k in shapes:
                kv.commit(0, cached, [])
                row = RowInput.chain(0, prompt[long_context : long_context + k], logits_from=0)
                t0 = time.perf_counter()
                self.forward_batch(kv, [row])
                elapsed = time.perf_counter() - t0
                if rep:
                    timings[(cached, k)].append(elapsed)
        med = {shape: statistics.median(v) for shape, v in timings.items()}
        unit, keys = med[(context, 1)], long_context - context
        first = (med[(long_context, 1)] - med[(context, 1)]) / unit / keys
        further = ((med[(long_context, tokens)] - med[(long_context, 1)]) - (med[(context, tokens)] - unit)) / unit
        self.key_cost = KeyCost(row=max(0.0, first), token=max(0.0, further / ((tokens - 1) * keys)))
        return self.key_cost
