"""The ``llm`` draft source: a small language model drafting for the target.

Two modes, chosen once from the tokenizers:

- **Same tokenizer** as the target: the draft grows a token tree by confidence, EAGLE-2
  style. Depth 1 is the top-k of the draft's next-token distribution after the committed
  ids; at each further depth the ``top_k`` most probable frontier nodes (by cumulative
  draft probability) are expanded together in ONE tree-masked forward, each into its
  top-k children. Finally the ``max_nodes`` nodes with the highest cumulative probability
  are kept (ancestor-closed: a child never scores above its parent, and ties go to the
  older node) and one ``Proposal`` per root-to-leaf path is returned, with
  ``token_probs`` = each token's draft probability given its parent and ``confidence`` =
  the path's cumulative probability. Top-k drafts are deterministic (no ``token_dists``),
  which is lossless under every verification rule.

  With ``sample=True`` (for requests that sample) the source instead draws one chain of
  ``max_depth`` tokens from the draft's distribution at the request's temperature (and
  top-k/top-p, from ``ctx.options``) and returns it with ``token_dists``: row i is the
  full distribution token i was sampled from, over the target vocabulary, which is what
  the verifier's residual rule needs to stay exact.

- **Another tokenizer**: the committed target ids are decoded to text, re-encoded with the
  draft tokenizer, and the draft greedily writes up to ``max_depth`` tokens; the decoded
  continuation is returned as ``Proposal(text=...)`` (confidence = product of the draft
  probabilities). The tree builder aligns text to target ids.

The draft model's KV cache is kept across the steps of a request (keyed by
``ctx.request_id``, an LRU bounded by count, ``max_requests``, and by the bytes of the
caches' tensors, ``max_bytes``; a request's cache is dropped when it ends: ``finish``, or
``forget`` from the decoder, which never waits for a running draft). Each step the cache is cropped to the longest common
prefix of the ids it holds and the new context, and only the remaining ids are prefilled.
Whatever the expansion appended is dropped before returning, so between calls the cache
holds exactly the context ids. The request key only decides which cache is tried: the
common-prefix check makes a wrong or shared key cost time, never correctness.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from draftmesh.backend import KVState, TorchTarget
from draftmesh.draft.base import DraftContext, Proposal, path_proposals
from draftmesh.io_struct import SamplingParams
from draftmesh.sampling import target_probs
from draftmesh.tree import TokenTree

REENCODE_TOKENS = 8
"""Text mode: draft-side ids re-encoded at the end of the cached context each step."""
OVERLAP_TOKENS = 4
"""...of which this many must come out unchanged for the cached ids before them to be kept."""


@dataclass
class _Entry:
    """One request's draft cache: ``ids`` are exactly the tokens whose KV ``state`` holds."""

    state: KVState = field(default_factory=KVState)
    ids: list[int] = field(default_factory=list)
    text: str = ""
    """Text mode: the context text ``ids`` encode (after the draft's leading specials)."""
    ends: list[int] = field(default_factory=list)
    """Text mode: character end of each id of ``ids`` in ``text`` (0 for leading specials)."""


@dataclass
class _Node:
    token: int
    parent: int
    depth: int
    prob: float
    """Draft probability of ``token`` given the parent's path."""
    cum: float
    """Product of ``prob`` over the path: the node's score."""


@dataclass
class LLMStats:
    """Counters for tests and benchmarks (cumulative over the source's life)."""

    calls: int = 0
    prefilled_tokens: int = 0
    """Context tokens fed to the draft model (what cache reuse saves)."""
    tree_forwards: int = 0
    """Forwards made for drafting (tree expansions or chain steps), not counting prefills."""
    full_encodes: int = 0
    """Text mode: contexts encoded whole with the draft tokenizer (the rest incrementally)."""
    seconds: float = 0.0
    deadline_hits: int = 0


