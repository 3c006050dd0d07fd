"""Attention of a step's decode and tree tokens straight over the batched KV slab.

In a batched step most rows bring a few tokens: the pending root, maybe a draft tree. Attending
them with SDPA means a padded query batch per group of rows, a mask tensor per group and a gather
and scatter around every call, 30 layers a step, and SDPA's CPU kernel itself has a fixed price
per call larger than the arithmetic of a few queries over a few hundred keys. ``csrc/
tree_attention.cpp`` instead takes each (token, query head) as one item and reads the token's
visible keys and values from its row of the slab: the row's first ``ctx`` slots (its cache, plus
the chain of new tokens leading to it when they follow the cache directly), then the slots of its
other ancestors and itself. The work goes to the threads in units of one row's KV head and two of
its tokens, handed out as threads come free: a unit reads its KV head's cache once for its pairs,
and a thread streaming cold rows from memory no longer holds up one whose row is in cache (a tree
beside one-token rows at long contexts; BENCHMARKS, "The forward's cost").

A token's output depends only on its own query, its visible keys and values and their order, so
it is bitwise the same whatever else is in the step (``tests/core/test_tree_attention.py``).
Rows with many new tokens (a prefill chunk) keep SDPA, whose blocked products are faster there.
Where the kernel does not apply (float64, the exactness proofs' dtype; a sliding window; no build)
every row keeps SDPA. ``DRAFTMESH_TREE_ATTENTION=off`` turns it off.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass
from typing import Sequence

import torch

from draftmesh import packed_linear

log = logging.getLogger(__name__)

ENV = "DRAFTMESH_TREE_ATTENTION"
ABI = 2
"""``dm_tree_attention``'s calling convention this module speaks (``dm_tree_attention_abi``)."""
VECTOR_FLOATS = {"avx512": 16, "avx2": 8}
MAX_VECTORS_PER_HEAD = 16
"""The kernel keeps a head's query and output in registers: ``head_dim`` <= 16 vectors."""

_ptr = ctypes.c_void_p
_long = ctypes.c_long


class TreeAttention:
    """One build of the kernel (the native library of ``draftmesh.packed_linear``)."""

    def __init__(self, lib: ctypes.CDLL, isa: str) -> None:
        self.isa = isa
        self.vector = VECTOR_FLOATS[isa]
        fn = lib.dm_tree_attention
        fn.restype = None
        fn.argtypes = [_ptr, _ptr, _long, _ptr, _long, _long, _long, _ptr, _ptr, _long, _ptr, _ptr, _ptr, _ptr,
                       ctypes.c_float, _long, _ptr, _long, ctypes.c_int]
        self._fn = fn

    def supports(self, dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
        return (dtype == torch.float32 and device.type == "cpu" and head_dim % self.vector == 0
                and head_dim <= MAX_VECTORS_PER_HEAD * self.vector)

    def plan(self, rows: Sequence[tuple[int, int, int, Sequence[int]]]) -> "AttentionPlan":
        """The plan for rows given as (row, cached length, offset of its first token in the
        step, parents of its tokens)."""
        items, row_of, ctx, off, extra, rows_start = [], [], [], [0], [], [0]
        max_keys = 0
        for row, length, first, parents in rows:
            rows_start.append(rows_start[-1] + len(parents))
            paths: list[list[int]] = []
            for i, p in enumerate(parents):
                path = (paths[p] if p >= 0 else []) + [i]
                paths.append(path)
                run = 0
                while run < len(path) and path[run] == run:
                    run += 1
                items.append(first + i)
                row_of.append(row)
                ctx.append(length + run)
                extra.extend(length + j for j in path[run:])
                off.append(len(extra))
                max_keys = max(max_keys, length + len(path))
        as_long = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
        return AttentionPlan(self, as_long(items), as_long(row_of), as_long(ctx), as_long(off),
                             as_long(extra or [0]), max_keys, as_long(rows_start))


@dataclass
class AttentionPlan:
    """Where each of a step's planned tokens looks; ``run`` fills their outputs, per layer."""

    kernel: TreeAttention
    items: torch.Tensor
    rows: torch.Tensor
    ctx: torch.Tensor
    off: torch.Tensor
    extra: torch.Tensor
    max_keys: int
    rows_start: torch.Tensor
    """Each row's first item, and the end: the kernel works through a row KV head by KV head."""

    def run(self, q: torch.Tensor, out: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
            scale: float | None) -> None:
        """``out[t] = attention(q[t])`` for every planned token t; q and out (T, Hq, D) contiguous,
        keys and values one layer's slab [rows, Hk, capacity, D]."""
        total, heads, dim = q.shape
        if not (q.is_contiguous() and out.is_contiguous() and keys.is_contiguous() and values.is_contiguous()):
            raise ValueError("tree attention needs contiguous queries, outputs and slabs")
        scale = dim ** -0.5 if scale is None else scale
        self.kernel._fn(q.data_ptr(), out.data_ptr(), len(self.items), self.items.data_ptr(), heads,
                        keys.shape[1], dim, keys.data_ptr(), values.data_ptr(), keys.shape[2],
                        self.rows.data_ptr(), self.ctx.data_ptr(), self.off.data_ptr(), self.extra.data_ptr(),
                        float(scale), self.max_keys, self.rows_start.data_ptr(), len(self.rows_start) - 1,
                        torch.get_num_threads())


def _abi(lib: ctypes.CDLL) -> int | None:
    try:
        fn = lib.dm_tree_attention_abi
    except AttributeError:  # built before the ABI was numbered
        return None
    fn.restype, fn.argtypes = ctypes.c_int, []
    return int(fn())


_kernel: TreeAttention | None = None
_looked = False


def kernel() -> TreeAttention | None:
    """The kernel for this CPU, loaded once; None where it does not apply (then SDPA)."""
    global _kernel, _looked
    if not _looked:
        _looked = True
        build = packed_linear.native_build()
        if build is not None and os.environ.get(ENV, "").strip().lower() != "off":
            path, isa = build
            lib = packed_linear.native_library(path)
            abi = _abi(lib)
            if abi == ABI:
                _kernel = TreeAttention(lib, isa)
            else:
                log.warning("the native library %s has tree attention ABI %s, this code needs %s (built from an "
                            "older source: reinstall, `pip install -e .`); decode and tree tokens use SDPA",
                            path, abi, ABI)
    return _kernel