class LLMSource:
    """A draft model as a draft source. See the module docstring for the two modes."""

    compute_bound = True
    """Its model runs on the compute thread, taking turns with the target's forwards (draft.base)."""

    def __init__(
        self,
        draft: TorchTarget,
        *,
        target_tokenizer: Any = None,
        max_nodes: int = 16,
        top_k: int = 4,
        max_depth: int = 6,
        name: str = "llm",
        same_tokenizer: bool | None = None,
        sample: bool = False,
        temperature: float = 1.0,
        max_seconds: float | None = None,
        max_requests: int = 8,
        max_bytes: int = 1 << 30,
        target_vocab_size: int | None = None,
        seed: int | None = None,
    ) -> None:
        """
        ``same_tokenizer``: None detects it (the two tokenizers' ``get_vocab()`` are equal;
        with no ``target_tokenizer`` the draft is assumed to share the target's).
        ``temperature``: used in sampled mode when ``ctx.options`` carries none.
        ``target_vocab_size``: width of the target's logits (and so of ``token_dists``);
        defaults to the draft's. Drafted ids never reach it.
        ``max_requests``: per-request caches kept (each holds the draft KV of a context).
        ``max_bytes``: their tensors' bytes together (the least recently used go first; the
        current request's cache is kept even when it alone is larger).
        """
        if max_nodes < 1 or top_k < 1 or max_depth < 1:
            raise ValueError("max_nodes, top_k and max_depth must be >= 1")
        if max_seconds is not None and max_seconds < 0:
            raise ValueError(f"max_seconds must be >= 0, got {max_seconds}")
        if max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {max_requests}")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.draft = draft
        self.name = name
        self.target_tokenizer = target_tokenizer
        self.max_nodes, self.top_k, self.max_depth = max_nodes, top_k, max_depth
        self.sample = sample
        self.temperature = float(temperature)
        self.max_seconds = max_seconds
        self.max_requests = max_requests
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._forgotten: set[str] = set()
        self._forgotten_lock = threading.Lock()
        if same_tokenizer is None:
            same_tokenizer = target_tokenizer is None or _same_vocab(draft.tokenizer, target_tokenizer)
        self.same_tokenizer = bool(same_tokenizer)
        self.vocab_limit = int(target_vocab_size or draft.vocab_size)
        self.stats = LLMStats()
        self.last_tree: TokenTree | None = None
        """Same-tokenizer mode: the tree of the last call (for tests and debugging)."""
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self._generator = torch.Generator()
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)
        self._eos = set(draft.eos_token_ids)
        if self.same_tokenizer and target_tokenizer is not None and target_tokenizer.eos_token_id is not None:
            self._eos.add(int(target_tokenizer.eos_token_id))
        cfg = draft.config
        self._window = getattr(cfg, "sliding_window", None)
        self._by_layer_type = "sliding_attention" in (getattr(cfg, "layer_types", None) or [])
        if not self.same_tokenizer:
            tok = draft.tokenizer
            self._lead = _leading_specials(tok)
            self._offsets = bool(getattr(tok, "is_fast", False))
            # a text draft never means a control token: generation stops at any of them
            self._text_stop = self._eos | {int(t) for t in getattr(tok, "all_special_ids", ())}

    # ------------------------------------------------------------------ public
    def propose(self, ctx: DraftContext) -> list[Proposal]:
        t0 = time.perf_counter()
        deadline = None if self.max_seconds is None else t0 + self.max_seconds
        if self._budget(ctx) <= 0:  # the builder can afford no node this step
            return []
        with self._lock:
            self._drop_forgotten()
            try:
                if self.same_tokenizer:
                    return self._propose_tokens(ctx, deadline)
                return self._propose_text(ctx, deadline)
            finally:
                self._bound_bytes(ctx.request_id)
                self.stats.calls += 1
                self.stats.seconds += time.perf_counter() - t0

    def finish(self, ctx: DraftContext, output_ids: Sequence[int], output_text: str) -> None:
        """Called by the decoder when a request ends: its cache is no longer useful."""
        self.release(ctx.request_id)

    def release(self, request_id: str) -> None:
        with self._lock:
            self._entries.pop(request_id, None)

    def forget(self, request_id: str) -> None:
        """The request ended (the decoder calls this from its batched step, so it never waits
        for a draft in progress): the cache is dropped now if the source is idle, else at the
        start of its next call."""
        with self._forgotten_lock:
            self._forgotten.add(request_id)
        if self._lock.acquire(blocking=False):
            try:
                self._drop_forgotten()
            finally:
                self._lock.release()

    def _drop_forgotten(self) -> None:
        with self._forgotten_lock:
            gone, self._forgotten = self._forgotten, set()
        for request_id in gone:
            self._entries.pop(request_id, None)

    def cache_bytes(self) -> int:
        """Bytes of the kept caches' tensors."""
        return sum(_kv_bytes(e.state) for e in list(self._entries.values()))

    def _bound_bytes(self, current: str) -> None:
        """Drop least recently used caches (never ``current``'s) while over ``max_bytes``."""
        sizes = {rid: _kv_bytes(e.state) for rid, e in self._entries.items()}
        total = sum(sizes.values())
        for rid in list(self._entries):
            if total <= self.max_bytes:
                break
            if rid != current:
                del self._entries[rid]
                total -= sizes[rid]

    @property
    def cached_requests(self) -> list[str]:
        return list(self._entries)

    def _budget(self, ctx: DraftContext) -> int:
        """Tree nodes worth drafting: ours, the builder's hint and the request's cap."""
        return min(self.max_nodes, ctx.size_hint, int(ctx.options.get("max_nodes", self.max_nodes)))

    # ------------------------------------------------------------------ same tokenizer
    def _propose_tokens(self, ctx: DraftContext, deadline: float | None) -> list[Proposal]:
        self.last_tree = None
        ids = [int(t) for t in ctx.token_ids]
        if not ids or len(ids) + self.max_depth > self.draft.max_context:
            return []
        entry = self._entry(ctx.request_id)
        root_logits = self._sync(entry, ids)
        n = entry.state.length
        try:
            temperature = float(ctx.options.get("temperature", self.temperature))
            if self.sample and temperature > 0:
                return self._sample_chain(entry, root_logits, ctx.options, temperature, deadline)
            return self._grow_tree(entry, root_logits, self._budget(ctx), deadline)
        finally:
            self.draft.commit(entry.state, n, [])  # drop the draft's own entries

    def _grow_tree(self, entry: _Entry, root_logits: torch.Tensor, budget: int, deadline) -> list[Proposal]:
        nodes: list[_Node] = []
        forwarded: list[int] = []  # node indices in cache order after the context
        k = min(self.top_k, self.vocab_limit)
        frontier = self._add_children(nodes, -1, 1.0, 0, root_logits, k)
        for depth in range(2, self.max_depth + 1):
            if deadline is not None and time.perf_counter() >= deadline:
                self.stats.deadline_hits += 1
                break
            # Children score at most their parent, so a node below the budget-th best
            # score so far cannot contribute a kept child.
            cums = sorted((nd.cum for nd in nodes), reverse=True)
            floor = cums[budget - 1] if len(cums) >= budget else -1.0
            grow = [i for i in frontier if nodes[i].token not in self._eos and nodes[i].cum > floor]
            grow = sorted(grow, key=lambda i: (-nodes[i].cum, i))[: self.top_k]
            if not grow:
                break
            logits = self._forward_nodes(entry.state, nodes, forwarded, grow)
            forwarded.extend(grow)
            frontier = []
            for row, i in enumerate(grow):
                frontier += self._add_children(nodes, i, nodes[i].cum, depth - 1, logits[row], k)
        keep = sorted(range(len(nodes)), key=lambda i: (-nodes[i].cum, i))[:budget]
        keep_set = set(keep)
        for i in keep:  # closed under ancestors by construction; checked, not assumed
            p = nodes[i].parent
            assert p < 0 or p in keep_set, "kept a node without its parent"
        tree = TokenTree()
        remap: dict[int, int] = {-1: -1}
        kept: list[tuple[int, int, float]] = []  # (parent, token, prob), indexed as in ``tree``
        for i in sorted(keep):
            remap[i] = tree.add(remap[nodes[i].parent], nodes[i].token, self.name, draft_prob=nodes[i].prob)
            kept.append((remap[nodes[i].parent], nodes[i].token, nodes[i].prob))
        self.last_tree = tree
        return path_proposals(self.name, kept)

    def _add_children(self, nodes: list[_Node], parent: int, cum: float, depth: int, logits, k: int) -> list[int]:
        probs = torch.softmax(logits[: self.vocab_limit].double(), dim=-1)
        top = torch.topk(probs, k)
        added = []
        for p, tok in zip(top.values.tolist(), top.indices.tolist()):
            nodes.append(_Node(int(tok), parent, depth + 1, float(p), cum * float(p)))
            added.append(len(nodes) - 1)
        return added

    @torch.inference_mode()
    def _forward_nodes(self, state: KVState, nodes: list[_Node], forwarded: list[int], grow: list[int]):
        """Logits (F, V) after each node of ``grow``, in one forward; appends F cache entries.

        The cache holds the context (positions 0..n-1) then the ``forwarded`` nodes. A node
        at depth d sits at position n + d - 1 and sees the context and its ancestors only.
        """
        draft = self.draft
        n = state.length - len(forwarded)
        slot = {node: n + j for j, node in enumerate(forwarded)}
        total = state.length + len(grow)
        visible = torch.zeros((len(grow), total), dtype=torch.bool)
        visible[:, :n] = True
        for row, i in enumerate(grow):
            visible[row, state.length + row] = True
            p = nodes[i].parent
            while p >= 0:
                visible[row, slot[p]] = True
                p = nodes[p].parent
        q_pos = torch.tensor([n + nodes[i].depth - 1 for i in grow])
        tree_pos = torch.tensor([n + nodes[i].depth - 1 for i in forwarded + grow], dtype=torch.long)
        k_pos = torch.cat([torch.arange(n), tree_pos])
        mask = self._mask(visible, q_pos, k_pos)
        ids = torch.tensor([[nodes[i].token for i in grow]], dtype=torch.long, device=draft.device)
        out = draft.model(
            input_ids=ids,
            position_ids=q_pos.unsqueeze(0).to(draft.device),
            attention_mask=mask,
            cache=state.cache,
            use_cache=True,
        )
        state.length += len(grow)
        self.stats.tree_forwards += 1
        return out.logits[0]

    def _mask(self, visible: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor):
        """Additive 4D mask(s) as ``TorchTarget.tree_mask`` builds them (window per layer type)."""
        draft = self.draft

        def additive(vis: torch.Tensor) -> torch.Tensor:
            mask = torch.zeros(vis.shape, dtype=draft.dtype, device=draft.device)
            mask.masked_fill_(~vis.to(draft.device), torch.finfo(draft.dtype).min)
            return mask[None, None]

        masks = {"full_attention": additive(visible)}
        if self._window:
            in_window = (q_pos[:, None] - k_pos[None, :]) < self._window
            masks["sliding_attention"] = additive(visible & in_window)
            if not self._by_layer_type:
                return masks["sliding_attention"]
        return masks if self._by_layer_type else masks["full_attention"]

    def _sample_chain(self, entry: _Entry, logits, options, temperature: float, deadline) -> list[Proposal]:
        params = SamplingParams(
            temperature=temperature,
            top_p=float(options.get("top_p", 1.0)),
            top_k=int(options.get("top_k", 0)),
        )
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        for i in range(self.max_depth):
            if i and deadline is not None and time.perf_counter() >= deadline:
                self.stats.deadline_hits += 1
                break
            if i:
                logits = self._extend(entry.state, [tokens[-1]])
                self.stats.tree_forwards += 1
            q = target_probs(self._fit(logits), params)
            tok = int(torch.multinomial(q, 1, generator=self._generator).item())
            tokens.append(tok)
            rows.append(q)
            if tok in self._eos:
                break
        probs = tuple(float(r[t]) for r, t in zip(rows, tokens))
        return [
            Proposal(
                self.name,
                token_ids=tuple(tokens),
                token_probs=probs,
                token_dists=torch.stack(rows),
                confidence=math.prod(probs),
            )
        ]

    def _fit(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits over exactly the target's vocabulary (missing ids impossible)."""
        logits = logits.double()
        if logits.numel() >= self.vocab_limit:
            return logits[: self.vocab_limit]
        pad = torch.full((self.vocab_limit - logits.numel(),), float("-inf"), dtype=logits.dtype)
        return torch.cat([logits, pad])

    # ------------------------------------------------------------------ other tokenizer
    def _propose_text(self, ctx: DraftContext, deadline: float | None) -> list[Proposal]:
        if self.target_tokenizer is not None:
            text = self.target_tokenizer.decode(list(ctx.token_ids), skip_special_tokens=True)
        else:  # only the tail: the draft sees less, and its cache is rarely reusable
            text = ctx.text_tail
        if not text or text.endswith("\ufffd"):  # nothing, or a character still incomplete
            return []
        entry = self._entry(ctx.request_id)
        ids, ends = self._encode(entry, text)
        if len(ids) + self.max_depth > self.draft.max_context:
            self._entries.pop(ctx.request_id, None)
            return []
        logits = self._sync(entry, ids)
        entry.text, entry.ends = text, ends
        n = entry.state.length
        gen: list[int] = []
        probs: list[float] = []
        try:
            for i in range(self.max_depth):
                if i and deadline is not None and time.perf_counter() >= deadline:
                    self.stats.deadline_hits += 1
                    break
                if i:
                    logits = self._extend(entry.state, [gen[-1]])
                    self.stats.tree_forwards += 1
                row = torch.softmax(logits.double(), dim=-1)
                tok = int(torch.argmax(row))
                if tok in self._text_stop:
                    break
                gen.append(tok)
                probs.append(float(row[tok]))
        finally:
            self.draft.commit(entry.state, n, [])
        if not gen:
            return []
        cont = self._continuation(ids, gen)
        if not cont:
            return []
        return [Proposal(self.name, text=cont, confidence=math.prod(probs))]

    def _encode(self, entry: _Entry, text: str) -> tuple[list[int], list[int]]:
        """Draft ids for ``text``, reusing the cached ids up to a verified token boundary.

        Only the last ``REENCODE_TOKENS`` cached ids are re-encoded (with the new text
        after them); the first ``OVERLAP_TOKENS`` of those must come out unchanged, which
        shows the cut falls on a boundary the whole-text encoding also has.
        """
        tok = self.draft.tokenizer
        lead = self._lead
        j = len(entry.ids) - REENCODE_TOKENS
        if self._offsets and entry.text and j > len(lead):
            cut = entry.ends[j - 1]
            if cut > 0 and text.startswith(entry.text[:cut]):
                enc = tok(text[cut:], add_special_tokens=False, return_offsets_mapping=True)
                if enc["input_ids"][:OVERLAP_TOKENS] == entry.ids[j : j + OVERLAP_TOKENS]:
                    ids = entry.ids[:j] + list(enc["input_ids"])
                    ends = entry.ends[:j] + [cut + e for _, e in enc["offset_mapping"]]
                    return ids, ends
        self.stats.full_encodes += 1
        if self._offsets:
            enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
            return lead + list(enc["input_ids"]), [0] * len(lead) + [e for _, e in enc["offset_mapping"]]
        return lead + list(tok(text, add_special_tokens=False)["input_ids"]), []

    def _continuation(self, ids: list[int], gen: list[int]) -> str:
        """The text ``gen`` adds after ``ids`` (decoded with context, so joins are right)."""
        tok = self.draft.tokenizer
        tail = [t for t in ids[-4:] if t not in self._lead]
        head = tok.decode(tail, skip_special_tokens=True)
        full = tok.decode(tail + gen, skip_special_tokens=True)
        text = full[len(head) :] if full.startswith(head) else tok.decode(gen, skip_special_tokens=True)
        return text.rstrip("\ufffd")

    # ------------------------------------------------------------------ the cache
    def _entry(self, request_id: str) -> _Entry:
        entry = self._entries.get(request_id)
        if entry is None:
            entry = self._entries[request_id] = _Entry()
            while len(self._entries) > self.max_requests:
                self._entries.popitem(last=False)
        else:
            self._entries.move_to_end(request_id)
        return entry

    def _sync(self, entry: _Entry, ids: list[int]) -> torch.Tensor:
        """Make the cache hold exactly ``ids``; return the logits after the last one.

        The cache is cut to the common prefix (at most ``len(ids) - 1``, since the last
        id's logits are needed) and only the rest is prefilled.
        """
        lcp = 0
        limit = min(len(entry.ids), len(ids) - 1)
        while lcp < limit and entry.ids[lcp] == ids[lcp]:
            lcp += 1
        if lcp == 0:
            entry.state = KVState()
        elif lcp < entry.state.length:
            self.draft.commit(entry.state, lcp, [])
        entry.ids = []  # until the prefill succeeds, the cache holds nothing trustworthy
        try:
            logits = self._extend(entry.state, ids[lcp:])
        except BaseException:
            entry.state, entry.text, entry.ends = KVState(), "", []
            raise
        entry.ids = list(ids)
        self.stats.prefilled_tokens += len(ids) - lcp
        return logits

    @torch.inference_mode()
    def _extend(self, state: KVState, ids: Sequence[int]) -> torch.Tensor:
        """Append ``ids`` with the model's own causal mask; logits (V,) after the last."""
        draft = self.draft
        x = torch.tensor([list(ids)], dtype=torch.long, device=draft.device)
        pos = torch.arange(state.length, state.length + x.shape[1], device=draft.device).unsqueeze(0)
        out = draft.model(input_ids=x, position_ids=pos, cache=state.cache, use_cache=True, logits_to_keep=1)
        state.length += x.shape[1]
        return out.logits[0, -1]


def _kv_bytes(state: KVState) -> int:
    """Bytes of the storage behind a cache's tensors (a cropped view still holds all of it)."""
    seen: dict[int, int] = {}
    for layer in getattr(state.cache, "layers", ()):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _same_vocab(a, b) -> bool:
    try:
        return a.get_vocab() == b.get_vocab()
    except Exception:  # a tokenizer without get_vocab: treat as different (text is always safe)
        return False


def _leading_specials(tok) -> list[int]:
    """Ids the draft tokenizer puts before a text (a BOS), so the draft sees what it trained on."""
    try:
        with_specials = list(tok("a", add_special_tokens=True)["input_ids"])
        without = list(tok("a", add_special_tokens=False)["input_ids"])
    except Exception:
        return []
    if without and with_specials[-len(without) :] == without:
        return with_specials[: len(with_specials) - len(without)]
    return []
